"""Grouped-query attention (Ainslie et al. 2023, "GQA") through PyTorch's fused SDPA kernel.

``n_kv_heads`` key/value heads are shared by groups of ``n_heads / n_kv_heads`` query heads: ``n_kv_heads ==
n_heads`` is plain multi-head attention (Vaswani et al. 2017) and ``n_kv_heads == 1`` is multi-query attention
(Shazeer 2019). Fewer KV heads shrink the KV cache by ``n_heads / n_kv_heads``.

``ModelConfig.attention_impl`` picks how ``softmax(QK^T / sqrt(head_dim) + bias) V`` is computed; all three give
the same numbers (to float rounding): ``sdpa`` (PyTorch's fused kernel, the default), ``naive`` (the textbook
formula, materialising the ``[q_len, kv_len]`` scores) and ``flash_reference`` (the tiled online softmax of
:mod:`minigpt.model.flash_reference`). With ``pos_encoding="alibi"`` the ALiBi bias (:mod:`minigpt.model.positions`) is added
to the scores and no rotation is applied.

With ``ModelConfig.qk_norm`` every query and key head is RMS-normalised over its ``head_dim`` channels (a learned
``[head_dim]`` gain shared by the heads, ``q_norm`` / ``k_norm`` as in Qwen3 and Gemma 3) before RoPE, so the
logits ``q . k / sqrt(head_dim)`` are bounded by the gains whatever the scale of ``wq`` and ``wk`` (Dehghani et al.
2023, "Scaling Vision Transformers to 22 Billion Parameters"; Wortsman et al. 2023; modded-nanoGPT).

``ModelConfig.sliding_window`` (Mistral; Beltagy et al. 2020, "Longformer") narrows the causal mask to a band: a
query at position ``i`` sees the keys at ``i - sliding_window < j <= i``, the rule of ``transformers``'
``sliding_window_causal_mask_function``. The KV cache keeps every position; the band is applied by the mask alone.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.model.config import ModelConfig
from minigpt.model.flash_reference import flash_attention
from minigpt.model.kv_cache import KVCache
from minigpt.model.norm import RMSNorm
from minigpt.model.positions import Alibi
from minigpt.model.rope import rope_rotate, signed_sine


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None,
                window: Optional[int] = None) -> torch.Tensor:
    """Boolean mask ``[q_len, kv_len]``, True where attention is allowed.

    The queries are the last ``q_len`` positions of ``kv_len``: query ``i`` sits at absolute position
    ``p = kv_len - q_len + i`` and may see keys ``0 .. p`` (the cached prefix and itself), or with a sliding
    ``window`` only the keys ``p - window < j <= p``.
    """
    offset = kv_len - q_len
    q_pos = torch.arange(q_len, device=device)[:, None] + offset
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def padded_causal_mask(attention_mask: torch.Tensor, q_len: int, window: Optional[int] = None) -> torch.Tensor:
    """Boolean mask ``[batch, 1, q_len, kv_len]`` from a padding mask ``attention_mask`` ``[batch, kv_len]``
    (1 = real token, 0 = padding): causal, and no query sees a padding key.

    With a sliding ``window`` a query also sees no key ``window`` or more *real tokens* before it: distances are
    counted in positions (``cumsum(attention_mask)``), not cache columns, because the serving engine leaves padding
    columns between a row's cached tokens and its new one. For left padding both counts agree, so this is
    ``transformers``' rule (which counts cache positions).

    A padding query would then see no key at all, and SDPA turns an all-masked row into NaN, which would leak into
    the real rows through ``0 * NaN`` in ``softmax @ V`` of later layers; so every query may always see itself.
    Padding rows compute garbage that no real token ever reads.
    """
    kv_len = attention_mask.shape[1]
    allowed = causal_mask(q_len, kv_len, attention_mask.device)[None, None] & attention_mask.bool()[:, None, None, :]
    if window is not None:
        real = attention_mask.long().cumsum(-1)  # 1 + the position of each real token
        allowed = allowed & (real[:, None, None, :] > real[:, None, -q_len:, None] - window)
    q_pos = torch.arange(q_len, device=attention_mask.device)[:, None] + (kv_len - q_len)
    itself = q_pos == torch.arange(kv_len, device=attention_mask.device)[None, :]
    return allowed | itself


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[batch, n_kv_heads, seq_len, head_dim]`` -> ``[batch, n_kv_heads * n_rep, seq_len, head_dim]``: each KV
    head repeated for the ``n_rep`` query heads of its group (head ``h`` reads KV head ``h // n_rep``)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: Optional[torch.Tensor],
    bias: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The textbook attention of Vaswani et al. 2017 (eq. 1): ``softmax(q k^T / sqrt(d) + bias) v``.

    ``q`` ``[batch, heads, q_len, head_dim]``; ``k``/``v`` ``[batch, heads, kv_len, head_dim]`` (KV heads already
    repeated); ``allowed`` boolean, broadcastable to ``[batch, heads, q_len, kv_len]`` (True = may attend; None =
    everything); ``bias`` float, same broadcast shape. The softmax runs in float32. Memory: the whole
    ``[batch, heads, q_len, kv_len]`` score matrix, which is what flash attention avoids.
    """
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


class Attention(nn.Module):
    """Causal self-attention with RoPE (or ALiBi, or no position signal) and GQA.

    Input ``x`` ``[batch, seq_len, dim]``; output ``[batch, seq_len, dim]``.
    """

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.impl = config.attention_impl
        self.block_size = config.attention_block_size
        self.window = config.sliding_window
        bias = config.has_attention_bias
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=bias)
        if config.qk_norm:  # absent otherwise: a model without the option has exactly the parameters it always had
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int = 0,
        kv_cache: Optional[KVCache] = None,
        mask: Optional[torch.Tensor] = None,
        alibi: Optional[Alibi] = None,
    ) -> torch.Tensor:
        """``cos``/``sin``: RoPE table rows for positions ``start_pos .. start_pos + seq_len``, ``[seq_len, head_dim]``,
        or per-row positions ``[batch, 1, seq_len, head_dim]`` (the plain tables of
        :func:`~minigpt.model.rope.rope_tables`); both None for models without RoPE.

        With ``kv_cache``, this call's keys/values are written at ``start_pos`` and the queries attend to the whole
        cached prefix; without it, ``start_pos`` must be 0. ``mask`` (boolean ``[batch, 1, seq_len, kv_len]``, True =
        may attend, from :func:`padded_causal_mask`) replaces the plain causal mask, and must already hold the
        sliding window of a ``sliding_window`` model (without ``mask`` the window is applied here). ``alibi`` (ALiBi
        models) holds the slopes and the absolute position of every key.
        """
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over head_dim, before the rotation (Qwen3, OLMo-2 order)
        if cos is not None:
            # The tables in the activations' dtype and the sine signed, once for q and k.
            cos, sin_signed = cos.to(q.dtype), signed_sine(sin).to(q.dtype)
            q = rope_rotate(q, cos, sin_signed)
            k = rope_rotate(k, cos, sin_signed)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_id, start_pos, k, v)
        elif start_pos != 0:
            raise ValueError("start_pos > 0 needs a kv_cache holding the earlier positions")
        if mask is None and self.window is not None and k.shape[2] > self.window:
            # Only once the keys reach past the window does the band hide any of them.
            mask = causal_mask(seq_len, k.shape[2], x.device, self.window)

        if self.impl != "sdpa" or alibi is not None:
            out = self._attend_variant(q, k, v, mask, alibi)
            out = out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.head_dim)
            return self.resid_dropout(self.wo(out))

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

    def _attend_variant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                        alibi: Optional[Alibi]) -> torch.Tensor:
        """Attention output ``[batch, n_heads, q_len, head_dim]`` through the non-default paths: ``naive``,
        ``flash_reference``, or SDPA with an ALiBi bias (an additive float mask)."""
        q_len, kv_len = q.shape[2], k.shape[2]
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.impl == "flash_reference":
            k, v = repeat_kv(k, self.n_heads // self.n_kv_heads), repeat_kv(v, self.n_heads // self.n_kv_heads)
            return flash_attention(q, k, v, self.block_size, mask, alibi)
        allowed = mask if mask is not None else causal_mask(q_len, kv_len, q.device)
        bias = alibi.bias(q_len) if alibi is not None else None
        if self.impl == "naive":
            k, v = repeat_kv(k, self.n_heads // self.n_kv_heads), repeat_kv(v, self.n_heads // self.n_kv_heads)
            return naive_attention(q, k, v, allowed, bias, dropout_p)
        float_mask = bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, dropout_p=dropout_p,
                                              enable_gqa=self.n_kv_heads != self.n_heads)
