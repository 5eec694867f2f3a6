"""Grouped-query attention (Ainslie et al. 2023, "GQA") through PyTorch's fused SDPA kernel.

``n_kv_heads`` key/value heads are shared by groups of ``n_heads / n_kv_heads`` query heads: ``n_kv_heads ==
n_heads`` is plain multi-head attention (Vaswani et al. 2017) and ``n_kv_heads == 1`` is multi-query attention
(Shazeer 2019). Fewer KV heads shrink the KV cache by ``n_heads / n_kv_heads``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache
from .rope import apply_rope


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean mask ``[q_len, kv_len]``, True where attention is allowed.

    The queries are the last ``q_len`` positions of ``kv_len``: query ``i`` sits at absolute position
    ``kv_len - q_len + i`` and may see keys ``0 .. kv_len - q_len + i`` (the cached prefix and itself).
    """
    offset = kv_len - q_len
    q_pos = torch.arange(q_len, device=device)[:, None] + offset
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return k_pos <= q_pos


def padded_causal_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Boolean mask ``[batch, 1, q_len, kv_len]`` from a padding mask ``attention_mask`` ``[batch, kv_len]``
    (1 = real token, 0 = padding): causal, and no query sees a padding key.

    A padding query would then see no key at all, and SDPA turns an all-masked row into NaN, which would leak into
    the real rows through ``0 * NaN`` in ``softmax @ V`` of later layers; so every query may always see itself.
    Padding rows compute garbage that no real token ever reads.
    """
    kv_len = attention_mask.shape[1]
    allowed = causal_mask(q_len, kv_len, attention_mask.device)[None, None] & attention_mask.bool()[:, None, None, :]
    q_pos = torch.arange(q_len, device=attention_mask.device)[:, None] + (kv_len - q_len)
    itself = q_pos == torch.arange(kv_len, device=attention_mask.device)[None, :]
    return allowed | itself


class Attention(nn.Module):
    """Causal self-attention with RoPE and GQA.

    Input ``x`` ``[batch, seq_len, dim]``; output ``[batch, seq_len, dim]``.
    """

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        bias = config.has_attention_bias
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int = 0,
        kv_cache: Optional[KVCache] = None,
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``cos``/``sin``: RoPE table rows for positions ``start_pos .. start_pos + seq_len``, ``[seq_len, head_dim]``,
        or per-row positions ``[batch, 1, seq_len, head_dim]``.

        With ``kv_cache``, this call's keys/values are written at ``start_pos`` and the queries attend to the whole
        cached prefix; without it, ``start_pos`` must be 0. ``mask`` (boolean ``[batch, 1, seq_len, kv_len]``, True =
        may attend, from :func:`padded_causal_mask`) replaces the plain causal mask.
        """
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_id, start_pos, k, v)
        elif start_pos != 0:
            raise ValueError("start_pos > 0 needs a kv_cache holding the earlier positions")

        kv_len = k.shape[2]
        is_causal = False
        if mask is None and seq_len > 1:
            if kv_len == seq_len:
                is_causal = True  # lets SDPA pick its fused causal kernel
            else:
                mask = causal_mask(seq_len, kv_len, x.device)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=is_causal,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        out = out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.head_dim)
        return self.resid_dropout(self.wo(out))
