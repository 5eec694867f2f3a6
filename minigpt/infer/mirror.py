"""The serving engine's compiled decode for a few running requests (`minigpt serve --compile`).

The compiled decode step of :mod:`minigpt.infer.fastpath` writes one column for its whole batch, reads left padding
per row (``pad``), and attends to every column of a static cache, so it is fastest over a cache not much longer than
the sequences (135M fp32, 2 threads: 40 tokens/s with 256 columns, 28 with 2,048). The engine's slots hold the full
context and their rows sit at their own columns (:class:`~minigpt.infer.kv_cache.SlotKVCache`). So when at most
``max_rows`` requests run, :class:`MirrorDecode` copies their keys and values into a cache of the step's own (a
:class:`~minigpt.infer.kv_cache.LayerKVCache` of a few rows), right-aligned: row ``b`` with ``L_b`` columns starts
at column ``P - L_b`` (its ``pad``), ``P`` the longest row's length, so every row writes its next column at ``P``
and its RoPE positions stay ``0 .. L_b``. The batch is rounded up to the next compiled size (1, 2, 4, ...,
``max_rows``: one compiled step per size); a spare row is all padding and its output ignored. The mirror is sized
as :class:`~minigpt.infer.conversation.Conversation` sizes its cache: for an AOTInductor package, which serves
every length, to the rows (:func:`~minigpt.infer.kv_cache.fitted_length`, grown as they grow), else 256 columns,
doubled as the rows grow.
More running requests decode in the engine's batched eager forward.

The slots stay the record. The columns decoded in the mirror are copied back (:meth:`MirrorDecode.sync`) before
anything else reads or moves a slot: an eager batched step, the prefix cache remembering a finished request, a
freed slot filled by the last one (the engine's ``_decode`` and ``_free``; a newcomer's prefill touches only its
own slot). After a sync the mirror's claim is dropped; the next step copies the slots in again (one copy per row
and layer), so a request joining or leaving costs one copy of the running rows' caches.

Memory: one mirror, at most ``max_rows`` rows of the longest running request's length (rounded up as above),
beside the engine's slots.
"""
from __future__ import annotations

from typing import Optional

import torch

from minigpt.infer.fastpath import FastPath
from minigpt.infer.kv_cache import LayerKVCache, SlotKVCache, grown_cache, grown_length
from minigpt.infer.request import Request, choose_tokens


def plain_greedy(req: Request) -> bool:
    """Whether ``req``'s next token is the bare argmax of the model's logits: greedy, no penalties or bias, no
    logits processors (structured output), no logprobs. Such a step may go through the LM head's int8 screen
    (:meth:`FastPath.decode_next`: the same token but for float32 ties)."""
    p = req.params
    return p.greedy and not p.adjusts_logits and not req.logits_processors and p.logprobs is None


def batch_sizes(max_rows: int) -> tuple[int, ...]:
    """The batch sizes compiled for up to ``max_rows`` rows: powers of two below it, then ``max_rows``."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return (*sizes, max_rows)


class MirrorDecode:
    """Decode steps of up to ``max_rows`` running requests through ``model``'s compiled step (see the module
    docstring).

    ``model``: a compiled :class:`FastPath` (its eager forward prefills; without LoRA adapters attached, which the
    compiled step would not apply); ``slots``: the engine's cache; ``context``: the most columns a mirror takes
    (the engine's ``max_seq_len``). Raises ``ValueError`` for a model that is not compiled or ``max_rows`` < 1.
    """

    def __init__(self, model: FastPath, slots: SlotKVCache, context: int, max_rows: int = 1) -> None:
        if not model.compiled:
            raise ValueError("MirrorDecode needs a FastPath with compile=True")
        self.model, self.slots, self.context = model, slots, context
        self.sizes = batch_sizes(max_rows)
        self.max_rows = max_rows
        self.cache: Optional[LayerKVCache] = None
        self._asked = (0, 0)  # the (rows, length) the mirror was made for (new_kv_cache rounds the length up)
        self.reqs: list[Request] = []  # the requests whose columns the mirror holds, by row (empty: no one's)
        self.rows: list[tuple[int, int]] = []  # (slot, pad) of each of them
        self.pad: Optional[torch.Tensor] = None  # [batch] int64: every row's pad, spare rows' too
        self.col = 0  # the next column every row writes (the longest row's length)
        self.synced: list[int] = []  # leading columns of each row that its slot holds too

    def fits(self, reqs: list[Request]) -> bool:
        """Whether ``reqs`` (the running requests) decode here rather than in the eager batch."""
        return 0 < len(reqs) <= self.max_rows

    def max_bytes(self) -> int:
        """The most bytes the mirror takes: ``max_rows`` rows of the whole context (keys and values, every layer,
        the slots' dtype)."""
        layers, _, kv_heads, _, head_dim = self.slots.k.shape
        return 2 * layers * self.max_rows * kv_heads * self.context * head_dim * self.slots.k.element_size()

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (or load the saved) steps now, the logits step and the greedy one for every batch size, rather
        than in the first requests; returns the seconds spent compiling (:attr:`FastPath.compile_seconds`)."""
        before = self.model.compile_seconds
        self.sync()
        for rows in self.sizes:
            cache = self.model.new_kv_cache(rows, grown_length(1, self.context, self.model.any_cache_length))
            token = torch.zeros(rows, 1, dtype=torch.long, device=self.model.device)
            pad = torch.zeros(rows, dtype=torch.long, device=self.model.device)
            self.model.decode_step(token, 0, cache, pad=pad)
            self.model.decode_next(token, 0, cache, pad=pad)
        return self.model.compile_seconds - before

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> list:
        """One step of ``reqs`` (the running requests, at most ``max_rows``): their picks as
        :func:`~minigpt.infer.request.choose_tokens` gives them, ``[(token, TokenLogprob or None)]`` or
        ``[exception]`` per request; when every request is :func:`plain_greedy`, their greedy tokens through the
        screened greedy step. Advances each ``req.length``; raises what the step raises (nothing advanced then)."""
        pos = self._enter(reqs)
        rows = self.pad.shape[0]
        tokens = torch.zeros(rows, 1, dtype=torch.long)
        tokens[:len(reqs), 0] = torch.tensor([r.pending for r in reqs], dtype=torch.long)
        tokens = tokens.to(self.model.device)
        if all(plain_greedy(r) for r in reqs):
            picked = self._step(tokens, pos, greedy=True)[:len(reqs)].tolist()
            self._advance(reqs)
            return [(int(t), None) for t in picked]
        logits = self._step(tokens, pos, greedy=False)[:len(reqs)]
        self._advance(reqs)
        return choose_tokens(reqs, logits)

    @torch.inference_mode()
    def sync(self) -> None:
        """Copy the columns decoded in the mirror into the requests' slots and drop the mirror's claim."""
        for b, ((slot, pad), synced) in enumerate(zip(self.rows, self.synced)):
            length = self.col - pad
            if length > synced:
                src, dst = slice(pad + synced, pad + length), slice(synced, length)
                for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
                    self.slots.k[layer, slot, :, dst].copy_(k[b, :, src])
                    self.slots.v[layer, slot, :, dst].copy_(v[b, :, src])
        self.reqs, self.rows, self.synced = [], [], []

    # ------------------------------------------------------------------------------------------------ helpers
    def _holds(self, reqs: list[Request]) -> bool:
        """Whether the mirror holds exactly ``reqs``' columns, row by row, each ready to write at ``col``."""
        return (len(reqs) == len(self.reqs) and all(a is b for a, b in zip(reqs, self.reqs))
                and all(r.slot == slot and pad + r.length == self.col for r, (slot, pad) in zip(reqs, self.rows)))

    def _enter(self, reqs: list[Request]) -> int:
        """Make the mirror hold ``reqs``' columns, right-aligned, with room for one more; returns the column to
        write."""
        if not self._holds(reqs):
            self.sync()  # the engine syncs before the slots change; this only drops a stale claim
            rows = next(size for size in self.sizes if size >= len(reqs))
            lengths = [r.length for r in reqs]
            col = max(lengths)
            self._make_room(rows, col + 1, keep=0)
            pads = [col - n for n in lengths] + [col] * (rows - len(reqs))  # spare rows: padding only
            for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
                for b, (r, n) in enumerate(zip(reqs, lengths)):
                    k[b, :, pads[b]:col].copy_(self.slots.k[layer, r.slot, :, :n])
                    v[b, :, pads[b]:col].copy_(self.slots.v[layer, r.slot, :, :n])
            self.reqs, self.rows, self.synced = list(reqs), [(r.slot, p) for r, p in zip(reqs, pads)], lengths
            self.pad = torch.tensor(pads, dtype=torch.long, device=self.model.device)
            self.col = col
        elif self.cache.max_seq_len < self.col + 1:
            self._make_room(self.pad.shape[0], self.col + 1, keep=self.col)
        return self.col

    def _make_room(self, rows: int, need: int, keep: int) -> None:
        """A mirror of ``rows`` rows and :func:`grown_length` columns for ``need``; the first ``keep`` columns of
        every row carried over."""
        fitted = self.model.any_cache_length  # a package: sized to the rows (fitted_length), else powers of two
        asked = (rows, grown_length(need, self.context, fitted))
        if self.cache is None or keep or self._asked != asked:
            self.cache = grown_cache(self.model, self.cache, need, self.context, keep, batch=rows, fitted=fitted)
            self._asked = asked

    def _step(self, tokens: torch.Tensor, pos: int, greedy: bool) -> torch.Tensor:
        """The step over the mirror: greedy tokens ``[rows]`` or logits ``[rows, vocab]``.

        With the FastPath's steps switched to eager (``compiled`` False, as the tests run the bookkeeping), the
        padding becomes the eager forward's attention mask and positions: the same step, uncompiled."""
        m = self.model
        if m.compiled:
            return (m.decode_next if greedy else m.decode_step)(tokens, pos, self.cache, pad=self.pad)
        mask = positions = None
        if bool((self.pad != 0).any()):
            mask = (torch.arange(pos + 1, device=tokens.device)[None, :] >= self.pad[:, None]).long()
            positions = (pos - self.pad)[:, None]
        logits = m.decode_step(tokens, pos, self.cache, attention_mask=mask, positions=positions)
        return logits.argmax(-1) if greedy else logits

    def _advance(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.length += 1
        self.col += 1
