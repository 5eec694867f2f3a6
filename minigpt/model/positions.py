"""Position encodings other than RoPE (:mod:`minigpt.model.rope`): ALiBi attention biases and the sinusoidal table.

* ALiBi (Press et al. 2022, "Train Short, Test Long", section 3): no position vectors at all; head ``h`` adds
  ``-m_h * (i - j)`` to the score of query position ``i`` and key position ``j <= i``, with a fixed per-head slope
  ``m_h``. Being a function of the distance only, it works at any absolute position and beyond the training context.
* Sinusoidal (Vaswani et al. 2017, section 3.5): ``PE[p, 2i] = sin(p / 10000^(2i/dim))``,
  ``PE[p, 2i+1] = cos(p / 10000^(2i/dim))``, added to the token embeddings.
* Learned absolute positions (GPT-2) are an ``nn.Embedding`` in :class:`minigpt.model.transformer.Transformer`; ``none``
  (NoPE) relies on the causal mask alone to tell positions apart (Haviv et al. 2022).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes ``[n_heads]`` float32.

    For ``n`` a power of two: the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^(-8)`` (Press et al. 2022,
    section 3). Otherwise, as the paper's reference code does: the slopes of the closest power of two ``m < n``,
    followed by every other slope of ``2m`` heads (``2^(-4/m), 2^(-12/m), ...``) until there are ``n``.
    Raises ``ValueError`` for ``n_heads < 1``.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    m = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = power_of_two(m)
    if m < n_heads:
        slopes += power_of_two(2 * m)[0::2][: n_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


class Alibi(NamedTuple):
    """What attention needs to build ALiBi biases tile by tile: ``slopes`` ``[n_heads]`` and ``key_positions``
    ``[batch or 1, kv_len]`` (int64), the absolute position of every key; the queries are the last ``q_len`` keys
    (self-attention over a cache prefix)."""

    slopes: torch.Tensor
    key_positions: torch.Tensor

    def bias(self, q_len: int, q_start: int = 0, q_end: int | None = None, k_start: int = 0,
             k_end: int | None = None) -> torch.Tensor:
        """Float32 bias ``[batch or 1, n_heads, q_end - q_start, k_end - k_start]`` for query rows
        ``q_start:q_end`` (of the last ``q_len`` positions) and key columns ``k_start:k_end``:
        ``-slope * (query_position - key_position)``. Entries for future keys are positive: the causal mask hides
        them."""
        kv_len = self.key_positions.shape[-1]
        q_end = q_len if q_end is None else q_end
        k_end = kv_len if k_end is None else k_end
        offset = kv_len - q_len
        q_pos = self.key_positions[:, offset + q_start:offset + q_end].float()
        k_pos = self.key_positions[:, k_start:k_end].float()
        distance = q_pos[:, None, :, None] - k_pos[:, None, None, :]
        return -self.slopes.to(distance.device)[None, :, None, None] * distance


def sinusoidal_table(max_seq_len: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """``[max_seq_len, dim]`` float32: ``PE[p, 2i] = sin(p / base^(2i/dim))``, ``PE[p, 2i+1] = cos(...)``
    (Vaswani et al. 2017, section 3.5); for odd ``dim`` the last column is the sine of the next pair."""
    positions = torch.arange(max_seq_len, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions * inv_freq[None, :]
    table = torch.zeros(max_seq_len, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table.float()
