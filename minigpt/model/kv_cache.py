"""A static key/value cache: preallocated once, written in place, never grown with ``torch.cat``.

Caching the keys and values of past positions turns autoregressive decoding from ``O(n^2)`` recomputation into
one new row per layer per step (the "KV cache" of every Transformer inference engine; static layout as in
gpt-fast). Memory: ``2 * n_layers * batch * n_kv_heads * max_seq_len * head_dim * bytes_per_element`` bytes.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values for every layer: two buffers ``[n_layers, batch, n_kv_heads, max_seq_len, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (keys and values)."""
        return self.k.numel() * self.k.element_size() * 2

    def update(
        self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``[batch, n_kv_heads, seq_len, head_dim]`` at positions ``start_pos ...``.

        Returns views of every cached position so far, ``[batch, n_kv_heads, start_pos + seq_len, head_dim]``.
        Raises ``ValueError`` if the write would run past ``max_seq_len``.
        """
        end = start_pos + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: positions up to {end} requested but the cache holds {self.max_seq_len}"
            )
        batch = k.shape[0]
        self.k[layer, :batch, :, start_pos:end] = k
        self.v[layer, :batch, :, start_pos:end] = v
        return self.k[layer, :batch, :, :end], self.v[layer, :batch, :, :end]
