"""Autoregressive generation: one prefill pass over the prompt, then one token per step through the KV cache.

Sampling follows the usual recipe: divide logits by the temperature, keep the ``top_k`` most likely tokens (Fan et
al. 2018), then the smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020), and
draw from what remains. Temperature 0 means greedy (argmax). All of it stays on the model's device.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

from .errors import MiniGPTError
from .transformer import Transformer


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
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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
    """
    device = model.tok_embeddings.weight.device
    drop = check_length(len(prompt), max_new_tokens, model.config.max_seq_len, truncate)
    prompt = list(prompt)[drop:]
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    cache = model.new_kv_cache(1, len(prompt) + max_new_tokens)
    x = torch.tensor([prompt], dtype=torch.long, device=device)
    pos = 0
    stop = set(stop_ids)
    for _ in range(max_new_tokens):
        logits = model(x, pos, cache)[:, -1]
        pos += x.shape[1]
        token = sample(logits, temperature, top_k, top_p, generator)
        t = int(token.item())
        if t in stop:
            return
        yield t
        x = token.view(1, 1)
