"""llama2.c checkpoints (Karpathy's ``run.c`` format, e.g. the TinyStories models): read ``.bin`` files.

Two float32 layouts exist (llama2.c ``export.py``):

* version 0, "legacy": seven int32 ``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len``
  (a negative ``vocab_size`` means the classifier is stored separately), then, as little-endian float32,
  ``token_embedding [vocab, dim]``, per layer-stacked ``rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3``,
  ``rms_final [dim]``, the unused RoPE tables ``freq_cis_real/imag [seq_len * head_dim / 2]`` and, if not shared,
  ``wcls [vocab, dim]``;
* version 1: uint32 magic ``0x616b3432`` ("ak42"), int32 version, the same seven int32, a uint8 "classifier
  shared" flag, zero padding to 256 bytes, then ``rms_att, rms_ffn, rms_final, token_embedding, wq, wk, wv, wo,
  w1, w2, w3`` (and ``wcls`` when not shared).

Matrices are ``[out_features, in_features]``. llama2.c rotates interleaved RoPE pairs (as Meta's Llama), so the
q/k rows are permuted to our rotate-half layout (:func:`minigpt.model.rope.interleaved_to_half`), exactly as llama2.c's
``export.py`` does for Hugging Face. Files hold no RoPE theta or norm epsilon: llama2.c uses 10000 and 1e-5.
The int8 version 2 is not supported.
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from minigpt.errors import MiniGPTError
from minigpt.model.config import ModelConfig
from minigpt.model.rope import interleaved_to_half

MAGIC = 0x616B3432
V1_HEADER_BYTES = 256


def _layout(c: ModelConfig, version: int, shared: bool) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every array in file order; ``name`` is ours, ``None``-prefixed names are skipped."""
    L, d, h, v = c.n_layers, c.dim, c.hidden_dim, c.vocab_size
    kv = c.n_kv_heads * c.head_dim
    stacked = {
        "attention_norm.weight": (d,), "ffn_norm.weight": (d,),
        "attention.wq.weight": (d, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, d),
        "feed_forward.w1.weight": (h, d), "feed_forward.w2.weight": (d, h), "feed_forward.w3.weight": (h, d),
    }
    per_layer = lambda name: (f"*{name}", (L, *stacked[name]))  # noqa: E731  ("*": stacked over layers)
    rope_rows = c.max_seq_len * c.head_dim // 2
    if version == 0:
        order = [("tok_embeddings.weight", (v, d)), per_layer("attention_norm.weight"),
                 per_layer("attention.wq.weight"), per_layer("attention.wk.weight"), per_layer("attention.wv.weight"),
                 per_layer("attention.wo.weight"), per_layer("ffn_norm.weight"), per_layer("feed_forward.w1.weight"),
                 per_layer("feed_forward.w2.weight"), per_layer("feed_forward.w3.weight"), ("norm.weight", (d,)),
                 ("-freq_cis_real", (rope_rows,)), ("-freq_cis_imag", (rope_rows,))]
    else:
        order = [per_layer("attention_norm.weight"), per_layer("ffn_norm.weight"), ("norm.weight", (d,)),
                 ("tok_embeddings.weight", (v, d)), per_layer("attention.wq.weight"),
                 per_layer("attention.wk.weight"), per_layer("attention.wv.weight"), per_layer("attention.wo.weight"),
                 per_layer("feed_forward.w1.weight"), per_layer("feed_forward.w2.weight"),
                 per_layer("feed_forward.w3.weight")]
    if not shared:
        order.append(("output.weight", (v, d)))
    return order


def read_llama2c(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of a llama2.c ``.bin`` checkpoint (version 0 or 1).

    Raises :class:`MiniGPTError` for a missing, truncated or oversized file, an unsupported version, or a header
    that does not describe a valid model.
    """
    path = Path(path)
    if not path.is_file():
        raise MiniGPTError(f"llama2.c checkpoint {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(V1_HEADER_BYTES)
    if len(head) < 28:
        raise MiniGPTError(f"{path} is too short to be a llama2.c checkpoint ({size} bytes)")
    if struct.unpack_from("<I", head)[0] == MAGIC:
        version = struct.unpack_from("<i", head, 4)[0]
        if version != 1:
            raise MiniGPTError(f"{path}: llama2.c checkpoint version {version} is not supported (only 0 and 1; "
                               "version 2 is int8-quantized)")
        if len(head) < 37:
            raise MiniGPTError(f"{path} is truncated: the version-1 header is incomplete")
        dims = struct.unpack_from("<7i", head, 8)
        shared = bool(head[36])
        offset = V1_HEADER_BYTES
    else:
        version, dims, offset = 0, struct.unpack_from("<7i", head), 28
        shared = dims[5] > 0
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = dims
    try:
        config = ModelConfig(vocab_size=abs(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                             hidden_dim=hidden, max_seq_len=seq_len, norm_eps=1e-5, rope_theta=10000.0,
                             tie_embeddings=shared)
    except (ValueError, ZeroDivisionError) as e:
        raise MiniGPTError(f"{path} does not have a valid llama2.c header ({e})") from None
    layout = _layout(config, version, shared)
    # Python integers (math.prod), not numpy's int64: a header's dimensions may multiply past 2^63.
    expected = offset + 4 * sum(math.prod(shape) for _, shape in layout)
    if size < expected:
        raise MiniGPTError(f"{path} is truncated: the header implies {expected} bytes but the file has {size}")
    if size > expected:
        raise MiniGPTError(f"{path} has {size - expected} bytes more than its header implies: not a version-"
                           f"{version} llama2.c float32 checkpoint")
    data = np.memmap(path, dtype="<f4", mode="r", offset=offset)
    sd: dict[str, torch.Tensor] = {}
    pos = 0
    for name, shape in layout:
        n = math.prod(shape)
        array = torch.from_numpy(np.array(data[pos:pos + n], dtype=np.float32).reshape(shape))
        pos += n
        if name.startswith("-"):
            continue
        if name.startswith("*"):
            for i in range(n_layers):
                sd[f"layers.{i}.{name[1:]}"] = array[i].clone()
        else:
            sd[name] = array
    for i in range(n_layers):
        q, k = f"layers.{i}.attention.wq.weight", f"layers.{i}.attention.wk.weight"
        sd[q] = interleaved_to_half(sd[q], n_heads)
        sd[k] = interleaved_to_half(sd[k], n_kv)
    return config, sd


def find_tokenizer(path: str | Path) -> Optional[Path]:
    """The tokenizer stored beside a llama2.c checkpoint: ``tokenizer.model``, a single other ``*.model``, then
    ``tokenizer.bin`` or a single ``tok*.bin`` (llama2.c's own format). None if there is none."""
    folder = Path(path).parent
    for pattern in ("tokenizer.model", "*.model", "tokenizer.bin", "tok*.bin"):
        found = sorted(p for p in folder.glob(pattern) if p.is_file() and p != Path(path))
        if len(found) == 1:
            return found[0]
    return None

