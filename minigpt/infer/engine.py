"""Continuous batching: one model worker decodes every running request in one forward per token.

Requests join and leave the running batch at token boundaries (Yu et al. 2022, "Orca: a distributed serving system
for Transformer-based generative models", iteration-level scheduling). Each running request owns one *slot* of a
preallocated KV cache (:class:`SlotKVCache`); an iteration of the worker (:meth:`Engine.step`)

1. drops cancelled and timed-out requests, freeing their slots at once;
2. admits waiting requests (first come, first served) while a slot is free, the running requests' reserved tokens
   (prompt + ``max_tokens``) stay within ``max_batch_tokens`` and the padded prefill stays within
   ``max_prefill_tokens``, copies what the prefix cache (or a request admitted with them) already holds of their
   prompts into their slots and prefills the rest together, sampling their first token (:mod:`minigpt.infer.prefill`);
3. decodes one token for every running request in one forward, each row at its own position.

Rows of different lengths share one decode forward through the model's public interface only: the attention mask
``[batch, S + 1]`` (``S`` = the longest row) marks each row's cached columns ``0 .. len - 1`` and the new column
``S``, so ``positions_from_mask`` gives the new token of row ``i`` position ``len_i``; the cache writes that token's
keys/values at column ``len_i`` of the row's slot (its permanent place) and also at column ``S`` (beyond every row's
data, so nothing is overwritten) and hands the model columns ``0 .. S``. Masked columns never contribute, so every
row computes what it would alone, up to floating-point summation order.

Sampling is per row with the request's own ``torch.Generator``, so a seeded request draws the same tokens whatever
its batch-mates (and the same as ``generate_tokens`` with that seed). Detokenization and stop handling
(:class:`~minigpt.infer.stops.StopChecker`) run per request in the worker, so a request stopped by a string frees its
slot at that token. Requests, their events and errors are in :mod:`minigpt.infer.request`. Rows of one forward may
be served by different LoRA adapters over the same base (:mod:`minigpt.infer.adapters`): before each forward the
engine tells the adapted projections which adapter serves each row. Given a compiled FastPath (`minigpt serve
--compile`), up to ``mirror_rows`` running requests decode through the compiled step over a mirror of their slots
(:mod:`minigpt.infer.mirror`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.adapters import AdapterWeights, attach_adapters
from minigpt.infer.fastpath import FastPath
from minigpt.infer.generate import model_device
from minigpt.infer.kv_cache import SlotKVCache
from minigpt.infer.metrics import ServingMetrics
from minigpt.infer.mirror import MirrorDecode
from minigpt.infer.prefill import Prefill
from minigpt.infer.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache
from minigpt.infer.request import (
    EngineClosed,
    Event,
    QueueFull,
    Request,
    choose_tokens,
    free_memory,
    kv_cache_bytes,
    plan_context,
)
from minigpt.infer.sampling import InvalidRequest, LogitsProcessor, SamplingParams, TokenLogprob, check_length
from minigpt.infer.stops import default_stop_ids
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("minigpt.infer.engine")


class Engine(Prefill):
    """A continuous-batching generation engine around one :class:`Transformer` (see the module docstring).

    Args:
        model: the model, in eval mode; its device and dtype are used as they are. A :class:`Transformer` is
            wrapped in an (uncompiled) :class:`~minigpt.infer.fastpath.FastPath`, which fuses its projections in place;
            for the architectures the fast path covers, activations and the cache are float32 whatever the weight
            dtype. A FastPath built with ``compile=True`` (and no ``adapters``) decodes up to ``mirror_rows`` (default 1)
            running requests through its compiled step (:class:`~minigpt.infer.mirror.MirrorDecode`, which
            :meth:`warm_up` compiles for each batch size); more decode in the eager batch.
        tokenizer: decodes text for streaming and stop strings (None: events carry token ids only, ``stop`` is
            ignored).
        max_batch_size: KV-cache slots, i.e. requests decoded together.
        context: tokens per slot (``max_seq_len`` of the engine): at most the model's context; default the model's,
            capped to what ``memory_budget`` holds (:func:`~minigpt.infer.request.plan_context`).
        memory_budget: bytes the KV cache may take (default half the device's free memory).
        max_batch_tokens: the most prompt + ``max_tokens`` tokens the running requests may reserve together
            (default ``max_batch_size * max_seq_len``: no limit beyond the slots).
        max_queue: requests that may wait for a slot; :meth:`submit` raises :class:`QueueFull` beyond.
        max_prefill_tokens: the most (padded) prompt tokens prefilled in one forward between two decode steps
            (default ``max(max_seq_len, 1024)``; a longer single prompt is still prefilled, alone), bounding how
            long running requests wait for new ones.
        stop_ids: token ids that end a generation (default:
            :func:`~minigpt.infer.stops.default_stop_ids` of the tokenizer).
        metrics: where to count; a fresh :class:`ServingMetrics` by default.
        prefix_cache_bytes: the prefix cache's budget (:mod:`minigpt.infer.prefix_cache`); 0 turns it off; default
            half the slots' KV cache, at least one slot's.
        block_size: tokens per prefix-cache block.
        adapters: LoRA adapters served over the model, by name (:func:`~minigpt.checkpoint.adapter.read_adapter`
            reads one); a request picks one with ``submit(..., adapter=name)``, and rows of different adapters
            decode together (:mod:`minigpt.infer.adapters`).

    Memory: ``2 * n_layers * max_batch_size * n_kv_heads * max_seq_len * head_dim`` cache elements
    (:attr:`kv_cache_bytes`). Raises :class:`MiniGPTError` for a bad size, before allocating anything.
    """

    def __init__(self, model: Transformer | FastPath, tokenizer: Optional[Tokenizer] = None, *,
                 max_batch_size: int = 16, context: Optional[int] = None, memory_budget: Optional[int] = None,
                 max_batch_tokens: Optional[int] = None, max_queue: int = 256,
                 max_prefill_tokens: Optional[int] = None, stop_ids: Optional[Sequence[int]] = None,
                 metrics: Optional[ServingMetrics] = None, prefix_cache_bytes: Optional[int] = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, adapters: Optional[dict[str, AdapterWeights]] = None,
                 mirror_rows: int = 1) -> None:
        if max_batch_size < 1:
            raise MiniGPTError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_queue < 0:
            raise MiniGPTError(f"max_queue must be at least 0, got {max_queue}")
        c = model.config
        # The fast path's eager forward computes what the model computes (fp32 logits within 1e-5, tested) with
        # fused projections and a GQA single-query attention; architectures it does not cover run the model itself.
        self.model = FastPath(model) if isinstance(model, Transformer) else model
        self.tokenizer = tokenizer
        self.device = model_device(self.model)
        cache_dtype = self.model.act_dtype if isinstance(self.model, FastPath) else model.tok_embeddings.weight.dtype
        per_token = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, max_batch_size, 1, cache_dtype)
        if memory_budget is None:
            memory_budget = free_memory(self.device) // 2
        self.model_context = c.max_seq_len
        self.max_seq_len = plan_context(c.max_seq_len, per_token, context, memory_budget)
        self.kv_cache_bytes = per_token * self.max_seq_len
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens or max_batch_size * self.max_seq_len
        if self.max_batch_tokens < 2:
            raise MiniGPTError(f"max_batch_tokens must be at least 2, got {self.max_batch_tokens}")
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens or max(self.max_seq_len, 1024)
        self.stop_ids = frozenset(int(i) for i in (default_stop_ids(tokenizer) if stop_ids is None else stop_ids))
        self.pad_id = 0
        self.cache = SlotKVCache(c.n_layers, max_batch_size, c.n_kv_heads, self.max_seq_len, c.head_dim, cache_dtype,
                                 self.device)
        self.metrics = metrics or ServingMetrics()
        self.metrics.slots_total.set(max_batch_size)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = max(self.kv_cache_bytes // 2, self.kv_cache_bytes // max_batch_size)
        if prefix_cache_bytes < 0:
            raise MiniGPTError(f"prefix_cache_bytes must be at least 0, got {prefix_cache_bytes}")
        self.block_size = block_size
        self.prefix = PrefixCache(c.n_layers, c.n_kv_heads, c.head_dim, cache_dtype, self.device, prefix_cache_bytes,
                                  block_size) if prefix_cache_bytes else None
        self.adapter_names = list(adapters or {})  # request.adapter i > 0 is adapter_names[i - 1]
        self.adapters = attach_adapters(self.model, list(adapters.values()), self.device) if adapters else None
        compiled = isinstance(self.model, FastPath) and self.model.compiled and not adapters
        self.mirror = MirrorDecode(self.model, self.cache, self.max_seq_len, mirror_rows) if compiled else None
        self._sources: dict[int, tuple[Request, int]] = {}  # a request admitted with its source (Prefill._admit)
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # index == slot; only the worker touches it
        self._reserved = 0
        self._closed = False
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------------------ public
    def validate(self, prompt_len: int, max_tokens: Optional[int]) -> int:
        """Check a request's size against the context (:func:`~minigpt.infer.sampling.check_length`) and
        ``max_batch_tokens``; returns ``max_tokens`` (None: the rest of the context, within ``max_batch_tokens``).

        Raises :class:`InvalidRequest` naming ``prompt`` or ``max_tokens``.
        """
        _, budget = check_length(prompt_len, max_tokens, self.max_seq_len)
        room = self.max_batch_tokens - prompt_len
        if room < 1:
            raise InvalidRequest(f"the prompt of {prompt_len} tokens leaves no room within max_batch_tokens "
                                 f"{self.max_batch_tokens}", "prompt")
        if max_tokens is None:
            return min(budget, room)
        if max_tokens > room:
            raise InvalidRequest(f"the prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the server's "
                                 f"max_batch_tokens {self.max_batch_tokens}", "max_tokens")
        return max_tokens

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               callback: Optional[Callable[[Event], None]] = None, timeout: Optional[float] = None,
               logits_processors: Sequence[LogitsProcessor] = (), adapter: Optional[str] = None) -> Request:
        """Queue a request. ``callback(event)`` runs on the worker thread after each token (it must be quick and
        must not block); without one, read events with :meth:`events`. ``timeout``: seconds from now until the
        request is finished with ``"timeout"``. ``logits_processors``: the request's own logits hook
        (:class:`~minigpt.infer.request.Request`). Requests submitted one after another (``n`` samples of one
        prompt) are admitted in that order. ``adapter``: the name of the LoRA adapter serving it (None: the base).

        Raises :class:`InvalidRequest` (never runnable, or an unknown adapter: ``param`` "model"),
        :class:`QueueFull` or :class:`EngineClosed`.
        """
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        self.validate(len(prompt), params.max_tokens)
        if adapter is not None and adapter not in self.adapter_names:
            raise InvalidRequest(f"no adapter named {adapter!r}; this engine serves {self.adapter_names}", "model")
        inbox: Optional[queue.SimpleQueue] = None
        if callback is None:
            inbox = queue.SimpleQueue()
            callback = inbox.put
        deadline = time.monotonic() + timeout if timeout is not None else None
        req = Request(prompt, params, callback, deadline, self.tokenizer, self.stop_ids, self.device,
                      logits_processors)
        req.inbox = inbox
        req.adapter = 0 if adapter is None else self.adapter_names.index(adapter) + 1
        with self._cond:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the wait queue is full ({self.max_queue} requests); retry later")
            self._waiting.append(req)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()
        return req

    def events(self, req: Request, timeout: Optional[float] = None) -> Iterator[Event]:
        """Yield the events of a request submitted without a callback until its last one; needs the worker
        (:meth:`start`) or someone calling :meth:`step`. Closing the iterator early cancels the request."""
        inbox = req.inbox
        if inbox is None:
            raise ValueError("this request was submitted with a callback")
        done = False
        try:
            while True:
                ev = inbox.get(timeout=timeout)
                yield ev
                if ev.finished:
                    done = True
                    return
        finally:
            if not done:
                self.cancel(req)

    def generate(self, prompt: Sequence[int], params: SamplingParams, timeout: Optional[float] = None
                 ) -> Iterator[Event]:
        """:meth:`submit` + :meth:`events`: stream one request's events (the worker must be running)."""
        return self.events(self.submit(prompt, params, timeout=timeout))

    def cancel(self, req: Request) -> None:
        """Stop a request: a waiting one leaves the queue now, a running one frees its slot at the next step.
        Idempotent; its last event has ``finish_reason="cancelled"``."""
        with self._cond:
            if req.finished:
                return
            if req in self._waiting:
                self._waiting.remove(req)
                self.metrics.queue_depth.set(len(self._waiting))
                self._finish(req, "cancelled")
                return
            req.cancel_requested = True
            self._cond.notify_all()

    def warm_up(self) -> float:
        """Compile (or load) the compiled decode steps now; returns the seconds spent (0.0: not compiled)."""
        return self.mirror.warm_up() if self.mirror is not None else 0.0

    def start(self) -> "Engine":
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="minigpt-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and not self._running

    def close(self, drain_timeout: float = 0.0) -> None:
        """Shut down: refuse new requests, let queued and running ones finish for up to ``drain_timeout``
        seconds, then cancel the rest (with an error saying so) and stop the worker."""
        with self._cond:
            self._closed = True
            deadline = time.monotonic() + drain_timeout
            while self.alive and (self._waiting or self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            for req in list(self._waiting) + list(self._running):
                self._finish(req, "cancelled", error="the server shut down before this request finished")
            self._waiting.clear()
            self._update_gauges()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive :meth:`step` in the calling thread until nothing is left (tests, offline batch generation)."""
        for _ in range(max_steps):
            if not self.step():
                return

    # ------------------------------------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a bug outside the per-request guards: fail what runs, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                for req in list(self._running):
                    self._finish(req, "error", error=f"internal error: {type(e).__name__}: {e}")

    @torch.inference_mode()
    def step(self) -> bool:
        """One scheduler iteration (see the module docstring); returns False when there was nothing to do."""
        self._reap()
        batch = self._admit()
        if batch:
            self._prefill(batch)
        if self._running:
            self._decode()
        self._update_gauges()
        with self._cond:
            self._cond.notify_all()  # wakes close() waiting for the drain
        return bool(batch or self._running or self._waiting)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self._waiting))
        m.running.set(len(self._running))
        m.slots_used.set(len(self._running))
        m.tokens_reserved.set(self._reserved)
        m.update_prefix_cache(self.prefix)

    def _reap(self) -> None:
        now = time.monotonic()
        for req in list(self._running):
            if req.cancel_requested:
                self._finish(req, "cancelled")
            elif req.deadline is not None and now >= req.deadline:
                self._finish(req, "timeout", error="the request timed out")
        with self._cond:
            expired = [r for r in self._waiting if r.deadline is not None and now >= r.deadline]
            for req in expired:
                self._waiting.remove(req)
                self._finish(req, "timeout", error="the request timed out waiting for a slot")

    def _one_by_one(self, reqs: list[Request], forward) -> tuple[list[Request], Optional[torch.Tensor]]:
        """Run ``forward(i, req)`` for each request alone after a batched forward failed: the requests that raise
        are failed, the others go on. Returns the surviving requests and their logits rows concatenated."""
        rows, ok, failed = [], [], []
        for i, req in enumerate(reqs):
            try:
                rows.append(forward(i, req))
                ok.append(req)
            except Exception as e:
                failed.append((req, e))
        for req, e in failed:  # after the loop: failing a request changes the running batch the offsets index
            self._fail(req, e)
        return ok, (torch.cat(rows) if rows else None)

    def _decode(self) -> None:
        reqs = list(self._running)
        self.metrics.batch_size.observe(len(reqs))
        if self.mirror is not None and self.mirror.fits(reqs):  # few enough: through the compiled step
            try:
                picks = self.mirror.decode(reqs)
            except Exception as e:  # nothing advanced: the eager batch tries again (and fails what fails there)
                log.warning("the compiled step failed for %d rows, decoding them eagerly: %s", len(reqs), e)
            else:
                return self._accept_picks(reqs, picks)
        if self.mirror is not None:  # the eager batch reads the slots
            self.mirror.sync()
        try:
            logits = self._decode_forward(0, reqs)
        except Exception as e:
            if len(reqs) == 1:
                self._fail(reqs[0], e)
                return
            reqs, logits = self._one_by_one(reqs, lambda i, req: self._decode_forward(i, [req]))
            if not reqs:
                return
        self._sample_and_accept(reqs, logits)

    def _decode_forward(self, offset: int, reqs: list[Request]) -> torch.Tensor:
        """Logits ``[len(reqs), vocab]`` of one step for the requests in slots ``offset ..``."""
        x = torch.tensor([[r.pending] for r in reqs], dtype=torch.long, device=self.device)
        lens = torch.tensor([r.length for r in reqs], dtype=torch.long, device=self.device)
        longest = max(r.length for r in reqs)
        self._set_adapters(reqs)
        self.cache.for_decode(offset, lens)
        if len(reqs) == 1:  # alone: exactly the unmasked path of generate_tokens
            logits = self.model(x, longest, self.cache)
        else:
            cols = torch.arange(longest + 1, device=self.device)[None, :]
            mask = (cols < lens[:, None]) | (cols == longest)
            logits = self.model(x, longest, self.cache, mask.long())
        for r in reqs:
            r.length += 1
        return logits[:, -1]

    def _set_adapters(self, reqs: list[Request]) -> None:
        """Tell the LoRA layers which adapter serves each row of the next forward (nothing without adapters)."""
        if self.adapters is not None:
            self.adapters.set_rows([r.adapter for r in reqs])

    def _sample_and_accept(self, reqs: list[Request], logits: torch.Tensor) -> None:
        self._accept_picks(reqs, choose_tokens(reqs, logits))

    def _accept_picks(self, reqs: list[Request], picks: list) -> None:
        done: list[Request] = []
        for req, pick in zip(reqs, picks):
            try:
                if isinstance(pick, Exception):
                    raise pick
                self._accept(req, *pick)
            except Exception as e:
                self._fail(req, e, free=False)
            if req.finished:
                done.append(req)
        for req in done:
            self._free(req)

    def _accept(self, req: Request, token: int, logprob: Optional[TokenLogprob] = None) -> None:
        now = time.monotonic()
        m = self.metrics
        req.n_generated += 1
        req.output_ids.append(token)
        m.generation_tokens.inc()
        if req.first_token_time is None:
            req.first_token_time = now
            m.ttft.observe(now - req.arrival)
        else:
            m.tpot.observe(now - req.last_token_time)
        req.last_token_time = now
        stops = req.stops
        text = stops.push(token)  # a stop id or string sets stops.stopped; a stop id is not part of the completion
        reason = "stop" if stops.stopped else None
        if reason is None and req.n_generated >= req.params.max_tokens:
            text += stops.finish()
            reason = "stop" if stops.stopped else "length"
        if reason is not None:
            req.finish_reason = reason
        event = Event(text, [token] if stops.kept else [], reason, None, len(req.prompt), req.n_generated,
                      [logprob] if logprob is not None else [])  # a stop id's too, as vLLM reports it
        if req.n_generated == 1:
            event.prompt_logprobs = req.prompt_logprobs
        self._emit(req, event)
        if reason is None:
            req.pending = token
        else:
            m.finished.inc(reason=reason)
            m.e2e.observe(time.monotonic() - req.arrival)

    def _emit(self, req: Request, event: Event) -> None:
        try:
            req.callback(event)
        except Exception:  # a consumer's bug must not stop the worker
            log.error("request %d: event callback failed:\n%s", req.id, traceback.format_exc())

    def _fail(self, req: Request, e: BaseException, free: bool = True) -> None:
        log.error("request %d failed:\n%s", req.id, "".join(traceback.format_exception(e)))
        self._finish(req, "error", error=f"{type(e).__name__}: {e}", free=free)

    def _finish(self, req: Request, reason: str, error: Optional[str] = None, free: bool = True) -> None:
        """End a request that did not end by itself (cancelled, timeout, error): last event, slot freed."""
        if req.finished:
            return
        req.finish_reason = reason
        self.metrics.finished.inc(reason=reason)
        self._emit(req, Event("", [], reason, error, len(req.prompt), req.n_generated))
        if free and req.slot is not None:
            self._free(req)

    def _free(self, req: Request) -> None:
        """Give the slot back; the last running request moves into the hole so slots stay ``0 .. n - 1``."""
        if self.mirror is not None:  # before the prefix cache reads the slot or another moves into it
            self.mirror.sync()
        self._remember(req)
        slot = req.slot
        if slot is None:
            return
        last = len(self._running) - 1
        if slot != last:
            mover = self._running[last]
            self.cache.move(last, slot, mover.length)
            self._running[slot] = mover
            mover.slot = slot
        self._running.pop()
        req.slot = None
        self._reserved -= req.reserved
