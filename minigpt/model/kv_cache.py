"""A static key/value cache: preallocated once, written in place, never grown with ``torch.cat``.

Caching the keys and values of past positions turns autoregressive decoding from ``O(n^2)`` recomputation into
one new row per layer per step (the "KV cache" of every Transformer inference engine; static layout as in
gpt-fast). Memory: ``2 * n_layers * batch * n_kv_heads * max_seq_len * head_dim * bytes_per_element`` bytes.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values for every layer: two buffers ``[n_layers, batch, n_kv_heads, max_seq_len, head_dim]``.

    The base of every cache of the package: the per-layer cache of the compiled decode step and the serving
    engine's slot cache (:mod:`minigpt.infer.kv_cache`) subclass it, and share its length check
    (:meth:`check_fits`), its size (:attr:`nbytes`) and, where they write like it, :meth:`update`. ``k[layer]`` /
    ``v[layer]`` is one layer's ``[batch, n_kv_heads, max_seq_len, head_dim]`` whatever the subclass stores.
    """

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
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self._allocate((n_layers, batch_size, n_kv_heads, max_seq_len, head_dim), dtype, device)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> None:
        """Create ``self.k``/``self.v`` for ``shape`` ``(n_layers, batch, n_kv_heads, max_seq_len, head_dim)``,
        zeroed: here two stacked buffers."""
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (keys and values)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def copy_prefix(self, other: "KVCache", columns: int) -> None:
        """Copy the first ``columns`` positions of every layer and row of ``other`` (a cache of the same layers,
        rows, heads and head size, any length) into this cache: how a cache is carried into a longer one. Raises
        ``ValueError`` when either cache is shorter than ``columns`` or their shapes differ otherwise."""
        mine, theirs = self.k[0].shape, other.k[0].shape
        if len(self.k) != len(other.k) or (mine[0], mine[1], mine[3]) != (theirs[0], theirs[1], theirs[3]):
            raise ValueError(f"cannot copy a cache of {len(other.k)} layers x {tuple(theirs)} into one of "
                             f"{len(self.k)} layers x {tuple(mine)}")
        if columns > min(mine[2], theirs[2]):
            raise ValueError(f"cannot copy {columns} positions between caches of {theirs[2]} and {mine[2]}")
        for src_k, src_v, dst_k, dst_v in zip(other.k, other.v, self.k, self.v):
            dst_k[:, :, :columns].copy_(src_k[:, :, :columns])
            dst_v[:, :, :columns].copy_(src_v[:, :, :columns])

    def adopt(self, other: "KVCache") -> None:
        """Take over ``other``'s buffers and length (``other`` a longer copy of this cache, see
        :meth:`copy_prefix`): whoever holds this cache holds the longer one."""
        self.k, self.v, self.max_seq_len = other.k, other.v, other.max_seq_len

    def check_fits(self, end: int) -> None:
        """Raise ``ValueError`` unless positions ``0 .. end - 1`` fit in the cache (``end <= max_seq_len``)."""
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions up to {end} requested do not fit in a cache of "
                             f"{self.max_seq_len}")

    def update(
        self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``[batch, n_kv_heads, seq_len, head_dim]`` at positions ``start_pos ...``.

        Returns views of every cached position so far, ``[batch, n_kv_heads, start_pos + seq_len, head_dim]``.
        Raises ``ValueError`` if the write would run past ``max_seq_len``.
        """
        end = start_pos + k.shape[2]
        self.check_fits(end)
        batch = k.shape[0]
        cache_k, cache_v = self.k[layer], self.v[layer]
        cache_k[:batch, :, start_pos:end] = k
        cache_v[:batch, :, start_pos:end] = v
        return cache_k[:batch, :, :end], cache_v[:batch, :, :end]
