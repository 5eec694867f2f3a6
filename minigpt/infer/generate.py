"""Autoregressive generation: one prefill pass over the prompt, then one token per step through the KV cache.

What to generate is a :class:`~minigpt.infer.sampling.SamplingParams` (how tokens are drawn is in
:mod:`minigpt.infer.sampling`, where generation stops in :mod:`minigpt.infer.stops`). All of it stays on the model's
device.

``model`` is a :class:`~minigpt.model.transformer.Transformer` or its inference wrapper
:class:`~minigpt.infer.fastpath.FastPath` (fused projections, optional compiled decode step); both compute the same
logits. :func:`generate_batch` decodes several prompts of different lengths together (left padding, per-row
positions, per-row stopping); speculative decoding lives in :mod:`minigpt.infer.speculative`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.kv_cache import grown_cache
from minigpt.infer.sampling import (
    InvalidRequest,
    SamplingParams,
    check_length,
    check_token_ids,
    process_logits,
    sample,
)
from minigpt.infer.stops import StopChecker
from minigpt.model.transformer import Transformer


@torch.inference_mode()
def generate_tokens(
    model: Transformer,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    stop_ids: Sequence[int] = (),
    truncate: bool = False,
    cache=None,
    cached: int = 0,
    grow_cache: bool = False,
) -> Iterator[int]:
    """Yield up to ``params.max_tokens`` new token ids for one prompt, sampled with ``params`` (penalties, bias,
    temperature, min-p, top-k, top-p, seed), stopping after any id in ``stop_ids`` or ``params.stop_token_ids``
    (the stop id itself is not yielded). Stop strings
    (``params.stop``) need text: a caller that decodes applies them with :class:`~minigpt.infer.stops.StopChecker`.

    The prompt is prefilled in a single forward pass (a one-token prompt under plain greedy decoding: one decode
    step); each further token costs one cached forward of length 1.
    Raises :class:`~minigpt.infer.sampling.InvalidRequest` if the prompt plus ``max_tokens`` exceeds
    ``max_seq_len`` (unless ``truncate``, which drops the oldest prompt tokens; see
    :func:`~minigpt.infer.sampling.check_length`) or holds an id outside the vocabulary
    (:func:`~minigpt.infer.sampling.check_token_ids`).

    Per step the only host synchronisation is reading the sampled token (to yield it and test ``stop_ids``).
    Plain greedy decoding (temperature 0, nothing adjusting the logits) of a
    :class:`~minigpt.infer.fastpath.FastPath` takes its tokens from
    :meth:`~minigpt.infer.fastpath.FastPath.decode_next`.

    ``cache``: a cache of batch 1 to use (and leave filled) instead of a new one, long enough for the prompt plus
    ``max_tokens``; its first ``cached`` columns hold the keys and values of ``prompt[:cached]`` already (a
    conversation's earlier turns, :class:`~minigpt.infer.conversation.Conversation`), so only the rest is
    prefilled. ``cached`` must leave at least one prompt token to run and does not combine with a truncated prompt.
    ``grow_cache``: that cache may be shorter and grows in place as the positions fill it (up to the prompt plus
    ``max_tokens``), as a cache made here does where the model's step serves every length
    (:func:`grown_cache_for`).
    """
    device = model_device(model)
    max_tokens = params.max_tokens
    drop, _ = check_length(len(prompt), max_tokens, model.config.max_seq_len, truncate=truncate)
    check_token_ids(prompt, model.config.vocab_size)
    if not 0 <= cached < len(prompt) - drop or (cached and drop):
        raise ValueError(f"cached={cached} must be below the prompt's {len(prompt) - drop} tokens, without truncation")
    prompt = list(prompt)[drop:]
    generator = make_generator(params.seed, device)
    total = len(prompt) + max_tokens
    # A step that serves every cache length attends to all the columns it is given, under a mask: a cache that
    # starts at the prompt and grows (grown_cache_for) gives it fewer to read (135M int4, 128 tokens: 1.06x).
    grow = (cache is None or grow_cache) and getattr(model, "any_cache_length", False)
    if cache is None:
        cache = model.new_kv_cache(1, min(total, len(prompt) + 1) if grow else total)
    x = torch.tensor([prompt[cached:]], dtype=torch.long, device=device)
    stop = set(stop_ids) | set(params.stop_token_ids)
    pos = len(prompt)
    out: list[int] = []  # for the penalties (process_logits: the same tensor back when none is asked)
    # Plain greedy needs the argmax only, which FastPath.decode_next finds without the full logits.
    argmax_only = params.greedy and not params.adjusts_logits and hasattr(model, "decode_next")
    if argmax_only and len(prompt) - cached == 1:
        # One token is a decode step: the compiled one where there is one (135M bf16, 2 threads: 11 ms, against
        # 22 ms for the eager forward of a 1-token prefill).
        token = model.decode_next(x, cached, cache)
    else:
        logits = prefill(model, x, cache, start_pos=cached)
        token = sample(process_logits(logits, [params], [prompt], [out]), params, generator)
    for i in range(max_tokens):
        t = int(token.item())
        if t in stop:
            return
        out.append(t)
        yield t
        if i + 1 < max_tokens:
            if grow and pos + 1 > cache.max_seq_len:
                cache.adopt(grown_cache_for(model, cache, pos, total))  # in place: a caller's cache grows too
            if argmax_only:
                token = model.decode_next(token.view(1, 1), pos, cache)
            else:
                logits = decode_step(model, token.view(1, 1), pos, cache)
                token = sample(process_logits(logits, [params], [prompt], [out]), params, generator)
            pos += 1


def grown_cache_for(model, cache, pos: int, total: int):
    """A longer cache of batch 1 for the step at column ``pos`` of a generation of ``total`` columns, holding
    ``cache``'s first ``pos`` columns: :func:`~minigpt.infer.kv_cache.fitted_length` ``(pos + 1)`` columns (64 or
    a quarter more), at most ``total``; all of ``total`` once the model's step no longer serves every length
    (``any_cache_length``: a fallback step compiled for one length would compile again for each).

    Why: the compiled step's attention reads every column of its cache (scores, softmax and values over the
    masked tail too): SmolLM-135M int4 on 2 Zen 4 cores, 3.4 ms a step with 64 columns against 3.9 with 192 and
    4.8 with 512 (docs/benchmarks.md). Growing as the positions fill it halves the columns a 128-token answer
    reads; the copies cost one pass over the used columns per growth."""
    fitted = getattr(model, "any_cache_length", False)
    return grown_cache(model, cache, pos + 1 if fitted else total, total, pos, fitted=fitted)


def model_device(model) -> torch.device:
    """The device of a :class:`Transformer` or :class:`~minigpt.infer.fastpath.FastPath`."""
    return model.device if hasattr(model, "decode_step") else model.tok_embeddings.weight.device


def make_generator(seed: Optional[int], device: torch.device) -> Optional[torch.Generator]:
    """A seeded private generator (None: the global one)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def prefill(model, tokens: torch.Tensor, cache, attention_mask: Optional[torch.Tensor] = None,
            start_pos: int = 0) -> torch.Tensor:
    """Run the prompt ``tokens`` ``[batch, seq_len]`` from position ``start_pos`` (the cache holding the columns
    before it) and return the next-token logits ``[batch, vocab]``; the fast path computes the LM head for the last
    position only."""
    if hasattr(model, "decode_step"):
        return model(tokens, start_pos, cache, attention_mask, last_only=True)[:, -1]
    return model(tokens, start_pos, cache, attention_mask)[:, -1]


def decode_step(model, token: torch.Tensor, pos: int, cache, attention_mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits ``[batch, vocab]`` after feeding ``token`` ``[batch, 1]`` at cache column ``pos``.

    Padding: ``attention_mask`` ``[batch, pos + 1]`` and ``positions`` ``[batch, 1]`` (eager paths), or ``pad``
    ``[batch]`` left-padding columns per row (the compiled step); see :meth:`FastPath.decode_step`."""
    if hasattr(model, "decode_step"):
        return model.decode_step(token, pos, cache, attention_mask, positions, pad)
    return model(token, pos, cache, attention_mask)[:, -1]


def decode_tokens(model, tokens: torch.Tensor, pos: int, cache) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` after feeding ``tokens`` ``[batch, seq]`` (a few, e.g. the k + 1 tokens of a
    speculative verify) at cache columns ``pos ..``; a compiled fast path runs them through its compiled step (see
    :meth:`FastPath.decode_tokens`), other models through their forward."""
    if hasattr(model, "decode_tokens"):
        return model.decode_tokens(tokens, pos, cache)
    return model(tokens, pos, cache)


@dataclass
class Completion:
    """One row of :func:`generate_batch`: the generated ``tokens`` (a stop id excluded; the token completing a stop
    string included), ``finish_reason`` ``"stop"`` (stop id or stop string) or ``"length"``, and, when a
    tokenizer was given, the decoded ``text`` cut before the stop string."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    text: Optional[str] = None


@torch.inference_mode()
def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    row_max_tokens: Optional[Sequence[int]] = None,
    stop_ids: Sequence[int] = (),
    tokenizer=None,
    truncate: bool = False,
    pad_id: int = 0,
    on_token: Optional[Callable[[int, int], None]] = None,
) -> list[Completion]:
    """Generate for several prompts of different lengths in one batch, all sampled with ``params``; returns one
    :class:`Completion` per prompt.

    The prompts are left-padded to the longest (with ``pad_id``, never attended to) and described by an attention
    mask, so every row is computed exactly as if it were alone: its positions count from its first real token
    (:func:`minigpt.model.transformer.positions_from_mask`) and no query sees a padding key. Each row stops
    independently at a token in ``stop_ids``, at a stop string of ``params.stop`` (needs ``tokenizer``), or after
    ``params.max_tokens`` tokens (``row_max_tokens``: one budget per row instead); the batch ends when every row has.
    Finished rows keep riding along until then (their results are frozen). Greedy output equals
    :func:`generate_tokens` of each prompt alone.

    ``on_token(row, token)`` is called for every token a row keeps, in order (for streaming). Per step the only
    host synchronisation is reading the ``batch`` sampled tokens. Raises :class:`MiniGPTError` for an empty list,
    an empty prompt, a prompt that does not fit (unless ``truncate``) or one with an id outside the vocabulary.
    """
    n = len(prompts)
    if n == 0:
        raise MiniGPTError("generate_batch needs at least one prompt")
    budgets = [params.max_tokens] * n if row_max_tokens is None else list(row_max_tokens)
    if len(budgets) != n:
        raise MiniGPTError(f"row_max_tokens has {len(budgets)} entries for {n} prompts")
    if params.stop and tokenizer is None:
        raise MiniGPTError("stop strings need a tokenizer to decode the generated text")
    max_seq_len = model.config.max_seq_len
    # Each row alone first (the clearer message), then side by side: the cache holds longest + most columns.
    rows = [list(p)[check_length(len(p), b, max_seq_len, truncate=truncate)[0]:]
            for p, b in zip(prompts, budgets)]
    for p in prompts:
        check_token_ids(p, model.config.vocab_size)
    device = model_device(model)
    longest, most = max(map(len, rows)), max(budgets)
    if longest + most > max_seq_len:  # rows fit alone but not side by side: drop the oldest tokens of long rows
        if not truncate:
            raise InvalidRequest(f"the longest prompt ({longest} tokens) + the largest max_tokens ({most}) exceed "
                                 f"the model's context of {max_seq_len} tokens; generate them separately or pass "
                                 "truncate=True", "prompt")
        rows = [r[check_length(len(r), most, max_seq_len, truncate=True)[0]:] for r in rows]
        longest = max(map(len, rows))
    pad_counts = [longest - len(r) for r in rows]
    padded = any(pad_counts)
    tokens = torch.tensor([[pad_id] * c + r for c, r in zip(pad_counts, rows)], dtype=torch.long, device=device)
    pad = torch.tensor(pad_counts, dtype=torch.long, device=device)
    total = longest + most
    mask = torch.ones(n, total, dtype=torch.long, device=device)
    for i, c in enumerate(pad_counts):
        mask[i, :c] = 0
    generator = make_generator(params.seed, device)
    cache = model.new_kv_cache(n, total)

    results = [Completion() for _ in range(n)]
    stops = [StopChecker(tokenizer, stop_ids, params.stop) for _ in range(n)]
    active = [True] * n
    logits = prefill(model, tokens, cache, mask[:, :longest] if padded else None)
    for step in range(most):
        token = sample(logits, params, generator)
        for i, t in enumerate(token.tolist()):  # the one host sync of the step
            if not active[i]:
                continue
            stops[i].push(t)
            if stops[i].kept:
                results[i].tokens.append(t)
                if on_token is not None:
                    on_token(i, t)
            if stops[i].stopped:
                results[i].finish_reason, active[i] = "stop", False
            elif len(results[i].tokens) >= budgets[i]:
                stops[i].finish()
                results[i].finish_reason = "stop" if stops[i].stopped else "length"
                active[i] = False
        if not any(active):
            break
        pos = longest + step
        if padded:
            logits = decode_step(model, token.view(n, 1), pos, cache, mask[:, :pos + 1], (pos - pad)[:, None], pad)
        else:
            logits = decode_step(model, token.view(n, 1), pos, cache)
    if tokenizer is not None:
        for r, stop in zip(results, stops):
            r.text = stop.text
    return results
