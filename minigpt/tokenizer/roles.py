"""Which token ids are BOS, EOS, padding, unknown and end of generation, as a model's own files say.

Sources, in the precedence of the reference implementations:

* Hugging Face directories (transformers' ``PreTrainedTokenizerBase.from_pretrained``): ``bos_token`` /
  ``eos_token`` / ``pad_token`` / ``unk_token`` of ``tokenizer_config.json`` (a string, an AddedToken dict or
  null = none); when that file has no ``added_tokens_decoder`` (older files), ``special_tokens_map.json`` overrides
  it key by key. Generation stops on ``generation_config.json``'s ``eos_token_id`` (an int or a list: all stop;
  ``GenerationConfig``), or without that file on ``config.json``'s, as ``model.generate`` does; MiniGPT also stops
  on the tokenizer's EOS. ``add_bos_token`` says whether the tokenizer prepends BOS by itself.
* GGUF (llama.cpp's ``llama_vocab::impl::load``): ``tokenizer.ggml.{bos,eos,padding,unknown}_token_id``;
  generation ends on EOS, ``eot_token_id``, ``eom_token_id`` and on every token spelled as in llama.cpp's
  end-of-generation list (:data:`LLAMA_CPP_EOG_NAMES`), which llama.cpp applies to every GGUF.

A role no file mentions is looked up by name (:data:`BOS_NAMES` ...) by :class:`~minigpt.tokenizer.Tokenizer`;
a role a file sets to null stays empty (Qwen2's ``"bos_token": null`` means no BOS, not ``<|endoftext|>``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from minigpt.errors import MiniGPTError, read_json_object, shown_json

# A role no file mentions (as opposed to None: a file says there is none).
UNSET = "unset"
Role = Union[int, None, str]

# Names that tokenizers commonly give their BOS / EOS / pad / end-of-turn tokens, most specific first; only used
# for roles no file sets.
BOS_NAMES = ("<|endoftext|>", "<s>", "<|begin_of_text|>", "[CLS]", "<bos>")
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>", "[SEP]", "<eos>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
UNK_NAMES = ("<unk>", "[UNK]", "<|unk|>")
END_OF_TURN_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")

# Tokens that end generation in every GGUF, by spelling: ggml-org/llama.cpp src/llama-vocab.cpp @ e06c3ab2bc,
# lines 2475-2491 (the FIM pad / repo / file-separator ids llama.cpp also adds are left out).
LLAMA_CPP_EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                       "<|end_of_text|>", "<end_of_utterance>")

SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class TokenRoles:
    """The special-token ids a model's files declare.

    ``bos`` / ``eos`` / ``pad`` / ``unk``: an id, None (the files say there is none) or :data:`UNSET`.
    ``stop``: further ids that end generation (EOS always does). ``add_bos``: the tokenizer prepends BOS by itself
    (None: not said). ``source``: what the roles were read from, for messages.
    """

    bos: Role = UNSET
    eos: Role = UNSET
    pad: Role = UNSET
    unk: Role = UNSET
    stop: tuple[int, ...] = ()
    add_bos: Optional[bool] = None
    source: str = ""
    named_eog: bool = field(default=False)  # also stop on LLAMA_CPP_EOG_NAMES (GGUF)


def _read(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    return read_json_object(path, hint="; fix or delete it")


def _content(value, key: str, where: Path) -> Optional[str]:
    """A special token as written in tokenizer_config.json / special_tokens_map.json: a string, an AddedToken
    dict (``{"content": "..."}``) or null (none). Raises :class:`MiniGPTError` naming ``where`` and ``key`` for
    anything else (a number, a list, a dict whose ``content`` is not a string)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise MiniGPTError(f"'{key}' in {where} must be the token's text, an AddedToken object "
                       f'{{"content": "<text>", ...}} or null, not {shown_json(value)}; fix that file')


def _ids(value, key: str, where: Path) -> tuple[int, ...]:
    """A ``*_token_id`` value of generation_config.json / config.json: null, an id or a list of ids. Raises
    :class:`MiniGPTError` naming ``where`` and ``key`` for anything else (a string, a fraction, a boolean, a list
    holding one): ignored, a wrong EOS would let generation run to its token limit without a word."""
    def is_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if value is None:
        return ()
    if is_id(value):
        return (value,)
    if isinstance(value, list) and all(is_id(v) for v in value):
        return tuple(value)
    raise MiniGPTError(f"'{key}' in {where} must be a token id, a list of ids or null, not {shown_json(value)}; "
                       "fix that file")


def roles_from_dir(directory: Union[str, Path], token_to_id: Callable[[str], Optional[int]],
                   vocab_size: int) -> TokenRoles:
    """The roles declared by the Hugging Face side files of ``directory`` (none present: everything UNSET).

    A token named in a file but absent from the vocabulary counts as no token. Raises :class:`MiniGPTError` for a
    side file that is not a JSON object, and for a ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``
    that is neither a string, an AddedToken dict with a string ``content`` nor null (the message names the file and
    the key).
    """
    directory = Path(directory)
    config_path, map_path = directory / "tokenizer_config.json", directory / "special_tokens_map.json"
    config = _read(config_path) or {}
    special_map = _read(map_path)
    generation = _read(directory / "generation_config.json")
    model_config = _read(directory / "config.json") or {}
    declared = {k: (v, config_path) for k, v in config.items()}
    if special_map is not None and "added_tokens_decoder" not in config:
        declared.update({k: (v, map_path) for k, v in special_map.items() if k.endswith("_token")})
    roles = TokenRoles(source=str(directory))
    for role in ("bos", "eos", "pad", "unk"):
        key = f"{role}_token"
        if key in declared:
            value, where = declared[key]
            text = _content(value, key, where)
            setattr(roles, role, token_to_id(text) if text is not None else None)
    # The ids of generation_config.json / config.json name BOS and pad too when the tokenizer files are silent.
    generation_path, model_path = directory / "generation_config.json", directory / "config.json"
    for role in ("bos", "pad"):
        if getattr(roles, role) == UNSET:
            for d, where in ((generation, generation_path), (model_config, model_path)):
                if d is not None and f"{role}_token_id" in d:
                    ids = _ids(d[f"{role}_token_id"], f"{role}_token_id", where)
                    setattr(roles, role, ids[0] if ids else None)
                    break
    if generation is not None and "eos_token_id" in generation:
        stop = _ids(generation["eos_token_id"], "eos_token_id", generation_path)
    else:
        stop = _ids(model_config.get("eos_token_id"), "eos_token_id", model_path)
    roles.stop = tuple(i for i in stop if 0 <= i < vocab_size)
    if roles.eos == UNSET and roles.stop:
        roles.eos = roles.stop[0]
    if isinstance(config.get("add_bos_token"), bool):
        roles.add_bos = config["add_bos_token"]
    return roles


def roles_from_gguf(bos: Optional[int], eos: Optional[int], pad: Optional[int], unk: Optional[int],
                    eot: Optional[int], eom: Optional[int], add_bos: Optional[bool], where: str) -> TokenRoles:
    """The roles of a GGUF's ``tokenizer.ggml.*_token_id`` keys (an absent key leaves its role UNSET)."""
    pick = lambda i: UNSET if i is None else int(i)  # noqa: E731
    return TokenRoles(bos=pick(bos), eos=pick(eos), pad=pick(pad), unk=pick(unk),
                      stop=tuple(int(i) for i in (eot, eom) if i is not None), add_bos=add_bos, source=where,
                      named_eog=True)


def config_files(bos: Optional[str], eos: Optional[str], pad: Optional[str], unk: Optional[str],
                 stop_ids: list[int], bos_id: Optional[int], add_bos: Optional[bool],
                 chat_template: Optional[str] = None) -> dict[str, dict]:
    """``{file name: content}`` of the tokenizer_config.json and generation_config.json that make
    :func:`roles_from_dir` give back these roles (``stop_ids[0]`` should be the EOS id)."""
    config: dict = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    if chat_template:
        config["chat_template"] = chat_template
    generation: dict = {"eos_token_id": stop_ids if len(stop_ids) != 1 else stop_ids[0]}
    if bos_id is not None:
        generation["bos_token_id"] = bos_id
    return {"tokenizer_config.json": config, "generation_config.json": generation}
