"""Causal prefill attention on the CPU: float32 GEMMs through oneDNN in blocks of query rows (the fast path, AMD
CPUs with AVX-512, :func:`causal_attention`), or MiniGPT's flash-attention kernel (CPUs with AVX2 and without
AVX-512, :func:`flash_attention`).

Why: on AMD CPUs ATen's flash-attention kernel for CPU computes its block products with oneMKL's sgemm, which runs
its AVX2 code there (:func:`~minigpt.infer.fastpath.kernels.fp32_gemm_library` says why the fast path's other
float32 products go to oneDNN on those CPUs). On a 2-core Zen 5 EPYC (family 26 model 2), SmolLM-135M's attention
(9 query and 3 key/value heads of 64), medians of 21: 1.05 / 2.33 / 4.25 / 11.48 / 39.93 ms a layer in SDPA's
flash kernel at 256 / 384 / 512 / 1,024 / 2,048 tokens, 0.86 / 1.57 / 2.57 / 8.10 / 30.58 ms as the blocked GEMMs
below; at 128-192 tokens the two are alike (0.40 against 0.48 ms at 128), hence :data:`MIN_TOKENS`
(docs/benchmarks.md, session 61). Not on CPUs without AVX-512, where both libraries run AVX2 code and SDPA's flash
kernel beat them: on a 2-core AVX2-only Zen 3 EPYC (family 25 model 1), the same layer with the queries as the
projection lays them out, medians of 21: 1.32 / 5.23 / 14.51 ms at 256 / 512 / 1,024 tokens in SDPA's kernel, 3.49 /
11.06 / 38.25 ms as the blocked GEMMs (docs/benchmarks.md, session 67). There MiniGPT's own kernel beats both
(:func:`flash_wanted` gives its times).

What (the blocked GEMMs): for each row of the batch and each key/value head, the query rows of its group's heads in
blocks of :data:`QUERY_BLOCK` positions; a block's scores ``Q K^T`` against the keys up to its last position only (the
causal triangle's blocks past the diagonal are never computed), ``-inf`` above the diagonal, softmax in float32
(Vaswani et al. 2017, eq. 1), then ``P V``. The same float32 arithmetic as SDPA's math path up to the order of the
sums (the flash kernel's online softmax, Dao et al. 2022, rescales partial sums instead).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from minigpt.infer.fastpath.kernels import _onednn_linear, fp32_gemm_library
from minigpt.infer.fastpath.library import runner_kernel
from minigpt.infer.launcher import install_attention_kernel
from minigpt.runtime import cpu_flags

QUERY_BLOCK = 256  # query positions a block (at 512 tokens: 3.85 / 2.89 / 2.57 ms with blocks of 64 / 128 / 256)
MIN_TOKENS = 256  # new positions from which the fast path takes this kernel (wanted)
FLASH_MIN_TOKENS = 2  # new positions from which it takes MiniGPT's flash kernel (flash_wanted; one goes to _attend_one)
FLASH_MAX_HEAD_DIM = 256  # the kernel's vector path: head_dim a multiple of 16, at most this

# `minigpt::causal_attention(q, keys, values, scale, start_pos)`: causal attention of new positions start_pos ..
# start_pos + seq - 1 over the cache, float32 (shapes in flash_attention). The reference kernel below
# (CompositeExplicitAutograd: it always runs) and the C++ one (minigpt/infer/attention_kernel.cpp, registered for
# CPU by attention_kernel()) differ in the order of the sums and the exponential's last bits.
_LIB = torch.library.Library("minigpt", "FRAGMENT")
_LIB.define("causal_attention(Tensor q, Tensor keys, Tensor values, float scale, int start_pos) -> Tensor")
_FOUND: list[str] = []  # once attention_kernel has looked: the C++ kernel's instruction set, or "" (none here)


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      start_pos: int) -> torch.Tensor:
    seq, n_keys = q.shape[1], start_pos + q.shape[1]
    allowed = torch.ones(seq, n_keys, dtype=torch.bool, device=q.device).tril_(start_pos)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :, :n_keys], values[:, :, :n_keys],
                                         attn_mask=allowed, scale=scale, enable_gqa=keys.shape[1] != q.shape[2])
    return out.transpose(1, 2).contiguous()


_LIB.impl("causal_attention", _causal_attention, "CompositeExplicitAutograd")


def attention_kernel() -> Optional[str]:
    """Register the C++ CPU kernel of ``minigpt::causal_attention`` for this process (once) and return the
    instruction set it runs (``"avx2"`` or ``"scalar"``; ``$MINIGPT_ATTENTION_ISA=scalar`` caps it), or None where it
    cannot be had: the compile cache is off (the runner library is built there), no C++ compiler, the build failed."""
    return runner_kernel(_FOUND, install_attention_kernel, "attention_isa")


def wanted(q: torch.Tensor, seq_len: int) -> bool:
    """Whether the fast path computes a plain causal prefill of ``seq_len`` new positions with
    :func:`causal_attention`: float32 queries on the CPU, no gradient, at least :data:`MIN_TOKENS` positions,
    float32 products through oneDNN here (:func:`~minigpt.infer.fastpath.kernels.fp32_gemm_library`: AMD CPUs, or
    ``$MINIGPT_FP32_GEMM=onednn``) and a CPU with AVX-512 (:func:`~minigpt.runtime.cpu_flags`, which
    ``$ATEN_CPU_CAPABILITY=avx2`` caps): without it SDPA's flash kernel beat them, and MiniGPT's own kernel beats
    both (:func:`flash_wanted`)."""
    return (seq_len >= MIN_TOKENS and q.dtype == torch.float32 and q.device.type == "cpu"
            and not (torch.is_grad_enabled() and q.requires_grad) and fp32_gemm_library() == "onednn"
            and "avx512f" in cpu_flags())


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     start_pos: int = 0) -> torch.Tensor:
    """Causal attention of new positions ``start_pos .. start_pos + seq_len - 1`` over the cache.

    ``q`` ``[batch, seq_len, n_heads, head_dim]`` float32 (the projection's layout; the heads of one key/value head's
    group adjacent, as GQA orders them); ``keys``/``values`` ``[batch, n_kv_heads, kv_len, head_dim]`` float32 with
    ``kv_len >= start_pos + seq_len`` (positions past that are not read); ``scale`` the scores' factor
    (``head_dim ** -0.5``). Returns ``[batch, seq_len, n_heads, head_dim]`` float32: query ``t`` attends to keys
    ``0 .. start_pos + t``. No gradient (oneDNN's linear op has no autograd formula)."""
    batch, seq_len, n_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    rep = n_heads // n_kv
    out = q.new_empty(batch, seq_len, n_heads, head_dim)
    blocks = []
    for c0 in range(0, seq_len, QUERY_BLOCK):
        c1 = min(seq_len, c0 + QUERY_BLOCK)
        # [rows, keys]: 0 where key <= start_pos + row, -inf past it (broadcast over the group's heads)
        bias = torch.full((c1 - c0, start_pos + c1), float("-inf"), dtype=q.dtype).triu_(start_pos + c0 + 1)
        blocks.append((c0, c1, bias[:, None, :]))
    scaled = q * scale
    for b in range(batch):
        for j in range(n_kv):
            heads = slice(j * rep, (j + 1) * rep)
            k_all, v_all = keys[b, j], values[b, j]  # [kv_len, head_dim]
            for c0, c1, bias in blocks:
                n_keys, rows = start_pos + c1, c1 - c0
                qg = scaled[b, c0:c1, heads].reshape(rows * rep, head_dim)  # rows (position, head)
                scores = _onednn_linear(qg, k_all[:n_keys].contiguous(), None, "none", [], "")
                scores = scores.view(rows, rep, n_keys).add_(bias)
                probs = torch.softmax(scores, dim=-1).view(rows * rep, n_keys)
                v_t = v_all[:n_keys].t().contiguous()  # [head_dim, n_keys]: oneDNN's weight layout
                out[b, c0:c1, heads] = _onednn_linear(probs, v_t, None, "none", [], "").view(rows, rep, head_dim)
    return out


def choice(q: torch.Tensor, seq_len: int, n_kv_heads: int) -> Optional[Callable[..., torch.Tensor]]:
    """The function with which the fast path computes a plain causal prefill of ``seq_len`` new positions (queries
    ``q`` ``[batch, seq_len, n_heads, head_dim]``): :func:`causal_attention` where :func:`wanted`,
    :func:`flash_attention` where :func:`flash_wanted`, else None (SDPA's kernel)."""
    if wanted(q, seq_len):
        return causal_attention
    return flash_attention if flash_wanted(q, seq_len, n_kv_heads) else None


def flash_wanted(q: torch.Tensor, seq_len: int, n_kv_heads: int) -> bool:
    """Whether the fast path computes a plain causal prefill of ``seq_len`` new positions with
    :func:`flash_attention`: float32 queries ``[batch, seq_len, n_heads, head_dim]`` on the CPU, no gradient, at
    least :data:`FLASH_MIN_TOKENS` positions, ``head_dim`` a multiple of 16 up to :data:`FLASH_MAX_HEAD_DIM`, no
    AVX-512 (:func:`~minigpt.runtime.cpu_flags`: there :func:`causal_attention`, measured on those CPUs, or SDPA)
    and the C++ kernel's AVX2 path here (:func:`attention_kernel`; building the runner library the first time takes
    ~25 s).

    Why: on a 2-core AVX2-only Zen 3 EPYC (family 25 model 1), SmolLM-135M's attention layer (9 query and 3
    key/value heads of 64), 2 threads, medians of 21, took 0.021 / 0.066 / 0.19 / 0.68 / 2.63 / 8.74 ms at 16 / 64 /
    128 / 256 / 512 / 1,024 tokens against 0.050 / 0.155 / 0.49 / 1.46 / 5.17 / 13.68 ms in SDPA's flash kernel
    (1.6-2.6x), and 22-26 against 59-80 us for 2-4 new tokens after 100 cached; in the 512-token prefill, paired
    medians of 9 in one process, pp512 1.10x at fp32, 1.10x bf16, 1.13x int8, 1.15x int4 (docs/benchmarks.md,
    session 68). Not measured on CPUs with AVX-512, which keep the blocked GEMMs or SDPA."""
    head_dim = q.shape[-1]
    return (seq_len >= FLASH_MIN_TOKENS and q.dtype == torch.float32 and q.device.type == "cpu"
            and not (torch.is_grad_enabled() and q.requires_grad) and head_dim % 16 == 0
            and head_dim <= FLASH_MAX_HEAD_DIM and q.shape[2] % n_kv_heads == 0 and "avx512f" not in cpu_flags()
            and attention_kernel() == "avx2")


def flash_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    start_pos: int = 0) -> torch.Tensor:
    """Causal attention of new positions ``start_pos .. start_pos + seq_len - 1`` over the cache, through
    ``minigpt::causal_attention`` (MiniGPT's C++ kernel where :func:`attention_kernel` registered it: FlashAttention's
    online softmax, Dao et al. 2022, in AVX2 register tiles, ``minigpt/infer/attention_kernel.cpp``; else SDPA).

    ``q`` ``[batch, seq_len, n_heads, head_dim]`` float32, any strides with the last dimension contiguous (the
    projection's view); ``keys``/``values`` ``[batch, n_kv_heads, kv_len, head_dim]`` float32 with ``kv_len >=
    start_pos + seq_len`` (positions past that are not read); ``scale`` the scores' factor (``head_dim ** -0.5``).
    Returns ``[batch, seq_len, n_heads, head_dim]`` float32: query ``t`` attends to keys ``0 .. start_pos + t``
    (Vaswani et al. 2017, eq. 1). Raises ``RuntimeError`` for other shapes or dtypes. No gradient."""
    return torch.ops.minigpt.causal_attention(q, keys, values, scale, start_pos)
