"""Saving and loading models and training checkpoints, atomically and with clear errors.

A model directory holds ``config.json`` (our :class:`ModelConfig` fields), ``model.safetensors`` and, when known,
``tokenizer.json``. :func:`load_model` also accepts a Hugging Face Llama / Mistral / Qwen2 directory (single-file or
sharded safetensors, any float dtype), a GGUF file (:mod:`minigpt.interop.gguf`) and a llama2.c ``.bin`` checkpoint
(:mod:`minigpt.interop.llama2c`). Every directory is written under a temporary name, fsynced, then renamed, so a crash leaves
either the old checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minigpt.checkpoint.atomic import FORMAT, atomic_dir, save_tensors, verify_manifest
from minigpt.checkpoint.quantized import (
    build_quantized,
    check_quantization,
    load_quantized,
    materialize,
    write_tokenizer_files,
)
from minigpt.errors import MiniGPTError, read_json_object
from minigpt.interop import hf
from minigpt.interop.gguf import gguf_tensor_shapes, iter_gguf_weights, read_gguf, read_gguf_weights, read_vocab
from minigpt.interop.llama2c import find_tokenizer, read_llama2c
from minigpt.model.config import ModelConfig
from minigpt.model.quant import (
    METHOD,
    SCHEMES,
    Int4Linear,
    Int8Linear,
    quant_config,
    quantize_weight,
    quantize_weight_int4,
)
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.chat_template import template_from_config, template_text
from minigpt.tokenizer.interop import build_tokenizer, read_llama2c_tokenizer
from minigpt.tokenizer.roles import roles_from_gguf
from minigpt.tokenizer.tokenizer import Tokenizer, TokenizerMissing


def model_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """State dict without the tied LM head (safetensors refuses shared storage; the head is re-tied on load)."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("output.weight", None)
    return sd


def write_model_files(model: Transformer, directory: Path, tokenizer=None, chat_template: Optional[str] = None
                      ) -> None:
    """Write ``config.json``, ``model.safetensors`` (and ``tokenizer.json``, ``chat_template.jinja``) into an
    existing ``directory``."""
    config = {"format": FORMAT, **model.config.to_dict()}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tensors(model_state_dict(model), directory / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory / "tokenizer.json")
    if chat_template:
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def save_pretrained(model: Transformer, directory: str | Path, tokenizer=None, chat_template: Optional[str] = None
                    ) -> Path:
    """Atomically write a model directory (see module docstring), with the Jinja ``chat_template`` when given.
    Returns its path."""
    with atomic_dir(directory) as tmp:
        write_model_files(model, tmp, tokenizer, chat_template)
    return Path(directory)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        what = "is not a file" if path.exists() else "is missing"
        raise MiniGPTError(f"{path.parent} is not a model directory: {path.name} {what}")
    return read_json_object(path)


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index lists, by their stored names.

    Raises :class:`MiniGPTError` for a missing, truncated or corrupt file.
    """
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            tensors: dict[str, torch.Tensor] = {}
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise MiniGPTError(f"{index} has no weight_map of tensor names to shard files")
            for shard in sorted(set(weight_map.values())):
                if not (directory / shard).is_file():
                    raise MiniGPTError(f"{directory} is missing shard {shard} listed in {index.name}")
                tensors.update(load_file(str(directory / shard)))
            return tensors
    except SafetensorError as e:
        raise MiniGPTError(f"{directory}: the weights file is corrupt or truncated ({e})") from None
    if (directory / "dcp").is_dir():
        raise MiniGPTError(f"{directory} is a sharded training checkpoint: run `minigpt checkpoint consolidate "
                           f"{directory} OUT_DIR` to make a single-file model")
    raise MiniGPTError(f"{directory} has no weights: expected model.safetensors (or a sharded index)")


def check_claims(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse a config that claims more layers or experts than ``tensors`` can hold, before anything is built
    per layer: a header saying 2^31 layers must fail in a moment, not after building (or looping over) them all.
    Each layer, and each expert of a layer, has at least one tensor of its own. Raises :class:`MiniGPTError`."""
    blocks = config.n_layers
    if blocks <= len(tensors) and config.n_experts:
        blocks += config.n_experts * config.n_moe_layers
    if blocks > len(tensors):
        raise MiniGPTError(f"{source} does not match its config: {config.n_layers} layers and "
                           f"{config.n_experts} experts need more tensors than the {len(tensors)} it holds")


def check_shapes(expected: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], source: str,
                 names: bool = True) -> None:
    """Raise :class:`MiniGPTError` unless ``sd`` has exactly the names (unless not ``names``: only the tensors both
    have are compared) and shapes of ``expected``, which may live on the meta device: checking allocates nothing."""
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if names and (missing or unexpected):
        raise MiniGPTError(
            f"{source} does not match its config: missing tensors {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for k, v in sd.items():
        if k in expected and v.shape != expected[k].shape:
            raise MiniGPTError(
                f"{source}: tensor {k} has shape {tuple(v.shape)} but the config implies {tuple(expected[k].shape)}"
            )


def load_state_into(model: Transformer, sd: dict[str, torch.Tensor], source: str) -> None:
    """Make ``sd``'s tensors ``model``'s parameters (``load_state_dict(assign=True)``: no copy; a tensor read from
    a safetensors file stays a view of its memory-mapped pages), raising :class:`MiniGPTError` on
    missing/unexpected tensors or shape mismatch. The tied LM head is re-tied to the new embedding."""
    check_shapes(model_state_dict(model), sd, source)
    # Why not a copy into the model's own storage: that copy was 0.22 s of every `minigpt generate` at 135M
    # parameters in fp32 (measured), for tensors the fast path reads, or fuses into new ones, once.
    model.load_state_dict(sd, strict=False, assign=True)  # strict=False only because the tied head is absent from sd
    if model.config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight


def load_config(directory: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a MiniGPT or Hugging Face model directory."""
    directory = Path(directory)
    d = _read_json(directory / "config.json")
    try:
        if d.get("format") == FORMAT:
            return ModelConfig.from_dict({k: v for k, v in d.items() if k not in ("format", "quantization")})
        if hf.is_hf_dir(directory):
            return hf.config_from_hf(d)
    # A field of the wrong type or size: a string, list or 2^64 where a count belongs, Infinity as a factor.
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise MiniGPTError(f"{directory}/config.json is invalid: {type(e).__name__}: {e}") from None
    raise MiniGPTError(f"{directory}/config.json is neither a MiniGPT nor a Hugging Face config")


def read_source(source: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict in our names)`` of any model source :func:`load_model` accepts.

    Raises :class:`MiniGPTError` for a missing or unreadable source, or a config claiming more layers or experts
    than the source has tensors (:func:`check_claims`).
    """
    source = Path(source)
    if source.is_file():
        if source.suffix == ".gguf":
            gf = read_gguf(source)
            config, tensors = gf.config, read_gguf_weights(gf)
        elif source.suffix == ".bin":
            config, tensors = read_llama2c(source)
        else:
            raise MiniGPTError(f"{source}: unknown model file type; expected a directory, a .gguf or a llama2.c .bin")
        check_claims(config, tensors, str(source))
        return config, tensors
    if not source.is_dir():
        raise MiniGPTError(f"checkpoint {source} does not exist")
    verify_manifest(source)
    config = load_config(source)
    tensors = read_weights(source)
    check_claims(config, tensors, str(source))
    d = _read_json(source / "config.json")
    if hf.is_hf_dir(source) and d.get("format") != FORMAT:
        tensors = hf.state_dict_from_hf(tensors, config, hf.architecture(d))
    return config, tensors


def load_model(
    source: str | Path,
    device: str | torch.device = "cpu",
    dtype: Optional[torch.dtype] = None,
    quantize: Optional[str] = None,
) -> Transformer:
    """Load a model into a :class:`Transformer` in eval mode, ``dtype`` (default float32) on ``device``.

    ``source``: a MiniGPT or Hugging Face directory, a training run directory (its ``latest`` checkpoint), a
    ``.gguf`` file or a llama2.c ``.bin`` file. A directory
    saved quantized (:func:`minigpt.checkpoint.quantized.save_quantized`) loads as a quantized model (int8 weights kept; ``dtype``
    applies to its float tensors). ``quantize`` (``"int8"`` / ``"int4"``, :data:`minigpt.model.quant.SCHEMES`)
    loads any other source quantized (what :func:`minigpt.model.quant.quantize_model` makes of the float model, bit
    for bit) without building the float model first: each weight is quantized as it is read, and a GGUF is read one
    tensor at a time, so the peak memory is about the quantized model plus one float32 tensor
    (:func:`_load_quantizing`). Raises :class:`MiniGPTError` for a missing directory/file, corrupt weights, weights
    that do not fit the config, or an unknown ``quantize``.
    """
    if quantize not in (None, "none", *SCHEMES):
        raise MiniGPTError(f"unknown quantization {quantize!r}; choose {', '.join(SCHEMES)} or none")
    source = _follow_latest(source)
    quantization = quantization_of(source)
    if quantize in SCHEMES and quantization is None:
        return _load_quantizing(source, SCHEMES[quantize], device, dtype)
    config, tensors = read_source(source)
    if quantization is not None:
        quantization = check_quantization(quantization, str(source))
        # Shapes checked on the meta device first, as below; load_quantized names missing tensors its own way.
        meta = _on_meta(lambda: build_quantized(config, "meta", quantization), source)
        check_shapes(meta.state_dict(), tensors, str(source), names=False)
        return load_quantized(config, tensors, str(source), device, dtype, quantization, on_meta=meta)
    model = _on_meta(lambda: Transformer(config), source)
    # Checked while the model is still on the meta device: a header that claims a vocabulary or width its tensors
    # do not have is refused here rather than sizing the allocation below.
    check_shapes(model_state_dict(model), tensors, str(source))
    model = materialize(model, device)
    model.init_rope(device)
    load_state_into(model, tensors, str(source))
    # The parameters now have the stored dtype (and the CPU): converted here, a no-op where they already match.
    model = model.to(device=device, dtype=dtype or torch.float32)
    return model.eval()


def _load_quantizing(source: str | Path, method: str, device: str | torch.device, dtype: Optional[torch.dtype]
                     ) -> torch.nn.Module:
    """:func:`load_model` with ``quantize`` for a float source: the empty quantized model (``method``) is built first
    and each tensor is converted into it as it comes (from a GGUF, read and dequantized one at a time). Each weight
    is cast to ``dtype`` before it is quantized, as ``quantize_model(load_model(source, dtype=dtype), method)``
    does."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        gf = read_gguf(path)
        config, shapes = gf.config, gguf_tensor_shapes(gf)
        stream: Iterable[tuple[str, torch.Tensor]] = iter_gguf_weights(gf)
    else:
        config, tensors = read_source(source)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        stream = ((k, tensors.pop(k)) for k in list(tensors))  # each float tensor freed once converted
    # Names and shapes are checked, on the meta device, before anything is allocated or read.
    placeholders = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    check_claims(config, placeholders, str(source))
    check_shapes(model_state_dict(_on_meta(lambda: Transformer(config), source)), placeholders, str(source))
    model = build_quantized(config, device, quant_config(method))
    targets = model.state_dict()  # views of the model's own tensors: copying into them fills the model
    dtype = dtype or torch.float32
    for key, w in stream:
        # A tied embedding is also the LM head, which gets its own quantized copy.
        for name in [key] + (["output.weight"] if key == "tok_embeddings.weight" and config.tie_embeddings else []):
            layer = model.get_submodule(name.rpartition(".")[0]) if name.endswith(".weight") else None
            if isinstance(layer, Int4Linear):
                q, scale = quantize_weight_int4(w.to(dtype), layer.group_size)
            elif isinstance(layer, Int8Linear):
                q, scale = quantize_weight(w.to(dtype))
            else:
                targets[name].copy_(w)
                continue
            targets[name].copy_(q)
            targets[f"{name}_scale"].copy_(scale)
        del w
    if dtype != torch.float32:
        for m in model.modules():  # as load_quantized: float tensors cast, int8 weights and their scales kept
            for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                if t is not None and t.is_floating_point() and name != "weight_scale":
                    t.data = t.data.to(dtype)
    return model.eval()


def _on_meta(build, source: str | Path):
    """``build()`` under the meta device (nothing is allocated). What a config that passed its own checks can still
    hold (a bool or an int beyond int64 where torch wants a size, a RoPE theta beyond float range) is a one-line
    :class:`MiniGPTError`."""
    try:
        with torch.device("meta"):
            return build()
    except (ValueError, TypeError, OverflowError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise MiniGPTError(f"{source}: its config does not describe a model that can be built "
                           f"({type(e).__name__}: {first})") from None


def quantization_of(source: str | Path) -> Optional[dict]:
    """The ``quantization`` entry of a MiniGPT directory's ``config.json`` (None: a float model)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        return None
    d = _read_json(path)
    quantization = d.get("quantization") if d.get("format") == FORMAT else None
    if quantization is not None and not isinstance(quantization, dict):
        raise MiniGPTError(f"{path}: 'quantization' must be an object like {{\"method\": \"{METHOD}\"}}, "
                           f"not {quantization!r}")
    return quantization


def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of a model source, with the special-token roles its files declare
    (:mod:`minigpt.tokenizer.roles`): SentencePiece ``tokenizer.model`` or else ``tokenizer.json`` in a directory
    (with ``tokenizer_config.json`` / ``special_tokens_map.json`` / ``generation_config.json`` beside it), the
    ``tokenizer.*`` metadata of a GGUF, or the tokenizer beside a llama2.c ``.bin``.

    Raises :class:`TokenizerMissing` when the source has none, :class:`MiniGPTError` (one line: the file, what is
    unsupported, what to do) when it has one that cannot be read.
    """
    source = Path(_follow_latest(source))
    if source.is_file() and source.suffix == ".gguf":
        vocab = read_vocab(source)
        if vocab is None:
            raise TokenizerMissing(f"{source} has no tokenizer metadata (tokenizer.ggml.*); give one with "
                                   "--tokenizer FILE where the command has it")
        roles = roles_from_gguf(vocab.bos_id, vocab.eos_id, vocab.pad_id, vocab.unk_id, vocab.eot_id, vocab.eom_id,
                                vocab.add_bos, str(source))
        return Tokenizer(hf=build_tokenizer(vocab), roles=roles)
    if source.is_file() and source.suffix == ".bin":
        found = find_tokenizer(source)
        if found is None:
            raise TokenizerMissing(f"no tokenizer beside {source}: expected tokenizer.model, *.model, tokenizer.bin "
                                   "or tok*.bin in the same directory")
        if found.suffix == ".model":
            return Tokenizer.from_file(found)
        vocab = read_llama2c_tokenizer(found)
        return Tokenizer(hf=build_tokenizer(vocab), roles=roles_from_gguf(vocab.bos_id, vocab.eos_id, None,
                                                                            vocab.unk_id, None, None, True, str(found)))
    # A tokenizer.json beside a SentencePiece model is a conversion of it (Hugging Face repos, our own HF export)
    # that differs in whitespace normalisation; the original is the reference.
    return Tokenizer.from_dir(source, prefer_sentencepiece=True)


def load_chat_template(source: str | Path) -> Optional[str]:
    """The chat template (a Jinja string) stored with a model source, or None: a GGUF's ``tokenizer.chat_template``,
    a directory's ``chat_template.jinja``, else the ``chat_template`` of its ``tokenizer_config.json`` (a string,
    or Hugging Face's list of named templates: :func:`~minigpt.tokenizer.chat_template.template_from_config`).
    The string is a :class:`~minigpt.tokenizer.chat_template.TemplateText` that names the file it came from.

    Raises :class:`MiniGPTError` (naming the file) for a template that is neither a string nor that list (or a list
    without a ``default`` template), and for a ``chat_template.jinja`` that is not UTF-8 text. An empty template
    (only white space) is None, with a ``RuntimeWarning`` naming its file.
    """
    source = Path(source)
    if source.is_file() and source.suffix == ".gguf":
        vocab = read_vocab(source)
        value = vocab.chat_template if vocab else None
        return template_from_config(value, f"{source} (tokenizer.chat_template)")
    if source.is_dir():
        jinja = source / "chat_template.jinja"
        if jinja.is_file():
            try:
                return template_text(jinja.read_text(encoding="utf-8"), str(jinja))
            except UnicodeDecodeError as e:
                raise MiniGPTError(f"{jinja} is not UTF-8 text ({e}); fix or delete it") from None
        config = source / "tokenizer_config.json"
        if config.is_file():
            return template_from_config(_read_json(config).get("chat_template"), str(config))
    return None


def import_model(
    source: str | Path, out: str | Path, tokenizer_path: Optional[str | Path] = None, dtype: torch.dtype = torch.float32
) -> Path:
    """``minigpt import``: read any model source and write it as a MiniGPT model directory ``out``.

    The tokenizer comes from ``tokenizer_path`` if given, else from the source; a source without any tokenizer is
    written alone, but one whose tokenizer cannot be built is an error and nothing is written. The special-token
    roles and the chat template are kept in ``tokenizer_config.json`` and ``generation_config.json`` (Hugging Face
    shapes, read back by :func:`load_tokenizer`). Raises :class:`MiniGPTError` for an unreadable source.
    """

    model = load_model(source, dtype=dtype)
    if tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(tokenizer_path)
    else:
        try:
            tokenizer = load_tokenizer(source)
        except TokenizerMissing:
            tokenizer = None
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size} embeddings")
    chat_template = load_chat_template(source)
    with atomic_dir(out) as tmp:
        write_model_files(model, tmp)
        write_tokenizer_files(tmp, tokenizer, chat_template)
    return Path(out)


MODEL_FILE_SUFFIXES = (".gguf", ".bin")


def _follow_latest(source: str | Path) -> str | Path:
    """A run directory (no ``config.json``, a ``latest`` pointer) -> its latest checkpoint; anything else as is."""
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "latest").is_file():
        return resolve_checkpoint(path)
    return source


def resolve_checkpoint(path: str | Path) -> Path:
    """A model source from a run directory (follows its ``latest`` pointer), a model directory, a ``.gguf`` file or
    a llama2.c ``.bin`` file.

    Raises :class:`MiniGPTError` if ``path`` is none of them.
    """
    path = Path(path)
    if path.is_file() and path.suffix in MODEL_FILE_SUFFIXES:
        return path
    if not path.is_dir():
        what = "is not a model file" if path.exists() else "does not exist"
        raise MiniGPTError(f"checkpoint {path} {what} (give a run dir, checkpoint dir, HF model dir, "
                           ".gguf file or llama2.c .bin file)")
    if (path / "config.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        target = path / latest.read_text().strip()
        if target.is_dir():
            return target
        raise MiniGPTError(f"{latest} points at {target}, which does not exist")
    what = "is not a file" if (path / "config.json").exists() else "is missing"
    raise MiniGPTError(f"{path} is not a model directory: config.json {what}")
