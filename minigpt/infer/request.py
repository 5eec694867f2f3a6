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
from minigpt.infer.sampling import SamplingParams
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
    ``completion_tokens`` counts generated tokens, a final EOS included.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_ids = itertools.count(1)


class Request:
    """One generation in the engine; returned by :meth:`Engine.submit` as the handle to :meth:`Engine.cancel`.

    ``stops`` detokenizes its tokens and ends it at ``stop_ids`` or ``params.stop`` (no text without a tokenizer).
    """

    def __init__(self, prompt: list[int], params: SamplingParams, callback: Callable[[Event], None],
                 deadline: Optional[float], tokenizer: Optional[Tokenizer], stop_ids: Iterable[int],
                 device: torch.device) -> None:
        self.id = next(_ids)
        self.prompt = prompt
        self.params = params
        self.callback = callback
        self.deadline = deadline  # time.monotonic() seconds, or None
        self.arrival = time.monotonic()
        self.reserved = len(prompt) + params.max_tokens  # KV columns this request may use
        self.slot: Optional[int] = None
        self.length = 0  # tokens in its KV-cache slot
        self.pending: Optional[int] = None  # sampled, not yet in the cache
        self.n_generated = 0
        self.stops = StopChecker(tokenizer, stop_ids, params.stop)
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
