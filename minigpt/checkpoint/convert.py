"""``minigpt export``: any model source -> a Hugging Face ``LlamaForCausalLM`` directory (``MixtralForCausalLM``
for a mixture of experts in Mixtral's layout) or a llama GGUF file.

Hugging Face directory (what ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` read,
offline): ``config.json`` (:func:`minigpt.interop.hf.config_to_hf` plus special-token ids and dtype), ``model.safetensors``
or, above ``max_shard_size``, ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: shard}}``, the layout of ``transformers``'
``save_pretrained``), ``generation_config.json``, and the tokenizer (``tokenizer.json``; a SentencePiece model is
written both as is, ``tokenizer.model``, and rebuilt as ``tokenizer.json``) with ``tokenizer_config.json`` and
``special_tokens_map.json``. The directory is written atomically.

Special tokens keep their roles both ways (HF directory and GGUF):

* BOS: a model whose tokenizer prepends BOS (:func:`minigpt.checkpoint.tokenizer_bos.adds_bos`: a llama2.c model,
  a Llama SentencePiece tokenizer, a GGUF with ``tokenizer.ggml.add_bos_token``) is exported with a tokenizer that
  does too: ``add_bos_token: true`` and a ``TemplateProcessing`` post-processor ``<s> $A`` in ``tokenizer.json``
  (``transformers`` 5 builds a ``PreTrainedTokenizerFast`` from ``tokenizer.json`` alone and ignores the flag
  without the template), or GGUF ``tokenizer.ggml.add_bos_token = true``. So ``AutoTokenizer(export)(text)``, and
  evaluation of the export, see the ids the model was trained on;
* end of generation: every stop id of the tokenizer (:attr:`~minigpt.tokenizer.tokenizer.Tokenizer.stop_ids`, e.g.
  ``<|endoftext|>`` and ``<|im_end|>`` after chat fine-tuning) goes into ``generation_config.json``'s
  ``eos_token_id`` (a list when there are several, as ``transformers.GenerationConfig`` reads it); in a GGUF, EOS is
  ``tokenizer.ggml.eos_token_id`` and the others ``tokenizer.ggml.eot_token_id`` / ``eom_token_id``
  (:func:`gguf_stop_roles`; llama.cpp also ends generation on end-of-turn tokens by name).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

import torch

from minigpt.checkpoint.atomic import check_output_file, save_tensors
from minigpt.checkpoint.native import atomic_dir, load_chat_template, load_model, load_tokenizer, model_state_dict
from minigpt.checkpoint.tokenizer_bos import adds_bos, template_prefix
from minigpt.errors import MiniGPTError
from minigpt.interop import hf
from minigpt.interop.gguf import write_gguf
from minigpt.model.quant import is_quantized
from minigpt.runtime import DTYPES, parse_size
from minigpt.tokenizer.interop import build_tokenizer, hf_tokenizer_config, vocab_from_file
from minigpt.tokenizer.roles import END_OF_TURN_NAMES


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` (in order) into shards of at most ``max_bytes`` each; a larger tensor gets its own shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def write_safetensors(tensors: dict[str, torch.Tensor], directory: Path, max_bytes: int) -> list[str]:
    """Write ``model.safetensors``, or shards plus ``model.safetensors.index.json``; returns the file names."""
    parts = shard(tensors, max_bytes)
    if len(parts) == 1:
        save_tensors(parts[0], directory / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        save_tensors(part, directory / name, metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]


def _special_ids(tokenizer) -> dict[str, Optional[int]]:
    return {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id,
            "unk_token": tokenizer.token_to_id("<unk>")}


def generation_config(tokenizer) -> dict:
    """``generation_config.json`` of a tokenizer: ``bos_token_id``, ``pad_token_id`` and ``eos_token_id``, every stop
    id (EOS first) as a list when there are several, the single id otherwise (``transformers.GenerationConfig``)."""
    out = {"bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id}
    stop = list(tokenizer.stop_ids)
    out["eos_token_id"] = stop if len(stop) > 1 else stop[0] if stop else tokenizer.eos_id
    return {k: v for k, v in out.items() if v is not None}


def gguf_stop_roles(tokenizer) -> tuple[Optional[int], Optional[int]]:
    """``(eot_id, eom_id)`` for a GGUF (``tokenizer.ggml.eot_token_id`` / ``eom_token_id``, the key names of the
    ``gguf`` package's ``Keys.Tokenizer.EOT_ID`` / ``EOM_ID``): the tokenizer's stop ids besides EOS, a known
    end-of-turn spelling (``<|im_end|>``, ``<|eot_id|>`` ...) first and ``<|eom_id|>`` as end of message. A third
    stop id has no key; llama.cpp still stops on it when its spelling is one of its end-of-generation names."""
    others = [i for i in tokenizer.stop_ids if i != tokenizer.eos_id]
    name = tokenizer.id_to_token
    eom = next((i for i in others if name(i) == "<|eom_id|>"), None)
    others = [i for i in others if i != eom]
    turn = [i for i in others if name(i) in END_OF_TURN_NAMES] + [i for i in others if name(i) not in END_OF_TURN_NAMES]
    eot = turn[0] if turn else None
    if eom is None and len(turn) > 1:
        eom = turn[1]
    return eot, eom


def _add_bos_template(tokenizer_file: Path, bos: str) -> None:
    """Make ``tokenizer_file`` (a ``tokenizer.json``) prepend ``bos`` as Llama's does (``<s> $A`` / ``<s> $A <s>
    $B``, the template of ``LlamaTokenizerFast.update_post_processor``), unless its post-processor already does; a
    post-processor of another kind (byte-level offsets) is kept, followed by the template."""
    d = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import Sequence, TemplateProcessing

    tok = HFTokenizer.from_file(str(tokenizer_file))
    if template_prefix(d.get("post_processor")) == [tok.token_to_id(bos)]:
        return
    template = TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                  special_tokens=[(bos, tok.token_to_id(bos))])
    kept = tok.post_processor if template_prefix(d.get("post_processor")) is None else None
    tok.post_processor = template if kept is None else Sequence([kept, template])
    tok.save(str(tokenizer_file))


def _float_model(source: str | Path):
    """:func:`load_model`, refusing an int8-quantized directory (its layers have no float weight to export)."""
    model = load_model(source)
    if is_quantized(model):
        raise MiniGPTError(f"{source} holds int8/int4-quantized weights (minigpt.model.quant); export the float checkpoint it "
                           "was quantized from instead")
    return model


def export_hf(source: str | Path, out: str | Path, dtype: str = "float32", max_shard_size: str | int = "5GB") -> Path:
    """Write ``source`` (any model source :func:`minigpt.checkpoint.native.load_model` reads) as a ``LlamaForCausalLM``
    (or ``MistralForCausalLM`` / ``MixtralForCausalLM``, see :func:`minigpt.interop.hf.config_to_hf`) directory ``out`` in ``dtype`` (float32 / bfloat16 / float16). Returns ``out``.

    Without a tokenizer at ``source`` only the model files are written. Raises :class:`MiniGPTError` for an
    unknown dtype, an unreadable source, or a config field the architecture cannot represent.
    """
    if dtype not in DTYPES:
        raise MiniGPTError(f"--dtype {dtype!r} is not available for Hugging Face export; choose one of "
                           f"{sorted(DTYPES)}")
    max_bytes = parse_size(max_shard_size, "--max-shard-size", minimum=1)
    model = _float_model(source)
    hf.config_to_hf(model.config)  # refuses, by field name, what the architecture cannot hold
    try:
        tokenizer = load_tokenizer(source)
    except MiniGPTError:
        tokenizer = None
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf.state_dict_to_hf(model_state_dict(model)).items()}
    ids = _special_ids(tokenizer) if tokenizer is not None else {}
    token_ids = {f"{k}_id": ids.get(k) for k in ("bos_token", "eos_token", "pad_token")}
    with atomic_dir(out) as tmp:
        write_safetensors(tensors, tmp, max_bytes)
        config = hf.config_to_hf(model.config, **token_ids, torch_dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = (generation_config(tokenizer) if tokenizer is not None
                      else {k: v for k, v in token_ids.items() if v is not None})
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer_file = tokenizer.save(tmp)
            if tokenizer_file.suffix == ".model":
                # transformers can convert a tokenizer.model only with protobuf installed; an equivalent
                # tokenizer.json beside it loads with nothing extra (minigpt keeps using the .model).
                tokenizer_file = tmp / "tokenizer.json"
                build_tokenizer(vocab_from_file(tmp / "tokenizer.model")).save(str(tokenizer_file))
            tok_config, special_map = hf_tokenizer_config(tokenizer_file, ids, model.config.max_seq_len,
                                                          load_chat_template(source))
            if adds_bos(source, tokenizer):
                _add_bos_template(tokenizer_file, tokenizer.id_to_token(tokenizer.bos_id))
                tok_config["add_bos_token"] = True
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
            (tmp / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    return Path(out)


def export_gguf(source: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write ``source`` as a llama GGUF (``dtype``: float32 / float16 / bfloat16 / q8_0) with its tokenizer.

    ``out`` ending in ``.gguf`` is the file; otherwise it is a directory that receives ``model.gguf``. Returns the
    file written. An existing file there is overwritten (as llama.cpp's converter does), but before the model is
    loaded :func:`~minigpt.checkpoint.atomic.check_output_file` raises :class:`MiniGPTError` for a file that is the
    source itself, a directory in its place, or a path under an existing file.
    """
    out = Path(out)
    path = check_output_file(out if out.suffix == ".gguf" else out / "model.gguf", [source])
    model = _float_model(source)
    vocab = None
    try:
        tokenizer = load_tokenizer(source)
    except MiniGPTError:
        tokenizer = None
    if tokenizer is not None:
        with tempfile.TemporaryDirectory() as tmp:
            vocab = vocab_from_file(tokenizer.save(Path(tmp)))
        vocab.bos_id, vocab.eos_id, vocab.pad_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
        vocab.eot_id, vocab.eom_id = gguf_stop_roles(tokenizer)
        vocab.add_bos = adds_bos(source, tokenizer)
        vocab.chat_template = load_chat_template(source)
    name = Path(source).stem if Path(source).is_file() else Path(source).resolve().name
    return write_gguf(model_state_dict(model), model.config, path, dtype, vocab, name=name)
