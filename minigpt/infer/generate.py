"""Autoregressive generation: one prefill pass over the prompt, then one token per step through the KV cache.

Sampling follows the usual recipe: divide logits by the temperature, keep the ``top_k`` most likely tokens (Fan et
al. 2018), then the smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020), and
draw from what remains. Temperature 0 means greedy (argmax). All of it stays on the model's device.

``model`` is a :class:`~minigpt.model.transformer.Transformer` or its inference wrapper
:class:`~minigpt.infer.fastpath.FastPath` (fused projections, optional compiled decode step); both compute the same
logits. :func:`generate_batch` decodes several prompts of different lengths together (left padding, per-row
positions, per-row stopping); speculative decoding lives in :mod:`minigpt.infer.speculative`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from minigpt.errors import MiniGPTError
from minigpt.model.transformer import Transformer


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Draw one token per row from ``logits`` ``[batch, vocab_size]``; returns token ids ``[batch]`` (int64)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: Optional[int] = None, top_p: Optional[float] = None
) -> torch.Tensor:
    """The distribution :func:`sample` draws from (``temperature > 0``): float32 ``[..., vocab_size]`` after the
    temperature, top-k and top-p filters. Speculative decoding needs it explicitly for both models."""
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the most likely token always stays.
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def check_length(prompt_len: int, max_new_tokens: int, max_seq_len: int, truncate: bool = False) -> int:
    """Validate the prompt length; returns how many prompt tokens to drop from the left (0 unless ``truncate``).

    Raises :class:`MiniGPTError` naming both numbers when ``prompt_len + max_new_tokens > max_seq_len``.
    """
    if max_new_tokens < 1:
        raise MiniGPTError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if prompt_len == 0:
        raise MiniGPTError("the prompt is empty: give at least one token (or let BOS be prepended)")
    if max_new_tokens >= max_seq_len:
        raise MiniGPTError(
            f"max_new_tokens ({max_new_tokens}) must be below the model's context of {max_seq_len} tokens"
        )
    excess = prompt_len + max_new_tokens - max_seq_len
    if excess > 0 and not truncate:
        raise MiniGPTError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the model's context of "
            f"{max_seq_len} tokens; shorten the prompt, lower --max-new-tokens, or pass --truncate-prompt"
        )
    return max(0, excess)


@torch.inference_mode()
def generate_tokens(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    stop_ids: Sequence[int] = (),
    truncate: bool = False,
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids for one prompt, stopping after any id in ``stop_ids``
    (the stop id itself is not yielded).

    The prompt is prefilled in a single forward pass; each further token costs one cached forward of length 1.
    Raises :class:`MiniGPTError` if the prompt plus ``max_new_tokens`` exceeds ``max_seq_len`` (unless
    ``truncate``, which drops the oldest prompt tokens).

    Per step the only host synchronisation is reading the sampled token (to yield it and test ``stop_ids``).
    """
    device = model_device(model)
    drop = check_length(len(prompt), max_new_tokens, model.config.max_seq_len, truncate)
    prompt = list(prompt)[drop:]
    generator = make_generator(seed, device)
    cache = model.new_kv_cache(1, len(prompt) + max_new_tokens)
    x = torch.tensor([prompt], dtype=torch.long, device=device)
    stop = set(stop_ids)
    logits = prefill(model, x, cache)
    pos = len(prompt)
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        t = int(token.item())
        if t in stop:
            return
        yield t
        if i + 1 < max_new_tokens:
            logits = decode_step(model, token.view(1, 1), pos, cache)
            pos += 1


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


def prefill(model, tokens: torch.Tensor, cache, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run the prompt ``tokens`` ``[batch, seq_len]`` from position 0 and return the next-token logits
    ``[batch, vocab]``; the fast path computes the LM head for the last position only."""
    if hasattr(model, "decode_step"):
        return model(tokens, 0, cache, attention_mask, last_only=True)[:, -1]
    return model(tokens, 0, cache, attention_mask)[:, -1]


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
    max_new_tokens: Union[int, Sequence[int]],
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    stop_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    truncate: bool = False,
    pad_id: int = 0,
    on_token: Optional[Callable[[int, int], None]] = None,
) -> list[Completion]:
    """Generate for several prompts of different lengths in one batch; returns one :class:`Completion` per prompt.

    The prompts are left-padded to the longest (with ``pad_id``, never attended to) and described by an attention
    mask, so every row is computed exactly as if it were alone: its positions count from its first real token
    (:func:`minigpt.model.transformer.positions_from_mask`) and no query sees a padding key. Each row stops independently
    at a token in ``stop_ids``, at a stop string (needs ``tokenizer``), or after its own ``max_new_tokens``
    (an int for all rows, or one per row); the batch ends when every row has. Finished rows keep riding along
    until then (their results are frozen). Greedy output equals :func:`generate_tokens` of each prompt alone.

    ``on_token(row, token)`` is called for every token a row keeps, in order (for streaming). Per step the only
    host synchronisation is reading the ``batch`` sampled tokens. Raises :class:`MiniGPTError` for an empty list,
    an empty prompt, or a prompt that does not fit (unless ``truncate``).
    """
    from minigpt.tokenizer.tokenizer import StreamDecoder

    n = len(prompts)
    if n == 0:
        raise MiniGPTError("generate_batch needs at least one prompt")
    budgets = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != n:
        raise MiniGPTError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    if stop_strings and tokenizer is None:
        raise MiniGPTError("stop strings need a tokenizer to decode the generated text")
    max_seq_len = model.config.max_seq_len
    rows = []
    for p, budget in zip(prompts, budgets):
        drop = check_length(len(p), budget, max_seq_len, truncate)
        rows.append(list(p)[drop:])
    device = model_device(model)
    longest, most = max(map(len, rows)), max(budgets)
    if longest + most > max_seq_len:  # rows fit alone but not side by side: drop the oldest tokens of long rows
        if not truncate:
            raise MiniGPTError(f"the longest prompt ({longest} tokens) + the largest max_new_tokens ({most}) exceed "
                               f"the model's context of {max_seq_len} tokens; generate them separately or pass "
                               "truncate=True")
        rows = [r[max(0, len(r) - (max_seq_len - most)):] for r in rows]
        longest = max(map(len, rows))
    pad_counts = [longest - len(r) for r in rows]
    padded = any(pad_counts)
    tokens = torch.tensor([[pad_id] * c + r for c, r in zip(pad_counts, rows)], dtype=torch.long, device=device)
    pad = torch.tensor(pad_counts, dtype=torch.long, device=device)
    total = longest + most
    mask = torch.ones(n, total, dtype=torch.long, device=device)
    for i, c in enumerate(pad_counts):
        mask[i, :c] = 0
    generator = make_generator(seed, device)
    cache = model.new_kv_cache(n, total)

    results = [Completion() for _ in range(n)]
    decoders = [StreamDecoder(tokenizer) for _ in range(n)] if tokenizer is not None else None
    texts = [""] * n
    active = [True] * n
    stop = set(stop_ids)
    logits = prefill(model, tokens, cache, mask[:, :longest] if padded else None)
    for step in range(most):
        token = sample(logits, temperature, top_k, top_p, generator)
        for i, t in enumerate(token.tolist()):  # the one host sync of the step
            if not active[i]:
                continue
            if t in stop:
                results[i].finish_reason, active[i] = "stop", False
                continue
            results[i].tokens.append(t)
            if on_token is not None:
                on_token(i, t)
            if decoders is not None:
                texts[i] += decoders[i].push(t)
                hit = next((s for s in stop_strings if s in texts[i]), None)
                if hit is not None:
                    texts[i] = texts[i][:texts[i].index(hit)]
                    results[i].finish_reason, active[i] = "stop", False
                    continue
            if len(results[i].tokens) >= budgets[i]:
                active[i] = False
        if not any(active):
            break
        pos = longest + step
        if padded:
            logits = decode_step(model, token.view(n, 1), pos, cache, mask[:, :pos + 1], (pos - pad)[:, None], pad)
        else:
            logits = decode_step(model, token.view(n, 1), pos, cache)
    if decoders is not None:
        for i in range(n):
            if results[i].finish_reason == "length":
                texts[i] += decoders[i].flush()
            results[i].text = texts[i]
    return results
