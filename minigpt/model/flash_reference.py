"""FlashAttention written to be read: exact attention computed tile by tile with an online softmax, in plain PyTorch.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness" (algorithm 1 for
the forward pass; the backward pass as in Dao 2023, "FlashAttention-2", algorithm 2). The point of the algorithm
is that the ``[q_len, kv_len]`` score matrix never exists: queries and keys are cut into blocks of
``block_size``, and for each query block a running row maximum ``m``, a running softmax denominator ``l`` and a
running un-normalised output ``acc`` are updated one key block at a time. When a later block raises the maximum,
everything accumulated so far is rescaled by ``exp(m_old - m_new)``, so the result is exactly
``softmax(QK^T / sqrt(d)) V``. Only ``O(seq_len)`` extra memory is held: the output and the per-row log-sum-exp
``lse = m + log(l)``, which the backward pass uses to recompute each tile's probabilities ``P = exp(S - lse)``
instead of storing them.

Here the tiles are loops over tensor slices, so this runs far slower than a fused kernel (``sdpa``); what it
demonstrates is the memory behaviour and the arithmetic. Key blocks lying entirely in the future of a query block
are skipped, which halves the causal work as in the paper.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from minigpt.model.positions import Alibi


class _Tiles:
    """The inputs shared by the forward and backward passes, and the score of one tile."""

    def __init__(self, q_len: int, kv_len: int, block_size: int, scale: float,
                 mask: Optional[torch.Tensor], alibi: Optional[Alibi]) -> None:
        self.q_len, self.kv_len, self.block = q_len, kv_len, block_size
        self.offset = kv_len - q_len  # absolute index of the first query among the keys
        self.scale, self.mask, self.alibi = scale, mask, alibi

    def query_blocks(self):
        """``(q_start, q_end)`` of each query block."""
        for qs in range(0, self.q_len, self.block):
            yield qs, min(qs + self.block, self.q_len)

    def key_blocks(self, q_end: int):
        """``(k_start, k_end)`` of the key blocks a query block ending at ``q_end`` can see: keys after its last
        query are all in the future, so those tiles are skipped."""
        k_stop = min(self.kv_len, self.offset + q_end)
        for ks in range(0, k_stop, self.block):
            yield ks, min(ks + self.block, k_stop)

    def scores(self, q: torch.Tensor, k: torch.Tensor, qs: int, qe: int, ks: int, ke: int) -> torch.Tensor:
        """Masked scores ``[batch, heads, qe - qs, ke - ks]`` (float32) of query rows ``qs:qe`` and keys ``ks:ke``."""
        s = (q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-1, -2)) * self.scale
        if self.alibi is not None:
            s = s + self.alibi.bias(self.q_len, qs, qe, ks, ke)
        if self.mask is not None:
            allowed = self.mask[..., qs:qe, ks:ke]
        else:
            q_idx = torch.arange(qs, qe, device=q.device)[:, None] + self.offset
            allowed = torch.arange(ks, ke, device=q.device)[None, :] <= q_idx
        return s.masked_fill(~allowed, float("-inf"))


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles: _Tiles):
        qf, kf, vf = q.float(), k.float(), v.float()
        batch, heads, q_len, head_dim = q.shape
        out = torch.empty(batch, heads, q_len, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
        for qs, qe in tiles.query_blocks():
            rows = (batch, heads, qe - qs)
            m = torch.full(rows, float("-inf"), device=q.device)  # running row maximum of the scores
            l = torch.zeros(rows, device=q.device)  # running softmax denominator, relative to m
            acc = torch.zeros(*rows, head_dim, device=q.device)  # running un-normalised output, relative to m
            for ks, ke in tiles.key_blocks(qe):
                s = tiles.scores(qf, kf, qs, qe, ks, ke)
                m_new = torch.maximum(m, s.amax(-1))
                # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so exp() gives 0, not NaN.
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                rescale = torch.exp(m - m_safe)  # what the old terms were scaled by, relative to the new maximum
                l = rescale * l + p.sum(-1)
                acc = rescale[..., None] * acc + p @ vf[:, :, ks:ke]
                m = m_new
            out[:, :, qs:qe] = acc / l[..., None]
            lse[:, :, qs:qe] = m + torch.log(l)
        ctx.tiles = tiles
        ctx.save_for_backward(qf, kf, vf, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, vf, out, lse = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        do = grad_out.float()
        delta = (do * out).sum(-1)  # rowsum(dO * O) = sum_j P_ij dP_ij, the softmax Jacobian's correction term
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        for qs, qe in tiles.query_blocks():
            do_i = do[:, :, qs:qe]
            for ks, ke in tiles.key_blocks(qe):
                p = torch.exp(tiles.scores(qf, kf, qs, qe, ks, ke) - lse[:, :, qs:qe, None])  # recomputed, exact
                dv[:, :, ks:ke] += p.transpose(-1, -2) @ do_i
                dp = do_i @ vf[:, :, ks:ke].transpose(-1, -2)
                ds = p * (dp - delta[:, :, qs:qe, None])  # gradient of the scores through the softmax
                dq[:, :, qs:qe] += (ds @ kf[:, :, ks:ke]) * tiles.scale
                dk[:, :, ks:ke] += (ds.transpose(-1, -2) @ qf[:, :, qs:qe]) * tiles.scale
        return dq.to(grad_out.dtype), dk.to(grad_out.dtype), dv.to(grad_out.dtype), None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int = 64,
    mask: Optional[torch.Tensor] = None,
    alibi: Optional[Alibi] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Exact causal attention ``softmax(q k^T * scale + bias) v``, tiled; returns ``[batch, heads, q_len, head_dim]``.

    ``q`` ``[batch, heads, q_len, head_dim]``; ``k``/``v`` ``[batch, heads, kv_len, head_dim]`` with as many heads as
    ``q`` (repeat grouped KV heads first). The queries are the last ``q_len`` of the ``kv_len`` positions (a cached
    prefix precedes them). ``mask`` (boolean ``[batch or 1, 1, q_len, kv_len]``, True = may attend, causal already)
    replaces the causal rule; it is read one tile at a time. ``alibi`` adds ALiBi biases computed per tile.
    ``scale`` defaults to ``1 / sqrt(head_dim)``. Computed in float32, returned in ``q``'s dtype; differentiable.

    Raises ``ValueError`` when ``block_size < 1`` or ``kv_len < q_len``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    q_len, kv_len = q.shape[2], k.shape[2]
    if kv_len < q_len:
        raise ValueError(f"kv_len ({kv_len}) must be >= q_len ({q_len}): the queries are the last positions")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _FlashAttention.apply(q, k, v, _Tiles(q_len, kv_len, block_size, scale, mask, alibi))
