"""Causal prefill attention as float32 GEMMs through oneDNN, in blocks of query rows (the fast path, AMD CPUs
with AVX-512).

Why: on AMD CPUs ATen's flash-attention kernel for CPU computes its block products with oneMKL's sgemm, which runs
its AVX2 code there (:func:`~minigpt.infer.fastpath.kernels.fp32_gemm_library` says why the fast path's other
float32 products go to oneDNN on those CPUs). On a 2-core Zen 5 EPYC (family 26 model 2), SmolLM-135M's attention
(9 query and 3 key/value heads of 64), medians of 21: 1.05 / 2.33 / 4.25 / 11.48 / 39.93 ms a layer in SDPA's
flash kernel at 256 / 384 / 512 / 1,024 / 2,048 tokens, 0.86 / 1.57 / 2.57 / 8.10 / 30.58 ms as the blocked GEMMs
below; at 128-192 tokens the two are alike (0.40 against 0.48 ms at 128), hence :data:`MIN_TOKENS`
(docs/benchmarks.md, session 61). Not on CPUs without AVX-512, where both libraries run AVX2 code and the flash
kernel is the faster: on a 2-core AVX2-only Zen 3 EPYC (family 25 model 1), the same layer with the queries as the
projection lays them out, medians of 21: 1.32 / 5.23 / 14.51 ms at 256 / 512 / 1,024 tokens in SDPA's kernel, 3.49 /
11.06 / 38.25 ms as the blocked GEMMs; in SmolLM-135M's 512-token prefill the 30 layers' attention took 170-210
against 209-265 ms (docs/benchmarks.md, session 67).

What: for each row of the batch and each key/value head, the query rows of its group's heads in blocks of
:data:`QUERY_BLOCK` positions; a block's scores ``Q K^T`` against the keys up to its last position only (the
causal triangle's blocks past the diagonal are never computed), ``-inf`` above the diagonal, softmax in float32
(Vaswani et al. 2017, eq. 1), then ``P V``. The same float32 arithmetic as SDPA's math path up to the order of the
sums (the flash kernel's online softmax, Dao et al. 2022, rescales partial sums instead).
"""
from __future__ import annotations

import torch

from minigpt.infer.fastpath.kernels import _onednn_linear, fp32_gemm_library
from minigpt.runtime import cpu_flags

QUERY_BLOCK = 256  # query positions a block (at 512 tokens: 3.85 / 2.89 / 2.57 ms with blocks of 64 / 128 / 256)
MIN_TOKENS = 256  # new positions from which the fast path takes this kernel (wanted)


def wanted(q: torch.Tensor, seq_len: int) -> bool:
    """Whether the fast path computes a plain causal prefill of ``seq_len`` new positions with
    :func:`causal_attention`: float32 queries on the CPU, no gradient, at least :data:`MIN_TOKENS` positions,
    float32 products through oneDNN here (:func:`~minigpt.infer.fastpath.kernels.fp32_gemm_library`: AMD CPUs, or
    ``$MINIGPT_FP32_GEMM=onednn``) and a CPU with AVX-512 (:func:`~minigpt.runtime.cpu_flags`, which
    ``$ATEN_CPU_CAPABILITY=avx2`` caps): elsewhere SDPA's flash kernel is the faster (module docstring)."""
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
