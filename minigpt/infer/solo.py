"""The serving engine's compiled decode for a request running alone (`minigpt serve --compile`).

The compiled decode step of :mod:`minigpt.infer.fastpath` writes one column for its whole batch and attends to every
column of a static cache, so it is fastest over a cache not much longer than the sequence (135M fp32, 2 threads:
40 tokens/s with 256 columns, 28 with 2,048). The engine's slots hold the full context and their rows sit at their
own columns (:class:`~minigpt.infer.kv_cache.SlotKVCache`). So the step serves the engine when one request runs
alone -- a server with one user, where batching has nothing to gain: :class:`SoloDecode` mirrors that request's
keys and values into a cache of the step's own (:class:`~minigpt.infer.kv_cache.LayerKVCache`), sized as
:class:`~minigpt.infer.conversation.Conversation` sizes its cache (256 columns, doubled as the request grows), and
decodes there. Two or more running requests decode in the engine's batched eager forward as before.

The slot stays the record. The columns decoded in the mirror are copied back (:meth:`SoloDecode.sync`) before
anything else reads or moves the slot: a batched decode step (a request joined), the prefix cache remembering a
finished request, a freed slot filled by the last one (the engine's ``_decode`` and ``_free``; a newcomer's prefill
touches only its own slot). After a sync the mirror is dropped; the next lone step copies the slot in again (one
copy per layer).

Memory: one mirror, at most one slot's worth of KV cache, beside the engine's slots.
"""
from __future__ import annotations

from typing import Optional

import torch

from minigpt.infer.conversation import grown_length
from minigpt.infer.fastpath import FastPath
from minigpt.infer.kv_cache import LayerKVCache, SlotKVCache
from minigpt.infer.request import Request, choose_tokens


def plain_greedy(req: Request) -> bool:
    """Whether ``req``'s next token is the bare argmax of the model's logits: greedy, no penalties or bias, no
    logits processors (structured output), no logprobs. Such a step may go through the LM head's int8 screen
    (:meth:`FastPath.decode_next`: the same token but for float32 ties)."""
    p = req.params
    return p.greedy and not p.adjusts_logits and not req.logits_processors and p.logprobs is None


class SoloDecode:
    """Decode steps of the one running request through ``model``'s compiled step (see the module docstring).

    ``model``: a compiled :class:`FastPath` (its eager forward prefills; without LoRA adapters attached, which the
    compiled step would not apply); ``slots``: the engine's cache; ``context``: the most columns a mirror takes
    (the engine's ``max_seq_len``).
    """

    def __init__(self, model: FastPath, slots: SlotKVCache, context: int) -> None:
        if not model.compiled:
            raise ValueError("SoloDecode needs a FastPath with compile=True")
        self.model, self.slots, self.context = model, slots, context
        self.cache: Optional[LayerKVCache] = None
        self._asked = 0  # the length the mirror was made for (new_kv_cache rounds it up)
        self.req: Optional[Request] = None  # the request whose columns the mirror holds (None: no one's)
        self.slot = -1
        self.length = 0  # columns of the mirror holding req's keys and values
        self.synced = 0  # leading columns that the slot holds too

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (or load the saved) steps now, the logits step and the greedy one, rather than in the first
        request; returns the seconds spent compiling (:attr:`FastPath.compile_seconds`)."""
        before = self.model.compile_seconds
        self.sync()
        cache = self.model.new_kv_cache(1, grown_length(1, self.context))
        token = torch.zeros(1, 1, dtype=torch.long, device=self.model.device)
        self.model.decode_step(token, 0, cache)
        self.model.decode_next(token, 0, cache)
        return self.model.compile_seconds - before

    def decode(self, req: Request) -> list:
        """One step of ``req`` (running alone): its pick as :func:`~minigpt.infer.request.choose_tokens` gives it,
        ``[(token, TokenLogprob or None)]`` or ``[exception]``, the greedy token of a :func:`plain_greedy` request
        through :meth:`next_token`. Advances ``req.length``; raises what the step raises."""
        if plain_greedy(req):
            return [(self.next_token(req), None)]
        return choose_tokens([req], self.logits(req))

    def logits(self, req: Request) -> torch.Tensor:
        """Logits ``[1, vocab]`` of ``req.pending`` at column ``req.length`` (the engine's decode step for one row);
        advances ``req.length``."""
        pos = self._enter(req)
        out = self.model.decode_step(self._token(req), pos, self.cache)
        self._advance(req)
        return out

    def next_token(self, req: Request) -> int:
        """The greedy next token after ``req.pending`` (for :func:`plain_greedy` requests); advances ``req.length``."""
        pos = self._enter(req)
        out = int(self.model.decode_next(self._token(req), pos, self.cache)[0])
        self._advance(req)
        return out

    @torch.inference_mode()
    def sync(self) -> None:
        """Copy the columns decoded in the mirror into the request's slot and drop the mirror's claim."""
        if self.req is not None and self.length > self.synced:
            cols = slice(self.synced, self.length)
            for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
                self.slots.k[layer, self.slot, :, cols].copy_(k[0, :, cols])
                self.slots.v[layer, self.slot, :, cols].copy_(v[0, :, cols])
        self.req, self.slot, self.length, self.synced = None, -1, 0, 0

    # ------------------------------------------------------------------------------------------------ helpers
    def _token(self, req: Request) -> torch.Tensor:
        return torch.tensor([[req.pending]], dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def _enter(self, req: Request) -> int:
        """Make the mirror hold ``req``'s columns with room for one more; returns the column to write."""
        need = req.length + 1
        if self.req is not req or self.slot != req.slot or self.length != req.length:
            self.sync()  # the engine syncs before the slots change; this only drops a stale claim
            self._make_room(need, keep=0)
            for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
                k[0, :, :req.length].copy_(self.slots.k[layer, req.slot, :, :req.length])
                v[0, :, :req.length].copy_(self.slots.v[layer, req.slot, :, :req.length])
            self.req, self.slot, self.length, self.synced = req, req.slot, req.length, req.length
        elif self.cache.max_seq_len < need:
            self._make_room(need, keep=self.length)
        return req.length

    def _make_room(self, need: int, keep: int) -> None:
        """A mirror of :func:`grown_length` columns for ``need``; the first ``keep`` columns carried over."""
        length = grown_length(need, self.context)
        if self.cache is not None and keep == 0 and self._asked == length:
            return
        new, self._asked = self.model.new_kv_cache(1, length), length
        if self.cache is not None and keep:
            for old_k, old_v, k, v in zip(self.cache.k, self.cache.v, new.k, new.v):
                k[:, :, :keep].copy_(old_k[:, :, :keep])
                v[:, :, :keep].copy_(old_v[:, :, :keep])
        self.cache = new

    def _advance(self, req: Request) -> None:
        req.length += 1
        self.length = req.length
