"""A forward pass over packed rows: several conversations per row, none attending to another.

:class:`~minigpt.model.transformer.Transformer`'s own ``forward`` knows causal attention and left padding only, so
this module runs its parts (embedding, blocks, final norm, head) with two extras, the "document masking" of packed
fine-tuning (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination"; ``transformers``'
``DataCollatorWithFlattening`` passes ``position_ids`` for the same purpose):

* RoPE at per-token ``position_ids`` that restart at 0 for every conversation, so each is rotated as if alone;
* a block-diagonal causal mask ``[batch, 1, seq_len, seq_len]``: a query sees only earlier keys of its own
  conversation. Padding forms its own block, so every query sees at least itself (SDPA turns an all-masked row
  into NaN).

The logits at every real token then equal those of the conversation run alone (tested to 1e-5).

:func:`with_packed_forward` gives a model this path through its own ``forward`` (keyword arguments
``position_ids`` / ``doc_ids``), so that training reaches it through the DDP / FSDP wrapper and ``torch.compile``.
"""
from __future__ import annotations

from typing import Optional

import torch

from minigpt.errors import MiniGPTError
from minigpt.model.transformer import Transformer


def document_mask(doc_ids: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """Boolean ``[batch, 1, seq_len, seq_len]``, True where query ``i`` may attend to key ``j``: ``j <= i`` and both
    in the same document (and, with a sliding ``window``, ``j > i - window``: a document's tokens are contiguous,
    so column distance is position distance). ``doc_ids`` ``[batch, seq_len]`` (int) labels each token's
    document."""
    seq_len = doc_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def packed_forward(model, tokens: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                   positions_below: Optional[int] = None) -> torch.Tensor:
    """Logits ``[batch, seq_len, vocab_size]`` of packed ``tokens`` ``[batch, seq_len]``, with per-token
    ``position_ids`` and ``doc_ids`` (both ``[batch, seq_len]``; see :class:`minigpt.data.chat_batches.Batch`).
    ``positions_below``: a bound on ``position_ids`` known without looking (packed rows: their width, as every
    conversation's positions restart at 0 inside the row), which spares a host sync and lets ``torch.compile``
    trace the whole forward.

    Raises :class:`MiniGPTError` for a model without RoPE or with dynamic-NTK RoPE (whose tables depend on the
    whole batch's length): train those with padded batches (``--no-pack``).
    """
    if model.rope is None:
        raise MiniGPTError(f"packing needs RoPE positions, this model has pos_encoding={model.config.pos_encoding!r}; "
                           "use padded batches (--no-pack)")
    if model.rope.is_dynamic:
        raise MiniGPTError("packing is not supported with dynamic-NTK RoPE scaling; use padded batches (--no-pack)")
    end = int(position_ids.max()) + 1 if positions_below is None else positions_below
    if end > model.config.max_seq_len:
        raise MiniGPTError(f"a packed position exceeds the model's max_seq_len {model.config.max_seq_len}")
    model.ensure_positions(end)  # the tables grow lazily (Transformer.ensure_positions)
    cos = model.rope_cos[position_ids][:, None]  # [batch, 1, seq_len, head_dim]
    sin = model.rope_sin[position_ids][:, None]
    mask = document_mask(doc_ids, model.config.sliding_window)
    h = model.dropout(model.tok_embeddings(tokens))
    for layer in model.layers:
        h = layer(h, cos, sin, 0, None, mask)
    return model.logits(h)  # final norm, head, soft-capping


class PackedTransformer(Transformer):
    """A :class:`Transformer` whose ``forward`` also takes packed rows: with ``position_ids`` and ``doc_ids``
    (``[batch, seq_len]``) it returns :func:`packed_forward`'s logits, else it is the plain forward."""

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, kv_cache=None, attention_mask=None,
                position_ids: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:
            return super().forward(tokens, start_pos, kv_cache, attention_mask)
        return packed_forward(self, tokens, position_ids, doc_ids, positions_below=tokens.shape[1])


def with_packed_forward(model: Transformer) -> Transformer:
    """``model`` itself, its class switched to :class:`PackedTransformer` (no new state: the same parameters,
    buffers and state-dict keys). Call before wrapping it for DDP / FSDP."""
    if type(model) is Transformer:
        model.__class__ = PackedTransformer
    return model
