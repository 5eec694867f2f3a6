"""The inference layer's KV caches, both :class:`~minigpt.model.kv_cache.KVCache` subclasses (same length check,
size and interface): :class:`LayerKVCache`, one tensor per layer, for the compiled decode step of
:mod:`minigpt.infer.fastpath`, and :class:`SlotKVCache`, whose rows are the request slots of the serving engine
(:mod:`minigpt.infer.engine`).
"""
from __future__ import annotations

from typing import Optional

import torch

from minigpt.infer.launcher import CACHE_BUCKET
from minigpt.model.kv_cache import KVCache


def fitted_length(need: int) -> int:
    """The cache length for ``need`` columns where the step serves every length (an AOTInductor package):
    ``need`` rounded up to :data:`~minigpt.infer.launcher.CACHE_BUCKET` (64) columns, or to a quarter of the
    largest power of two not above it where that is coarser. At most 64 columns or 25 % more than asked, so the step
    reads few masked columns, and few lengths, so a growing cache is copied a logarithmic number of times."""
    step = max(CACHE_BUCKET, (1 << (max(need, 1).bit_length() - 1)) // 4)
    return -(-need // step) * step


FIRST_LENGTH = 256  # the first cache length (columns); later ones double, up to the context


def grown_length(need: int, cap: int, fitted: bool = False) -> int:
    """The cache length for ``need`` columns: :data:`FIRST_LENGTH` doubled until it holds them, or with ``fitted``
    (a step that serves every length) :func:`fitted_length`; at most ``cap``."""
    if fitted:
        return min(fitted_length(need), cap)
    length = FIRST_LENGTH
    while length < need:
        length *= 2
    return min(length, cap)


@torch.inference_mode()
def grown_cache(model, old, need: int, cap: int, keep: int, batch: int = 1, fitted: bool = False):
    """A new cache of ``model`` (``new_kv_cache``) of ``batch`` rows and :func:`grown_length` ``(need, cap,
    fitted)`` columns, whose first ``keep`` columns of every row are copied from the cache ``old`` of as many rows
    (None or ``keep`` 0: nothing carried over)."""
    new = model.new_kv_cache(batch, grown_length(need, cap, fitted))
    if old is not None and keep:
        new.copy_prefix(old, keep)
    return new


class LayerKVCache(KVCache):
    """A :class:`KVCache` whose layers are separate tensors: ``k[i]``/``v[i]`` ``[batch, n_kv_heads, max_seq_len,
    head_dim]``.

    Same memory and interface as the stacked cache; the difference matters to the compiled step: each layer's cache
    is its own graph input with no offset into a shared buffer, so the cache-write kernel of every layer is the
    same code and is compiled once (with one stacked buffer each layer's write bakes in its own offset: one C++
    compilation per layer, most of a cold compile).
    """

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> None:
        n_layers, layer_shape = shape[0], shape[1:]
        self.k = [torch.zeros(layer_shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(layer_shape, dtype=dtype, device=device) for _ in range(n_layers)]


class SlotKVCache(KVCache):
    """A :class:`KVCache` whose batch rows are request slots, each row written at its own column.

    Buffers ``[n_layers, n_slots, n_kv_heads, max_seq_len, head_dim]``. Before each forward the engine says which
    rows the forward covers (``offset .. offset + batch``) and how to write:

    * :meth:`for_prefill`: like the base class, columns ``start_pos .. start_pos + seq_len`` of every row;
    * :meth:`for_decode` with per-row lengths ``lens`` (tokens already cached) and ``S = max(lens)``: the single
      new key/value of row ``i`` goes to column ``lens[i]`` and to column ``S``; returns columns ``0 .. S``.
    """

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(n_layers, n_slots, n_kv_heads, max_seq_len, head_dim, dtype, device)
        self._offset = 0
        self._lens: Optional[torch.Tensor] = None
        self._rows: Optional[torch.Tensor] = None

    def for_prefill(self, offset: int) -> None:
        self._offset, self._lens, self._rows = offset, None, None

    def for_decode(self, offset: int, lens: torch.Tensor) -> None:
        """``lens``: int64 ``[batch]`` on the cache's device."""
        self._offset, self._lens = offset, lens
        self._rows = torch.arange(offset, offset + lens.numel(), device=lens.device)

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`KVCache.update`, on the rows of the current forward, written as :meth:`for_prefill` or
        :meth:`for_decode` said. Raises ``ValueError`` past ``max_seq_len`` (per slot) or for a decode step of
        more than one token per row."""
        batch, _, seq_len, _ = k.shape
        end = start_pos + seq_len
        self.check_fits(end)
        rows = slice(self._offset, self._offset + batch)
        kl, vl = self.k[layer], self.v[layer]
        if self._lens is None:
            kl[rows, :, start_pos:end] = k
            vl[rows, :, start_pos:end] = v
        else:
            if seq_len != 1 or batch != self._lens.numel():
                raise ValueError("a decode step takes exactly one new token per row")
            # Advanced indices on dims 0 and 2 around a slice: the selection is [batch, n_kv_heads, head_dim].
            kl[self._rows, :, self._lens] = k[:, :, 0]
            vl[self._rows, :, self._lens] = v[:, :, 0]
            kl[rows, :, start_pos] = k[:, :, 0]
            vl[rows, :, start_pos] = v[:, :, 0]
        return kl[rows, :, :end], vl[rows, :, :end]

    def shift(self, slot: int, src: int, dst: int, length: int) -> None:
        """Move columns ``src .. src + length`` of ``slot`` to ``dst .. dst + length`` (all layers; the ranges may
        overlap)."""
        if src != dst and length > 0:
            self.k[:, slot, :, dst:dst + length] = self.k[:, slot, :, src:src + length].clone()
            self.v[:, slot, :, dst:dst + length] = self.v[:, slot, :, src:src + length].clone()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of slot ``src`` into slot ``dst`` (all layers)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
