"""Admission and prefill of the continuous-batching engine: :class:`Prefill`, the base class of
:class:`~minigpt.infer.engine.Engine` holding that half of its scheduler step (the engine's module docstring has
the whole step), with the prefix cache (:mod:`minigpt.infer.prefix_cache`).

A request admitted gets a slot, then its prompt's keys and values:

1. **copied** where they exist already: the longest cached run of full blocks of its prompt (under its adapter),
   or, for a request admitted together with one that has the same prompt or shares more of it (``n`` samples of
   one prompt, concurrent requests with one system prompt), that request's slot once its prefill is done (a second
   *wave* of the same step), so a shared prompt is prefilled once;
2. **prefilled** for the rest: always at least the last prompt token, whose logits give the first sampled token.

A request whose ``params.prompt_logprobs`` is set needs the logits of every prompt position and is prefilled whole.
Rows prefilled together may have cached different lengths ``c_i`` and have ``n_i`` new tokens: with ``C = max c_i``
and ``N = max n_i`` one forward at ``start_pos = C`` takes ``[batch, N]`` tokens, row ``i``'s new tokens
right-aligned, and the attention mask ``[batch, C + N]`` marks its cached columns ``0 .. c_i - 1`` and its new ones
``C + N - n_i ..``, so ``positions_from_mask`` gives them positions ``c_i ..`` and every row's last token is the
last column (the fast path then computes the LM head for it alone). The cache wrote the new keys/values at columns
``C + N - n_i ..``; they are then moved to ``c_i ..``, where the row continues. After a wave, each request's full
prompt blocks go into the prefix cache; when a request ends, the full blocks of its prompt and generated tokens do
(a conversation's next turn starts with them).
"""
from __future__ import annotations

from typing import Optional

import torch

from minigpt.infer.fastpath import FastPath
from minigpt.infer.prefix_cache import PrefixCache, block_hashes, shared_blocks, tokens_in_slot
from minigpt.infer.request import Request, fill_prompt_logprobs


class Prefill:
    """Admission and prefill (see the module docstring). Uses the engine's ``model``, ``cache``, ``prefix``
    (a :class:`PrefixCache` or None), ``block_size``, ``metrics``, queue, running list and limits, and calls its
    ``_sample_and_accept``, ``_fail`` and ``_set_adapters``."""

    prefix: Optional[PrefixCache]
    block_size: int

    def _admit(self) -> list[Request]:
        """Move waiting requests into slots (first come, first served, within the limits); returns them in slot
        order, sharers of a request admitted with them last (``self._sources`` maps them to it)."""
        batch: list[Request] = []
        longest = 0
        with self._cond:
            while self._waiting and len(self._running) + len(batch) < self.max_batch_size:
                req = self._waiting[0]
                if self._reserved + req.reserved > self.max_batch_tokens:
                    break
                if not req.block_keys:
                    req.block_keys = block_hashes(req.prompt, self.block_size, req.adapter)
                new = len(req.prompt) - self._reusable(req, batch)
                if batch and max(longest, new) * (len(batch) + 1) > self.max_prefill_tokens:
                    break
                self._waiting.popleft()
                longest = max(longest, new)
                self._reserved += req.reserved
                batch.append(req)
            first, second = [], []
            for req in batch:
                src, n = self._best_source(req, first)
                hit = self._cache_hit(req)
                if src is not None and n > hit:
                    self._sources[req.id] = (src, n)
                    second.append(req)
                else:
                    first.append(req)
            batch = first + second
            for req in batch:
                req.slot = len(self._running)
                self._running.append(req)
        return batch

    def _wants_all_logits(self, req: Request) -> bool:
        return getattr(req.params, "prompt_logprobs", None) is not None

    def _cache_hit(self, req: Request) -> int:
        """Prompt tokens the prefix cache could give ``req`` now (no side effect)."""
        if self.prefix is None or self._wants_all_logits(req):
            return 0
        blocks = self.prefix.peek(req.prompt, req.block_keys)
        return min(blocks * self.block_size, len(req.prompt) - 1)

    def _best_source(self, req: Request, batch: list[Request]) -> tuple[Optional[Request], int]:
        """The request of ``batch`` whose prompt shares the most leading tokens with ``req``'s, and how many of
        them ``req`` may copy (block-aligned, or all but the last for the same prompt); ``(None, 0)`` if none."""
        best, source = 0, None
        if self._wants_all_logits(req):
            return None, 0
        for other in batch:
            if other.adapter != req.adapter:
                continue
            if other.prompt == req.prompt:
                n = len(req.prompt) - 1
            else:
                n = min(shared_blocks(other.block_keys, req.block_keys) * self.block_size, len(req.prompt) - 1,
                        len(other.prompt))
            if n > best:
                best, source = n, other
        return source, best

    def _reusable(self, req: Request, batch: list[Request]) -> int:
        return max(self._cache_hit(req), self._best_source(req, batch)[1])

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill(self, batch: list[Request]) -> None:
        first = [r for r in batch if r.id not in self._sources]
        second = [r for r in batch if r.id in self._sources]
        failed: list[tuple[Request, BaseException]] = []
        for req in first:
            req.cached = self._load_cached(req)
        ok, rows = self._prefill_wave(first, failed)
        done = set(r.id for r in ok)
        for req in second:
            src, n = self._sources.pop(req.id)
            if src.id in done:
                self.cache.move(src.slot, req.slot, n)
                req.cached = n
            else:  # its source failed: use the prefix cache alone
                req.cached = self._load_cached(req)
        ok2, rows2 = self._prefill_wave(second, failed)
        # Failing a request frees its slot and moves another into it: only once every wave has run.
        for req, e in failed:
            self._fail(req, e)
        reqs = ok + ok2
        if reqs:
            self._sample_and_accept(reqs, torch.cat(rows + rows2))

    def _load_cached(self, req: Request) -> int:
        """Copy the prefix cache's longest hit into ``req``'s slot; returns the prompt tokens it covers (at most
        all but the last)."""
        if self.prefix is None or self._wants_all_logits(req):
            return 0
        blocks = self.prefix.match(req.prompt, req.block_keys, req.id)
        return min(self.prefix.load(blocks, self.cache, req.slot), len(req.prompt) - 1)

    def _prefill_wave(self, reqs: list[Request], failed: list) -> tuple[list[Request], list[torch.Tensor]]:
        """Prefill ``reqs`` (consecutive slots) in groups that fit the slot width; a group whose forward raises is
        run request by request, and the requests that still raise are added to ``failed``. Returns the requests
        that succeeded and their last-position logits (one ``[k, vocab]`` tensor per group), in order."""
        ok: list[Request] = []
        rows: list[torch.Tensor] = []
        for group in self._groups(reqs):
            try:
                rows.append(self._prefill_forward(group))
                ok += group
            except Exception as e:
                if len(group) == 1:
                    failed.append((group[0], e))
                    continue
                for req in group:  # find the request that breaks the group: the others still start
                    try:
                        rows.append(self._prefill_forward([req]))
                        ok.append(req)
                    except Exception as e1:
                        failed.append((req, e1))
        if self.prefix is not None:
            for req in ok:
                self.prefix.insert(req.prompt, req.block_keys, self.cache, req.slot, req.id)
        return ok, rows

    def _groups(self, reqs: list[Request]) -> list[list[Request]]:
        """Split ``reqs`` into runs prefilled by one forward: ``max cached + max new`` tokens must fit a slot, and
        padding may at most double the tokens computed."""
        groups: list[list[Request]] = []
        cur: list[Request] = []
        c_max = n_max = n_sum = 0
        for req in reqs:
            n = len(req.prompt) - req.cached
            c2, n2 = max(c_max, req.cached), max(n_max, n)
            if cur and (c2 + n2 > self.max_seq_len or n2 * (len(cur) + 1) > 2 * (n_sum + n) + 64):
                groups.append(cur)
                cur, c2, n2, n_sum = [], req.cached, n, 0
            cur.append(req)
            c_max, n_max, n_sum = c2, n2, n_sum + n
        if cur:
            groups.append(cur)
        return groups

    def _prefill_forward(self, reqs: list[Request]) -> torch.Tensor:
        """Last-position logits ``[len(reqs), vocab]`` after writing the prompts' uncached parts into the
        requests' slots (see the module docstring for the layout)."""
        offset = reqs[0].slot
        assert all(r.slot == offset + i for i, r in enumerate(reqs)), "prefill rows must be consecutive slots"
        cached = [r.cached for r in reqs]
        new = [len(r.prompt) - c for r, c in zip(reqs, cached)]
        start, width = max(cached), max(new)
        x = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            x[i, width - new[i]:] = torch.tensor(r.prompt[cached[i]:], dtype=torch.long)
        x = x.to(self.device)
        mask = None
        if min(cached) != start or min(new) != width:
            cols = torch.arange(start + width)[None, :]
            c_t, n_t = torch.tensor(cached)[:, None], torch.tensor(new)[:, None]
            mask = ((cols < c_t) | (cols >= start + width - n_t)).long().to(self.device)
        self._set_adapters(reqs)
        self.cache.for_prefill(offset)
        want_all = any(self._wants_all_logits(r) for r in reqs)
        if isinstance(self.model, FastPath) and not want_all:
            logits = self.model(x, start, self.cache, mask, last_only=True)
        else:
            logits = self.model(x, start, self.cache, mask)
        for i, r in enumerate(reqs):
            self.cache.shift(offset + i, start + width - new[i], cached[i], new[i])
            if self._wants_all_logits(r):  # echo's scores: every prompt position's logits (nothing was cached)
                fill_prompt_logprobs([r], logits[i:i + 1, width - new[i]:], [new[i]])
            r.length = len(r.prompt)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in reqs))
        self.metrics.prefix_cache_hit_tokens.inc(sum(cached))
        return logits[:, -1]

    def _remember(self, req: Request) -> None:
        """At the end of ``req``: cache the full blocks of its prompt and generated tokens (unless it failed), and
        let go of the blocks it held."""
        if self.prefix is None:
            return
        if req.finish_reason != "error" and req.slot is not None and req.length > 0:
            tokens = tokens_in_slot(req.prompt, getattr(req, "output_ids", ()), req.length)
            keys = block_hashes(tokens, self.block_size, req.adapter, len(req.block_keys), req.block_keys)
            self.prefix.insert(tokens, keys, self.cache, req.slot, req.id)
        self.prefix.release(req.id)
