"""Rotary position embeddings (Su et al. 2021, "RoFormer"), in the rotate-half layout of Hugging Face Llama.

Meta's reference code rotates interleaved pairs ``(x[2i], x[2i+1])``; Hugging Face rotates ``(x[i], x[i + d/2])``.
The two differ only by a permutation of the q/k projection rows. We use the Hugging Face layout so that weights
move between MiniGPT and ``LlamaForCausalLM`` by renaming keys alone.
"""
from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i / head_dim)`` for ``i in [0, head_dim/2)``; shape ``[head_dim // 2]``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``(cos, sin)`` tables, each ``[max_seq_len, head_dim]`` float32.

    Row ``p`` holds the angles ``p * inv_freq`` repeated twice (``cat(freqs, freqs)``), matching ``rotate_half``.
    """
    inv_freq = rope_inv_freq(head_dim, theta)
    positions = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (split in two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq_len, head_dim]`` by the angles of its positions.

    ``cos``/``sin`` are the table rows of the absolute positions ``start_pos + i``: ``[seq_len, head_dim]``
    (shared by the batch) or ``[batch, 1, seq_len, head_dim]`` (per-row positions).
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
