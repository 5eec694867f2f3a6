"""What one generation asks for (:class:`SamplingParams`, validated once), whether it fits the context
(:func:`check_length`), and how a token is drawn (:func:`sample`, :func:`sampling_probs`).

Sampling follows the usual recipe: divide logits by the temperature, keep the ``top_k`` most likely tokens (Fan et
al. 2018, "Hierarchical Neural Story Generation"), then the smallest set whose probability reaches ``top_p``
(nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"), and draw from what
remains. Temperature 0 means greedy (argmax), and so does any temperature below :data:`MIN_TEMPERATURE` (vLLM's
``_SAMPLING_EPS`` rule): dividing float32 logits by 1e-40 overflows to ``inf`` and the softmax to NaN. All of it
stays on the logits' device.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from minigpt.errors import MiniGPTError

# Temperatures below this sample greedily: logits / 1e-5 stay finite for any logit below ~3e33 in float32.
MIN_TEMPERATURE = 1e-5


class InvalidRequest(MiniGPTError, ValueError):
    """A generation that can never run (bad parameters, too long for the context); ``param`` names the offending
    field (``"prompt"``, ``"max_tokens"``, ``"temperature"``, ...)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one generation samples and when it ends.

    ``max_tokens``: new tokens at most (0 only as a placeholder to fill in, e.g. by the server once the prompt
    length is known; generating needs at least 1). ``temperature`` 0 (or below :data:`MIN_TEMPERATURE`) is
    greedy; ``top_k`` None/0 and ``top_p``
    None/1 are off; ``stop`` strings end the generation and are not returned (a list is stored as a tuple);
    ``seed`` makes sampling reproducible (None: a fresh seed or the global generator).

    Raises :class:`InvalidRequest` (a ``ValueError``) naming the field when a value is out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    stop: tuple[str, ...] = ()
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}", "max_tokens")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}", "temperature")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 or None: off), got {self.top_k!r}", "top_k")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise InvalidRequest(f"top_p must be a number in (0, 1] (1 or None: off), got {p!r}", "top_p")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequest(f"stop must be non-empty strings, got {stop!r}", "stop")
        object.__setattr__(self, "stop", stop)  # frozen: the one normalisation, done here
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def check_length(prompt_len: int, max_tokens: Optional[int], max_seq_len: int, *, truncate: bool = False,
                 name: str = "max_tokens", hint: str = "") -> tuple[int, int]:
    """Fit a prompt of ``prompt_len`` tokens and up to ``max_tokens`` new ones into a context of ``max_seq_len``.

    Returns ``(drop, max_tokens)``: how many of the oldest prompt tokens to drop (0 unless ``truncate``) and the
    budget (``max_tokens``, or the rest of the context when it is None). ``name`` is how messages call the budget
    and ``hint`` what the too-long message suggests (the command line names its flags).

    Raises :class:`InvalidRequest` (``param`` ``"prompt"`` or ``"max_tokens"``) for an empty prompt, a budget below
    1 or not below ``max_seq_len``, or ``prompt_len + max_tokens > max_seq_len`` without ``truncate``.
    """
    if prompt_len < 1:
        raise InvalidRequest("the prompt is empty: give at least one token", "prompt")
    if max_tokens is None:
        if prompt_len >= max_seq_len:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens but the model's context is {max_seq_len} "
                                 "tokens, which must also hold at least one generated token", "prompt")
        return 0, max_seq_len - prompt_len
    if max_tokens < 1:
        raise InvalidRequest(f"{name} must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens >= max_seq_len:
        raise InvalidRequest(f"{name} ({max_tokens}) must be below the model's context of {max_seq_len} tokens",
                             "max_tokens")
    excess = prompt_len + max_tokens - max_seq_len
    if excess > 0 and not truncate:
        raise InvalidRequest(f"the prompt of {prompt_len} tokens + {name} {max_tokens} exceeds the model's context "
                             f"of {max_seq_len} tokens" + (f"; {hint}" if hint else ""),
                             "prompt" if prompt_len >= max_seq_len else "max_tokens")
    return max(0, excess), max_tokens


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
           ) -> torch.Tensor:
    """Draw one token per row from ``logits`` ``[batch, vocab_size]`` with ``params`` (temperature, top-k, top-p);
    returns token ids ``[batch]`` (int64). ``generator``: None draws from torch's global generator."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample` draws from: float32 ``[..., vocab_size]`` after the temperature, top-k and
    top-p filters; a one-hot at the argmax for greedy ``params``. Never NaN for finite logits. Speculative decoding
    needs it explicitly for both models."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.size(-1)).float()
    top_k, top_p = params.top_k, params.top_p
    logits = logits.float() / params.temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the most likely token always stays, also
        # when top_p underflows to 0 in float32 (5e-324) and the test alone would drop every token.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)
