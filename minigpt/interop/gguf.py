"""GGUF, llama.cpp's single-file model format, for ``general.architecture == "llama"`` (read and write) and
``"qwen2"`` (read; a Llama with q/k/v biases, written back as a llama GGUF computing the same function).

A GGUF holds key/value metadata (hyper-parameters under ``llama.*``, the tokenizer under ``tokenizer.*``) and
named tensors, each stored as float (F32/F16/BF16) or in a block-quantized type. Reading and (de)quantization go
through the ``gguf`` package (the reference implementation that ships with llama.cpp). Two conventions differ from
ours:

* shapes are listed fastest dimension first (``[in_features, out_features]``); the ``gguf`` reader hands out
  numpy arrays in our ``[out_features, in_features]`` order already;
* llama.cpp's RoPE rotates interleaved pairs, so ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q`` /
  ``attn_k`` (see :func:`minigpt.model.rope.half_to_interleaved`); import undoes it, export redoes it. Not for
  qwen2, whose RoPE rotates halves as ours does (llama.cpp's NEOX type): its rows are stored as they are, and its
  metadata keys are ``qwen2.*`` instead of ``llama.*``.

Dequantized types: every one the ``gguf`` package dequantizes (:data:`READ_TYPES`: F32, F16, BF16, Q4_0..Q8_0,
Q2_K..Q6_K, the IQ and TQ types, MXFP4, NVFP4). Written types: F32, F16, BF16
and Q8_0 (1-D tensors always F32, as llama.cpp does; Q8_0 needs rows that are a multiple of 32 values and falls
back to F16 otherwise). Errors (not a GGUF, truncated, another architecture, an unsupported quantization type,
unknown tensors) raise :class:`MiniGPTError`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

import numpy as np
import torch

from minigpt.errors import MiniGPTError, one_line
from minigpt.interop.gguf_header import check_header
from minigpt.interop.hf import check_representable
from minigpt.model.config import ModelConfig
from minigpt.model.rope import half_to_interleaved, interleaved_to_half
from minigpt.tokenizer.interop import Vocab

# ours (per layer, after "layers.{i}.") -> GGUF (after "blk.{i}.")
_LAYER_KEYS = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight",
    "attention.wo.weight": "attn_output.weight",
    "attention.wq.bias": "attn_q.bias",
    "attention.wk.bias": "attn_k.bias",
    "attention.wv.bias": "attn_v.bias",
    "attention.wo.bias": "attn_output.bias",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w1.bias": "ffn_gate.bias",
    "feed_forward.w2.bias": "ffn_down.bias",
    "feed_forward.w3.bias": "ffn_up.bias",
}
_GLOBAL_KEYS = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "output.weight": "output.weight"}
_GGUF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_KEYS.items()}

# Every type the gguf package (llama.cpp's reference Python code) can dequantize; Q8_1, Q8_K and Q1_0 it cannot.
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
              "MXFP4", "NVFP4")
# general.architecture values read (see the module docstring).
READ_ARCHITECTURES = ("llama", "qwen2")
WRITE_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0"}


def to_gguf_key(key: str) -> str:
    """Our tensor name -> GGUF tensor name."""
    if key in _GLOBAL_KEYS:
        return _GLOBAL_KEYS[key]
    prefix, layer, rest = key.split(".", 2)
    return f"blk.{layer}.{_LAYER_KEYS[rest]}"


def from_gguf_key(name: str) -> str:
    """GGUF tensor name -> ours; raises ``KeyError`` for names a Llama model does not have."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER:
        return f"layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}"
    raise KeyError(name)


# ----------------------------------------------------------------------------------------------------- reading
@dataclass
class GGUFFile:
    """The parsed pieces of a GGUF: our config, metadata values by key, and the raw tensor records."""

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: list  # gguf.ReaderTensor


def _escape(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters with newlines and other control characters escaped: key and tensor
    names are the file's own text, and error messages stay on one line."""
    return (text if len(text) <= limit else text[:limit] + "...").encode("unicode_escape").decode("ascii")


def _brief(e: BaseException) -> str:
    """``Type: message`` of an exception from the gguf package (whose messages quote key names), on one line."""
    return _escape(f"{type(e).__name__}: {e}")


def _open(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise MiniGPTError(f"GGUF file {path} does not exist")
    check_header(path)
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except ValueError as e:
        message = _brief(e)
        if "GGMLQuantizationType" in message:
            raise MiniGPTError(f"{path}: unknown GGUF quantization type ({message}); supported: "
                               f"{', '.join(READ_TYPES)}") from None
        raise MiniGPTError(f"{path} is not a valid GGUF file or is truncated ({message})") from None
    except RecursionError:
        # The gguf package reads nested arrays recursively; a crafted file nests them 100k deep.
        raise MiniGPTError(f"{path} is not a valid GGUF file: its metadata nests arrays too deeply to read") from None
    except (IndexError, KeyError, OSError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise MiniGPTError(f"{path} is not a valid GGUF file or is truncated ({_brief(e)})") from None


def _metadata(reader) -> dict[str, Any]:
    # Token lists are long; they are read lazily by read_vocab.
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "scores", "token_type", "merges"):
            continue
        out[key] = f.contents()
    return out


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal with the same float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _config(meta: dict[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    """Our config from the ``llama.*`` metadata; raises :class:`MiniGPTError` for what it cannot describe, including
    values of the wrong type (a string, list or NaN where a count belongs)."""
    try:
        return _read_config(meta, tensor_names, where)
    except (ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise MiniGPTError(f"{where}: invalid model hyper-parameters ({_brief(e)})") from None


def _read_config(meta: dict[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in READ_ARCHITECTURES:
        raise MiniGPTError(f"{where}: unsupported GGUF architecture {_escape(repr(arch))}; supported: "
                           f"{', '.join(map(repr, READ_ARCHITECTURES))}")
    if arch != "llama":  # the same hyper-parameters under the architecture's own prefix
        meta = {**meta, **{f"llama.{k[len(arch) + 1:]}": v for k, v in meta.items() if k.startswith(f"{arch}.")}}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise MiniGPTError(f"{where}: GGUF metadata llama.{key} is missing")
        return value

    if meta.get("llama.expert_count", 0):
        raise MiniGPTError(f"{where}: mixture-of-experts GGUF models (llama.expert_count) are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise MiniGPTError(f"{where}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling in GGUF form) "
                           "are not supported")
    dim, n_heads = get("embedding_length"), get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_heads, list) or isinstance(n_kv, list):
        raise MiniGPTError(f"{where}: per-layer head counts are not supported")
    head_dim = meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or dim // n_heads
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise MiniGPTError(f"{where}: partial rotary embeddings (rope.dimension_count < head size) are not supported")
    scaling = None
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif kind not in ("none", None):
        raise MiniGPTError(f"{where}: GGUF RoPE scaling type {kind!r} is not supported; supported: none, linear")
    vocab_size = meta.get("llama.vocab_size") or meta.get("tokenizer.ggml.token_count")
    return ModelConfig(
        vocab_size=int(vocab_size) if vocab_size else 0,
        dim=int(dim), n_layers=int(get("block_count")), n_heads=int(n_heads), n_kv_heads=int(n_kv),
        head_dim=int(head_dim), hidden_dim=int(get("feed_forward_length")),
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_seq_len=int(get("context_length")), tie_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
    )


# What reading a crafted metadata value can raise inside the gguf package (bytes that are not UTF-8, a value of
# another type than its key's, a scalar array read as a string).
_VALUE_ERRORS = (UnicodeDecodeError, ValueError, TypeError, IndexError, KeyError, OverflowError)


def read_gguf(path: str | Path) -> GGUFFile:
    """Open ``path`` and read its config and metadata (tensors are memory-mapped, not yet read)."""
    reader = _open(path)
    try:
        meta = _metadata(reader)
    except _VALUE_ERRORS as e:
        raise MiniGPTError(f"{path}: unreadable GGUF metadata ({_brief(e)})") from None
    names = {t.name for t in reader.tensors}
    if not meta.get("llama.vocab_size") and "token_embd.weight" in names:
        meta["llama.vocab_size"] = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    if not meta.get("llama.vocab_size") and "tokenizer.ggml.tokens" in reader.fields:
        meta["llama.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return GGUFFile(Path(path), _config(meta, names, str(path)), meta, reader.tensors)


def _read_data(tensor, file: BinaryIO, where: str) -> np.ndarray:
    """A tensor's stored bytes read from ``file`` into memory of their own, shaped as the reader's memory-mapped view
    (whose dtype and shape are known without touching its pages): pages of a mapping stay resident, and counted in
    the process's memory, until the whole file is unmapped; a buffer read here is freed with the tensor."""
    file.seek(tensor.data_offset)
    raw = file.read(int(tensor.n_bytes))
    if len(raw) != int(tensor.n_bytes):
        raise MiniGPTError(f"{where} is truncated: tensor {_escape(tensor.name)} needs {tensor.n_bytes} bytes at "
                           f"offset {tensor.data_offset}")
    return np.frombuffer(raw, dtype=tensor.data.dtype).reshape(tensor.data.shape)


def dequantize(tensor, where: str, file: Optional[BinaryIO] = None) -> torch.Tensor:
    """One GGUF tensor as float32, in our ``[out_features, in_features]`` order; its bytes are read from ``file``
    (the GGUF, open for binary reading) when given, else from the reader's memory map."""
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in READ_TYPES:
        raise MiniGPTError(f"{where}: tensor {_escape(tensor.name)} has quantization type {kind}, which is not "
                           f"supported; supported: {', '.join(READ_TYPES)}")
    data = tensor.data if file is None else _read_data(tensor, file, where)
    try:
        values = quants.dequantize(data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    except (ValueError, NotImplementedError) as e:
        raise MiniGPTError(f"{where}: cannot dequantize {_escape(tensor.name)} ({kind}): {_brief(e)}") from None


def _named_tensors(gf: GGUFFile) -> list[tuple[str, Any]]:
    """``(our name, tensor record)`` of every tensor; raises :class:`MiniGPTError` naming those a Llama model does
    not have."""
    named, unknown = [], []
    for t in gf.tensors:
        try:
            named.append((from_gguf_key(t.name), t))
        except KeyError:
            unknown.append(t.name)
    if unknown:
        raise MiniGPTError(f"{gf.path}: tensors a Llama model does not have: {_escape(str(unknown[:5]))}")
    return named


def _zero_o_bias(gf: GGUFFile, keys) -> list[str]:
    """qwen2 (non-interleaved) files: the o-projection biases our ``attention_bias`` layout has and qwen2 lacks, over
    the tensors present, not range(n_layers): the file's layer count is checked against them later."""
    if gf.metadata.get("general.architecture") == "llama":
        return []
    return [k.removesuffix("weight") + "bias" for k in keys if k.endswith("attention.wo.weight")]


def gguf_tensor_shapes(gf: GGUFFile) -> dict[str, tuple[int, ...]]:
    """Our name -> shape (``[out_features, in_features]``) of every tensor :func:`iter_gguf_weights` yields, read
    from the header alone."""
    shapes = {key: tuple(int(d) for d in reversed(t.shape.tolist())) for key, t in _named_tensors(gf)}
    shapes.update({key: (gf.config.dim,) for key in _zero_o_bias(gf, list(shapes))})
    return shapes


def iter_gguf_weights(gf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """``(our name, float32 tensor)`` one at a time, in file order: each dequantized when it is reached and read into
    memory of its own, so that a caller that converts and drops each (int8 loading) never holds more than one float
    tensor. q/k rows are permuted back to the rotate-half layout (llama); qwen2's missing o-projection biases come
    last, as zeros (our ``attention_bias`` layout has one; zeros compute the same). Raises :class:`MiniGPTError` as
    :func:`dequantize`, for unknown tensor names, or for q/k rows that do not match the metadata's heads."""
    c = gf.config
    named = _named_tensors(gf)
    interleaved = gf.metadata.get("general.architecture") == "llama"
    with open(gf.path, "rb") as file:
        for key, t in named:
            w = dequantize(t, str(gf.path), file)
            heads = c.n_heads if ".wq." in key else c.n_kv_heads if ".wk." in key else None
            if heads is not None:
                # The permutation needs the rows the metadata implies; the load's shape check names other mismatches.
                if w.shape[0] != heads * c.head_dim:
                    raise MiniGPTError(f"{gf.path}: tensor {_escape(t.name)} has {w.shape[0]} rows but the metadata "
                                       f"implies {heads} heads x {c.head_dim}")
                if interleaved:
                    w = interleaved_to_half(w, heads)
            yield key, w
    for key in _zero_o_bias(gf, [key for key, _ in named]):
        yield key, torch.zeros(c.dim)


def read_gguf_weights(gf: GGUFFile) -> dict[str, torch.Tensor]:
    """All tensors of :func:`iter_gguf_weights` in one dict (every tensor in float32 at once)."""
    return dict(iter_gguf_weights(gf))


def read_vocab(path: str | Path) -> Optional[Vocab]:
    """The tokenizer table stored in a GGUF's ``tokenizer.*`` metadata, or None when it has none."""
    reader = _open(path)
    try:
        return _vocab(reader.fields, str(path))
    except _VALUE_ERRORS as e:
        raise MiniGPTError(f"{path}: unreadable GGUF tokenizer metadata ({_brief(e)})") from None


def _vocab(f: dict, where: str) -> Optional[Vocab]:
    def value(key: str, default: Any = None) -> Any:
        return f[key].contents() if key in f else default

    model = value("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in f:
        return None
    tokens = value("tokenizer.ggml.tokens")
    return Vocab(
        model=model, tokens=tokens,
        types=value("tokenizer.ggml.token_type") or [1] * len(tokens),
        scores=value("tokenizer.ggml.scores"), merges=value("tokenizer.ggml.merges"),
        pre=value("tokenizer.ggml.pre"),
        bos_id=value("tokenizer.ggml.bos_token_id"), eos_id=value("tokenizer.ggml.eos_token_id"),
        pad_id=value("tokenizer.ggml.padding_token_id"), unk_id=value("tokenizer.ggml.unknown_token_id"),
        eot_id=value("tokenizer.ggml.eot_token_id"), eom_id=value("tokenizer.ggml.eom_token_id"),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", True)),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", model == "llama")),
        chat_template=value("tokenizer.chat_template"), where=where,
    )


# ----------------------------------------------------------------------------------------------------- writing
def write_gguf(
    state_dict: dict[str, torch.Tensor],
    config: ModelConfig,
    path: str | Path,
    dtype: str = "float32",
    vocab: Optional[Vocab] = None,
    name: str = "minigpt",
) -> Path:
    """Write ``state_dict`` (our names, tied head already removed) as a llama GGUF, atomically.

    ``dtype``: ``float32``, ``float16``, ``bfloat16`` or ``q8_0`` (see the module docstring for which tensors).
    Raises :class:`MiniGPTError` for a configuration GGUF's ``llama`` architecture cannot express, or a write cut
    short (a full disk); ``OSError`` for other failed writes. The file appears whole or not at all.
    """
    import gguf

    if dtype not in WRITE_TYPES:
        raise MiniGPTError(f"GGUF type {dtype!r} is not supported for writing; choose one of {sorted(WRITE_TYPES)}")

    check_representable(config, "llama GGUF")
    if config.has_mlp_bias:
        raise MiniGPTError("FFN biases (ModelConfig.bias / mlp_bias) cannot be written to a llama GGUF; "
                           "attention_bias can")
    scaling = config.rope_scaling
    if scaling and scaling["type"] != "linear":
        raise MiniGPTError(f"RoPE scaling {scaling['type']!r} cannot be written to GGUF here; supported: none, linear")
    qtype = gguf.GGMLQuantizationType[WRITE_TYPES[dtype]]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name(name)
        writer.add_context_length(config.max_seq_len)
        writer.add_embedding_length(config.dim)
        writer.add_block_count(config.n_layers)
        writer.add_feed_forward_length(config.hidden_dim)
        writer.add_head_count(config.n_heads)
        writer.add_head_count_kv(config.n_kv_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_vocab_size(config.vocab_size)
        if scaling:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
        file_types = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                      "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
        writer.add_file_type(int(file_types[dtype]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if vocab is not None:
            _add_vocab(writer, vocab)
        for key, tensor in state_dict.items():
            w = tensor.detach().float().cpu()
            if key.endswith(("attention.wq.weight", "attention.wq.bias")):
                w = half_to_interleaved(w, config.n_heads)
            elif key.endswith(("attention.wk.weight", "attention.wk.bias")):
                w = half_to_interleaved(w, config.n_kv_heads)
            _add_tensor(writer, to_gguf_key(key), w.contiguous().numpy(), qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is None:  # numpy's tofile reports a short write without an errno
            raise MiniGPTError(f"writing {path} stopped short ({one_line(e)}): is the disk full? free some space "
                               "or write to another disk") from None
        raise
    return path


def _add_tensor(writer, name: str, array: np.ndarray, qtype) -> None:
    import gguf
    from gguf import quants

    T = gguf.GGMLQuantizationType
    if array.ndim < 2 or qtype == T.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == T.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if array.shape[-1] % block:
            writer.add_tensor(name, array.astype(np.float16))  # llama.cpp's fallback for rows not made of blocks
        else:
            writer.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)


def _add_vocab(writer, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for add, value in ((writer.add_bos_token_id, vocab.bos_id), (writer.add_eos_token_id, vocab.eos_id),
                       (writer.add_pad_token_id, vocab.pad_id), (writer.add_unk_token_id, vocab.unk_id),
                       (writer.add_eot_token_id, vocab.eot_id), (writer.add_eom_token_id, vocab.eom_id)):
        if value is not None:
            add(value)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    if vocab.model == "llama":
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
