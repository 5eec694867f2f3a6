"""Batches of tokenized chat examples (:class:`~minigpt.data.chat.ChatExample`) and their masked loss.

Rows are right-padded to the longest (:func:`pad_batch`; causal attention never lets a real token see the padding
after it), or several conversations are packed per row (:func:`pack_examples`, :func:`packed_batch`) with positions
restarting at each conversation and a block-diagonal causal mask, so that packing changes no logit. Labels follow
the Hugging Face convention (``-100``: not scored), and the logits at position ``t`` are scored against
``labels[t + 1]`` (:func:`masked_lm_loss`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from minigpt.data.chat import IGNORE_INDEX, ChatExample


@dataclass
class Batch:
    """Model inputs: ``tokens`` / ``labels`` ``[batch, seq_len]`` (int64); for packed rows also ``position_ids``
    (restarting at 0 per conversation) and ``doc_ids`` (``-1`` on padding). ``n_pad``: padding tokens."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    doc_ids: Optional[torch.Tensor] = None
    n_pad: int = 0

    @property
    def padding_fraction(self) -> float:
        return self.n_pad / self.tokens.numel()

    def to(self, device) -> "Batch":
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return Batch(move(self.tokens), move(self.labels), move(self.position_ids), move(self.doc_ids), self.n_pad)


def pad_batch(examples: list[ChatExample], pad_id: int) -> Batch:
    """Right-pad ``examples`` to the longest; padding has label ``-100``."""
    width = max(len(e) for e in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        tokens[row, : len(e)] = torch.tensor(e.input_ids)
        labels[row, : len(e)] = torch.tensor(e.labels)
    return Batch(tokens, labels, n_pad=tokens.numel() - sum(len(e) for e in examples))


def pack_examples(examples: list[ChatExample], seq_len: int) -> list[list[int]]:
    """Group example indices into rows of at most ``seq_len`` tokens: first fit, in the given order (each
    example goes into the first row with room, else opens a new one). Raises ``ValueError`` for an example longer
    than ``seq_len``."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, e in enumerate(examples):
        if len(e) > seq_len:
            raise ValueError(f"example {e.source or i} has {len(e)} tokens, more than the row length {seq_len}")
        for r, free in enumerate(room):
            if len(e) <= free:
                rows[r].append(i)
                room[r] -= len(e)
                break
        else:
            rows.append([i])
            room.append(seq_len - len(e))
    return rows


def packed_batch(rows: list[list[ChatExample]], pad_id: int, seq_len: Optional[int] = None) -> Batch:
    """Concatenate each row's conversations; pad rows to ``seq_len`` (default: the longest row).

    The first token of every conversation gets label ``-100``: run alone, nothing predicts it, so nothing may
    predict it from the previous conversation's last token either.
    """
    width = seq_len or max(sum(len(e) for e in row) for row in rows)
    shape = (len(rows), width)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    docs = torch.full(shape, -1, dtype=torch.long)
    n_real = 0
    for r, row in enumerate(rows):
        start = 0
        for d, e in enumerate(row):
            end = start + len(e)
            tokens[r, start:end] = torch.tensor(e.input_ids)
            labels[r, start:end] = torch.tensor(e.labels)
            labels[r, start] = IGNORE_INDEX
            positions[r, start:end] = torch.arange(len(e))
            docs[r, start:end] = d
            start = end
        n_real += start
    return Batch(tokens, labels, positions, docs, n_pad=tokens.numel() - n_real)


def iterate_batches(examples: list[ChatExample], batch_size: int, pad_id: int, pack: bool, seq_len: int,
                    seed: int = 0, epoch: int = 0) -> Iterable[Batch]:
    """One epoch of batches: the examples shuffled (``seed + epoch``), then padded in groups of ``batch_size``, or
    packed into rows of ``seq_len`` tokens and grouped ``batch_size`` rows at a time."""
    order = list(range(len(examples)))
    random.Random(seed + epoch).shuffle(order)
    shuffled = [examples[i] for i in order]
    if not pack:
        for i in range(0, len(shuffled), batch_size):
            yield pad_batch(shuffled[i : i + batch_size], pad_id)
        return
    rows = pack_examples(shuffled, seq_len)
    for i in range(0, len(rows), batch_size):
        yield packed_batch([[shuffled[j] for j in row] for row in rows[i : i + batch_size]], pad_id)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position next-token cross-entropy ``[batch, seq_len - 1]`` (float32, nats): ``logits[:, t]`` against
    ``labels[:, t + 1]``; 0 where the label is ``-100``."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape[0], -1)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the scored tokens (nats/token, float32): ``logits`` ``[batch, seq_len,
    vocab_size]``, ``labels`` ``[batch, seq_len]`` with ``-100`` = ignored, shifted as in ``transformers``'
    ``ForCausalLMLoss`` (``LlamaForCausalLM(..., labels=labels).loss``). A batch with nothing to score gives 0."""
    n = (labels[:, 1:] != IGNORE_INDEX).sum()
    return token_losses(logits, labels).sum() / n.clamp(min=1)
