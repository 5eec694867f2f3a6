"""What one generation asks for (:class:`SamplingParams`, validated once), whether it fits the context
(:func:`check_length`), how the logits are adjusted before a token is drawn (:func:`process_logits`), how a token
is drawn (:func:`sample`, :func:`sampling_probs`) and its log-probabilities (:func:`token_logprobs`,
:func:`prompt_logprobs`).

The order, as in vLLM's sampler: the model's logits get the penalties and ``logit_bias``
(:func:`process_logits`), then a request's own logits processors (the engine's hook, e.g. a grammar mask), then
the temperature, ``min_p``, ``top_k`` and ``top_p`` (:func:`sampling_probs`) before the draw.

Sampling follows the usual recipe: divide logits by the temperature, keep the tokens at least ``min_p`` times as
likely as the most likely one (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent
LLM Outputs"; after the temperature, as vLLM and transformers' ``MinPLogitsWarper`` do), keep the ``top_k`` most
likely tokens (Fan et al. 2018, "Hierarchical Neural Story Generation"), then the smallest set whose probability
reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"), and
draw from what remains. Temperature 0 means greedy (argmax of the adjusted logits), and so does any temperature
below :data:`MIN_TEMPERATURE` (vLLM's ``_SAMPLING_EPS`` rule): dividing float32 logits by 1e-40 overflows to
``inf`` and the softmax to NaN. All of it stays on the logits' device.

Log-probabilities are those of the model's own distribution, ``log_softmax`` of the raw logits: before penalties,
bias, processors and temperature. That is vLLM's default (``logprobs_mode="raw_logprobs"``), what scoring a text
needs (lm-evaluation-harness reads them as the model's log-likelihood), and the same whatever the sampling
settings; OpenAI's reference does not say which distribution it reports.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from minigpt.errors import MiniGPTError

# Temperatures below this sample greedily: logits / 1e-5 stay finite for any logit below ~3e33 in float32.
MIN_TEMPERATURE = 1e-5
# Most alternatives a token's log-probabilities list (OpenAI's chat limit for top_logprobs; vLLM's default cap).
MAX_LOGPROBS = 20
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class InvalidRequest(MiniGPTError, ValueError):
    """A generation that can never run (bad parameters, too long for the context); ``param`` names the offending
    field (``"prompt"``, ``"max_tokens"``, ``"temperature"``, ...)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _in_range(x, low: float, high: float) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and low <= x <= high


@dataclass(frozen=True)
class SamplingParams:
    """How one generation samples and when it ends.

    ``max_tokens``: new tokens at most (0 only as a placeholder to fill in, e.g. by the server once the prompt
    length is known; generating needs at least 1). ``temperature`` 0 (or below :data:`MIN_TEMPERATURE`) is
    greedy; ``top_k`` None/0 and ``top_p``
    None/1 are off; ``stop`` strings end the generation and are not returned (a list is stored as a tuple);
    ``seed`` makes sampling reproducible (None: a fresh seed or the global generator).

    Logits adjustments (:func:`process_logits`; 0, 1 and empty are off): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] (OpenAI's range), ``repetition_penalty`` in [0.01, 100], ``logit_bias`` token id -> value
    in [-100, 100] (a mapping, stored as sorted ``(id, value)`` pairs); ``min_p`` in [0, 1] (after the temperature,
    see the module docstring). ``stop_token_ids``: more token ids that end the generation (vLLM's extension; the
    engine's own stop ids still apply). ``logprobs``: log-probabilities of each generated token with that many
    most likely alternatives (0 to :data:`MAX_LOGPROBS`; None: none); ``prompt_logprobs``: the same for every
    prompt token (the first one has none).

    Raises :class:`InvalidRequest` (a ``ValueError``) naming the field when a value is out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    stop: tuple[str, ...] = ()
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in_range(getattr(self, name), -2, 2):
                raise InvalidRequest(f"{name} must be a number in [-2, 2], got {getattr(self, name)!r}", name)
        r = self.repetition_penalty
        # Bounded so that logits * r and logits / r stay finite in float32 (a 0 logit times inf would be NaN).
        if not _in_range(r, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
            raise InvalidRequest(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, "
                                 f"{MAX_REPETITION_PENALTY}] (1: off), got {r!r}", "repetition_penalty")
        if not _in_range(self.min_p, 0, 1):
            raise InvalidRequest(f"min_p must be a number in [0, 1] (0: off), got {self.min_p!r}", "min_p")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple(sorted((k, v) for k, v in bias))
        if any(not _is_int(k) or k < 0 or not _in_range(v, -100, 100) for k, v in bias):
            raise InvalidRequest("logit_bias must map token ids >= 0 to numbers in [-100, 100]", "logit_bias")
        object.__setattr__(self, "logit_bias", tuple((k, float(v)) for k, v in bias))
        ids = tuple(self.stop_token_ids)
        if any(not _is_int(i) or i < 0 for i in ids):
            raise InvalidRequest(f"stop_token_ids must be token ids >= 0, got {list(ids)!r}", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """True when :func:`process_logits` changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def check_token_ids(prompt: Sequence[int], vocab_size: int) -> None:
    """Raise :class:`InvalidRequest` (``param`` ``"prompt"``) when an id of ``prompt`` has no row in a model
    embedding of ``vocab_size`` rows, as happens when the tokenizer has more ids than the model (they do not belong
    together); the forward would fail with an index error deep inside the model."""
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"the prompt holds token id {bad}, outside the model's vocabulary of {vocab_size} ids: "
                             "is the tokenizer the model's own?", "prompt")


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
                                 "tokens, which must also hold at least one generated token"
                                 + (f"; {hint}" if hint else ""), "prompt")
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
    """The distribution :func:`sample` draws from: float32 ``[..., vocab_size]`` after the temperature, min-p, top-k
    and top-p filters; a one-hot at the argmax for greedy ``params``. Never NaN for finite logits. Speculative decoding
    needs it explicitly for both models."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.size(-1)).float()
    top_k, top_p = params.top_k, params.top_p
    logits = logits.float() / params.temperature
    if params.min_p > 0:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        floor = logits.max(dim=-1, keepdim=True).values + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
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


# A request's own logits hook (e.g. a grammar's mask): ``(generated_ids, logits [vocab_size]) -> logits
# [vocab_size]``, called before the temperature and filters; it may change ``logits`` in place or return a new one.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


def _rows_of_ids(ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Token counts ``[len(ids), vocab_size]`` (float32): how often each id occurs in each row's list."""
    counts = torch.zeros(len(ids), vocab_size, device=device)
    for i, row in enumerate(ids):
        if row:
            t = torch.tensor(row, dtype=torch.long, device=device)
            counts[i].index_add_(0, t, torch.ones(len(row), device=device))
    return counts


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                   outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Apply each row's penalties and ``logit_bias`` to ``logits`` ``[batch, vocab_size]``; row ``i`` belongs to
    the request with ``params[i]``, prompt ``prompts[i]`` and generated tokens so far ``outputs[i]``. Returns the
    logits unchanged (the same tensor) when no row asks for anything, else a new float32 tensor. In this order,
    as vLLM applies them:

    * ``repetition_penalty`` ``r`` (Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model for
      Controllable Generation", sec. 4.1; vLLM's and transformers' form): for every token seen in the prompt or the
      output, ``logit / r`` where the logit is positive and ``logit * r`` where it is not, so ``r > 1`` always
      makes a repeated token less likely.
    * ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI's API reference, "Frequency and presence
      penalties"): ``logit[j] -= c[j] * f + (c[j] > 0) * p`` with ``c[j]`` the count of token ``j`` in the output
      only (not the prompt). Negative values encourage repetition.
    * ``logit_bias``: the value is added to the token's logit (OpenAI: -100 to 100; +-100 in effect bans or forces
      the token). Ids beyond the vocabulary are ignored.
    """
    if not any(p.adjusts_logits for p in params):
        return logits
    batch, vocab = logits.shape
    device = logits.device
    logits = logits.float().clone()

    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(p, name)) for p in params], device=device)[:, None]

    rep = column("repetition_penalty")
    if bool((rep != 1).any()):
        seen = _rows_of_ids([list(a) + list(b) for a, b in zip(prompts, outputs)], vocab, device) > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    freq, pres = column("frequency_penalty"), column("presence_penalty")
    if bool((freq != 0).any() or (pres != 0).any()):
        counts = _rows_of_ids(outputs, vocab, device)
        logits = logits - counts * freq - (counts > 0).float() * pres
    for i, p in enumerate(params):
        pairs = [(k, v) for k, v in p.logit_bias if k < vocab]
        if pairs:
            ids = torch.tensor([k for k, _ in pairs], device=device)
            logits[i, ids] += torch.tensor([v for _, v in pairs], device=device)
    return logits


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model (natural log) and the ``top`` most likely tokens at its
    position as ``(token_id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """:class:`TokenLogprob` of ``tokens[i]`` under ``log_softmax(logits[i])`` with ``top[i]`` alternatives, for
    ``logits`` ``[n, vocab_size]`` (raw model logits; computed in float32, one host transfer)."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(list(tokens), device=logp.device)[:, None])[:, 0].tolist()
    k = min(max(top), logp.size(-1))
    values, ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(int(t), chosen[i], tuple(zip(ids[i][:top[i]], values[i][:top[i]])))
            for i, t in enumerate(tokens)]


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], top: int) -> list[Optional[TokenLogprob]]:
    """Log-probabilities of every prompt token given the ones before it: ``logits`` ``[len(prompt), vocab_size]``
    are the model's outputs at the prompt's positions (row ``t`` predicts token ``t + 1``). The first token has
    nothing before it: None, as in OpenAI's ``echo`` answers and vLLM's ``prompt_logprobs``."""
    n = len(prompt)
    return [None] + token_logprobs(logits[:n - 1], prompt[1:], [top] * (n - 1))
