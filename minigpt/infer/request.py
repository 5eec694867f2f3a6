"""One request of the serving engine (:mod:`minigpt.infer.engine`): its state, the events its consumer receives,
and the errors :meth:`~minigpt.infer.engine.Engine.submit` raises besides
:class:`~minigpt.infer.sampling.InvalidRequest`."""
from __future__ import annotations

import itertools
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
