"""One request of the serving engine (:mod:`minigpt.infer.engine`): its state, the events its consumer receives,
and the errors :meth:`~minigpt.infer.engine.Engine.submit` raises besides
:class:`~minigpt.infer.sampling.InvalidRequest`; and how long a context the engine's KV cache can afford
(:func:`plan_context`), decided before anything is allocated."""
from __future__ import annotations

import itertools
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.sampling import (
    LogitsProcessor,
    SamplingParams,
    TokenLogprob,
    process_logits,
    prompt_logprobs,
    sample,
    token_logprobs,
)
from minigpt.infer.stops import StopChecker
from minigpt.tokenizer.tokenizer import Tokenizer


class QueueFull(MiniGPTError):
    """The wait queue holds ``max_queue`` requests already (HTTP 429)."""


class EngineClosed(MiniGPTError):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, slots: int, context: int,
                   dtype: torch.dtype) -> int:
    """Bytes of a KV cache: keys and values ``[n_layers, slots, n_kv_heads, context, head_dim]`` of ``dtype``."""
    return 2 * n_layers * slots * n_kv_heads * context * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device: torch.device) -> int:
    """Bytes that ``device`` can still allocate: CUDA's free memory, else the host's ``MemAvailable`` (Linux), else
    its free physical pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_context(model_context: int, bytes_per_token: int, context: Optional[int] = None,
                 budget: Optional[int] = None) -> int:
    """The context (tokens per KV-cache slot) an engine allocates, checked before any allocation.

    ``model_context``: what the model's config claims; ``bytes_per_token``: cache bytes of one token in every slot;
    ``context``: asked for (``--context``), else the model's, capped to what ``budget`` bytes hold.
    Raises :class:`MiniGPTError` for a context below 2 or above the model's, or when the asked one (or even 2
    tokens) does not fit ``budget``.
    """
    def size(n: int) -> str:
        return f"{n * bytes_per_token / 2**20:,.1f} MiB"

    if context is not None:
        if isinstance(context, bool) or not isinstance(context, int) or context < 2:
            raise MiniGPTError(f"--context must be an integer of at least 2 tokens, got {context!r}")
        if context > model_context:
            raise MiniGPTError(f"--context {context} exceeds the model's context of {model_context} tokens")
        if budget is not None and context * bytes_per_token > budget:
            raise MiniGPTError(f"a KV cache of {context} tokens per slot needs {size(context)}, more than the "
                               f"{budget / 2**20:,.1f} MiB budget; lower --context or --max-batch-size")
        return context
    fits = model_context if budget is None else budget // bytes_per_token
    if fits < 2:
        raise MiniGPTError(f"the KV cache does not fit in {budget / 2**20:,.1f} MiB even at 2 tokens per slot "
                           f"({size(2)}); lower --max-batch-size")
    return min(model_context, fits)


@dataclass
class Event:
    """What a request's consumer receives after each generated token.

    ``text``: the new text that became final (may be ``""``: half a UTF-8 character, or text held back because it
    could be the start of a stop string). The last event has ``finish_reason``: ``"stop"`` (EOS or a stop string),
    ``"length"`` (``max_tokens``), ``"cancelled"``, ``"timeout"`` or ``"error"`` (then ``error`` says why).
    ``completion_tokens`` counts generated tokens, a final EOS included. With ``params.logprobs`` set,
    ``logprobs`` holds the :class:`~minigpt.infer.sampling.TokenLogprob` of the sampled token, also of a stop id
    that ``token_ids`` leaves out (as vLLM reports it: lm-evaluation-harness drops the last entry); with
    ``params.prompt_logprobs`` set, the request's first event carries ``prompt_logprobs`` (one per prompt token,
    None for the first).
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_ids = itertools.count(1)


class Request:
    """One generation in the engine; returned by :meth:`Engine.submit` as the handle to :meth:`Engine.cancel`.

    ``stops`` detokenizes its tokens and ends it at ``stop_ids``, ``params.stop_token_ids`` or ``params.stop`` (no
    text without a tokenizer). ``output_ids``: every token sampled so far (stop ids included).

    ``logits_processors``: the request's own hook, callables ``(output_ids, logits [vocab_size]) -> logits`` run in
    order on its row of logits after the penalties and ``logit_bias`` and before the temperature and filters
    (:data:`~minigpt.infer.sampling.LogitsProcessor`); e.g. a grammar masking tokens with ``-inf``. One that
    raises fails this request only. ``prompt_logprobs``: filled at prefill when ``params.prompt_logprobs`` is set.
    """

    def __init__(self, prompt: list[int], params: SamplingParams, callback: Callable[[Event], None],
                 deadline: Optional[float], tokenizer: Optional[Tokenizer], stop_ids: Iterable[int],
                 device: torch.device, logits_processors: Iterable[LogitsProcessor] = ()) -> None:
        self.id = next(_ids)
        self.prompt = prompt
        self.params = params
        self.callback = callback
        self.deadline = deadline  # time.monotonic() seconds, or None
        self.arrival = time.monotonic()
        self.reserved = len(prompt) + params.max_tokens  # KV columns this request may use
        self.slot: Optional[int] = None
        self.length = 0  # tokens in its KV-cache slot
        self.cached = 0  # leading prompt tokens copied into the slot (prefix cache or a sibling), not prefilled
        self.block_keys: list[int] = []  # prefix-cache keys of its full prompt blocks (minigpt.infer.prefix_cache)
        self.adapter = 0  # the LoRA adapter serving it: an index into the engine's adapters, 0 = the base model
        self.pending: Optional[int] = None  # sampled, not yet in the cache
        self.n_generated = 0
        self.output_ids: list[int] = []
        self.logits_processors: list[LogitsProcessor] = list(logits_processors)
        self.prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
        self.stops = StopChecker(tokenizer, set(stop_ids) | set(params.stop_token_ids), params.stop)
        self.inbox: Optional[queue.SimpleQueue] = None  # where events go when submitted without a callback
        self.cancel_requested = False
        self.finish_reason: Optional[str] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.generator: Optional[torch.Generator] = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()  # a fresh nondeterministic seed per request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def choose_tokens(reqs: list[Request], logits: torch.Tensor) -> list[tuple[int, Optional[TokenLogprob]] | Exception]:
    """Each request's next token from its row of ``logits`` ``[len(reqs), vocab_size]``: penalties and bias
    (:func:`~minigpt.infer.sampling.process_logits`), the request's ``logits_processors``, then greedy or
    :func:`~minigpt.infer.sampling.sample` with its own generator (so a seeded request draws the same tokens
    whatever its batch-mates). Returns per request ``(token, TokenLogprob or None)`` from the raw logits, or the
    exception that request's processing raised."""
    raw = logits
    try:
        logits = process_logits(logits, [r.params for r in reqs], [r.prompt for r in reqs],
                                [r.output_ids for r in reqs])
    except Exception as e:  # a bug in the shared part fails the batch's rows, never the worker
        return [e] * len(reqs)
    greedy = logits.argmax(dim=-1).tolist() if any(r.params.greedy for r in reqs) else None  # one host sync
    picks: list = []
    for i, req in enumerate(reqs):
        try:
            row = logits[i]
            if req.logits_processors:
                row = row.float().clone() if logits is raw else row  # a processor may write in place
                for proc in req.logits_processors:
                    row = proc(req.output_ids, row)
                if req.params.greedy:
                    greedy[i] = int(row.argmax())
            if req.params.greedy:
                token = greedy[i]
            else:
                token = int(sample(row[None], req.params, req.generator)[0])
            picks.append(token)
        except Exception as e:
            picks.append(e)
    wanted = [i for i, (r, t) in enumerate(zip(reqs, picks)) if r.params.logprobs is not None
              and not isinstance(t, Exception)]
    scored = token_logprobs(raw[wanted], [picks[i] for i in wanted], [reqs[i].params.logprobs for i in wanted])
    found = dict(zip(wanted, scored))
    return [t if isinstance(t, Exception) else (t, found.get(i)) for i, t in enumerate(picks)]


def fill_prompt_logprobs(reqs: list[Request], logits: torch.Tensor, lens: list[int]) -> None:
    """Set ``prompt_logprobs`` of the requests that ask for them from the prefill's logits
    ``[len(reqs), longest, vocab_size]`` (row ``i`` holds ``lens[i]`` real positions)."""
    for i, req in enumerate(reqs):
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs(logits[i, :lens[i]], req.prompt, req.params.prompt_logprobs)
