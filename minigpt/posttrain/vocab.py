"""Growing a model's vocabulary for new special tokens (e.g. ChatML's ``<|im_start|>`` / ``<|im_end|>``).

New embedding rows (and LM-head rows, when untied) start at the mean of the existing rows. Hewitt 2021 ("Initializing
new word embeddings for pretrained language models") shows why: with the mean, the new tokens' initial logits are
close to the average logit, so the model's distribution barely moves, whereas random rows can dominate the softmax.
``transformers``' ``resize_token_embeddings(mean_resizing=True)`` samples around the same mean.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from minigpt.errors import MiniGPTError
from minigpt.tokenizer.chat_template import CHAT_TOKENS, add_special_tokens
from minigpt.tokenizer.tokenizer import Tokenizer


def resize_token_embeddings(model, vocab_size: int, init_ids: Iterable[int] = ()) -> None:
    """Resize ``model``'s embedding (and untied LM head) to ``vocab_size`` rows, in place, keeping the old rows.

    Rows beyond the old size, and the rows ``init_ids`` (new tokens whose ids fell inside an oversized old matrix),
    are set to the mean of the old rows. ``model.config.vocab_size`` follows. Raises :class:`MiniGPTError` when
    shrinking.
    """
    old = model.tok_embeddings.weight
    old_size = old.shape[0]
    if vocab_size < old_size:
        raise MiniGPTError(f"cannot shrink the vocabulary from {old_size} to {vocab_size}")
    init = sorted(set(range(old_size, vocab_size)) | set(init_ids))

    def grown(weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(vocab_size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        out[:old_size] = weight.detach()
        out[init] = weight.detach().float().mean(0).to(weight.dtype)
        return out

    tied = model.config.tie_embeddings
    if not isinstance(model.output, nn.Linear):
        raise MiniGPTError("cannot add tokens to an int8-quantized model; add them to the float model first")
    # Built on the meta device: their weights are replaced at once, so nothing is allocated twice.
    embedding = nn.Embedding(vocab_size, old.shape[1], device="meta")
    embedding.weight = nn.Parameter(grown(old), requires_grad=old.requires_grad)
    head = model.output
    if not tied:
        new_head = nn.Linear(head.in_features, vocab_size, bias=False, device="meta")
        new_head.weight = nn.Parameter(grown(head.weight), requires_grad=head.weight.requires_grad)
        model.output = new_head
    model.tok_embeddings = embedding
    if tied:
        model.output = nn.Linear(old.shape[1], vocab_size, bias=False, device="meta")
        model.output.weight = model.tok_embeddings.weight
    model.config.vocab_size = vocab_size


def add_chat_tokens(model, tokenizer: Tokenizer, tokens=CHAT_TOKENS) -> tuple[Tokenizer, list[int]]:
    """Make sure ``tokenizer`` has ``tokens`` (added as special tokens if missing) and ``model`` has rows for them
    (mean-initialised). Returns ``(tokenizer, new_ids)``; the model is changed in place."""
    tokenizer, new_ids = add_special_tokens(tokenizer, tokens)
    if new_ids:
        resize_token_embeddings(model, max(model.config.vocab_size, tokenizer.vocab_size), new_ids)
    elif tokenizer.vocab_size > model.config.vocab_size:
        raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size} embeddings")
    return tokenizer, new_ids
