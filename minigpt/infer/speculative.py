"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

A small *draft* model proposes ``k`` tokens one by one; the *target* model scores all of them in a single forward
of ``k + 1`` positions (on a CPU that costs about as much as one decode step: both read every weight once), and the
proposals are accepted left to right by the rule that makes the output distributed exactly as the target's:

* draft token ``x_i`` drawn from ``q_i`` is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``;
* at the first rejection the token is redrawn from the residual ``norm(max(0, p_i - q_i))`` and the round ends;
* if all ``k`` are kept, one more token is drawn from ``p_{k+1}`` (the target scored that position anyway).

Each round therefore yields between 1 and ``k + 1`` tokens for one target forward. ``p`` and ``q`` are the
distributions after temperature / top-k / top-p (:func:`minigpt.infer.sampling.sampling_probs`), so the output follows
the target's *filtered* distribution. Greedy decoding (temperature 0) is the limit where both are one-hot: a
proposal is kept iff it equals the target's argmax, and the output is the target's own greedy output.

Both models must share the tokenizer (the same vocabulary ids). Batch size 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.generate import decode_step, decode_tokens, make_generator, model_device, prefill
from minigpt.infer.sampling import SamplingParams, check_length, check_token_ids, sampling_probs


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation: ``rounds`` (target forwards after the prefill), ``proposed`` draft
    tokens and how many were ``accepted``. ``acceptance_rate = accepted / proposed``; tokens per target forward
    ``= (accepted + rounds) / rounds`` at most (the last round may be cut by the token budget)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0


def accept_reject(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: Optional[torch.Generator] = None
) -> tuple[int, int]:
    """One verification round of speculative sampling.

    ``p`` ``[k + 1, vocab]``: the target's distributions at the ``k`` draft positions and one beyond; ``q``
    ``[k, vocab]``: the draft's distributions the proposals ``draft`` ``[k]`` (int64) were drawn from. Returns
    ``(n_accepted, next_token)``: the first ``n_accepted`` proposals stand and ``next_token`` follows them (drawn
    from the residual at the first rejection, or from ``p[k]`` when all were accepted).

    One host synchronisation (reading the two integers). ``p``/``q`` float32 rows summing to 1.
    """
    k = draft.shape[0]
    rows = torch.arange(k, device=p.device)
    p_x, q_x = p[rows, draft], q[rows, draft]
    u = torch.rand(k, generator=generator, device=p.device)
    # Accept x_i iff u_i * q_i(x_i) < p_i(x_i), i.e. u_i < p/q without dividing by a zero q (never drawn anyway).
    accepted = (u * q_x < p_x).long()
    n = int(accepted.cumprod(0).sum())
    if n == k:
        return k, int(torch.multinomial(p[k], 1, generator=generator))
    residual = (p[n] - q[n]).clamp_(min=0)
    total = residual.sum()
    # p == q on the whole support leaves nothing: a rejection then has probability 0, but float rounding can still
    # produce one; p itself is the right fallback.
    residual = residual / total if total > 0 else p[n]
    return n, int(torch.multinomial(residual, 1, generator=generator))


def greedy_accept(p_logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, int]:
    """The temperature-0 rule: ``p_logits`` ``[k + 1, vocab]``; proposals stand while they equal the target's
    argmax; the next token is the target's argmax after them. Returns ``(n_accepted, next_token)``."""
    best = p_logits.argmax(dim=-1)  # [k + 1]
    k = draft.shape[0]
    n = int((best[:k] == draft).long().cumprod(0).sum())
    return n, int(best[n])


@torch.inference_mode()
def speculative_tokens(
    target,
    draft,
    prompt: Sequence[int],
    params: SamplingParams,
    k: int = 4,
    *,
    stop_ids: Sequence[int] = (),
    truncate: bool = False,
    stats: Optional[SpeculativeStats] = None,
) -> Iterator[int]:
    """Yield up to ``params.max_tokens`` tokens of ``target`` for ``prompt`` sampled with ``params``, proposed ``k``
    at a time by ``draft`` (both :class:`~minigpt.model.transformer.Transformer` or
    :class:`~minigpt.infer.fastpath.FastPath`), stopping after a token in ``stop_ids`` (not yielded); like
    :func:`~minigpt.infer.generate.generate_tokens`, ``params.stop`` is the decoding caller's. Fills ``stats`` if
    given.

    Raises :class:`MiniGPTError` when ``k < 1``, the vocabularies differ, or the prompt does not fit either model.
    """
    if k < 1:
        raise MiniGPTError(f"the number of draft tokens k must be at least 1, got {k}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise MiniGPTError(f"the draft model has {draft.config.vocab_size} tokens but the target "
                           f"{target.config.vocab_size}: speculative decoding needs one shared tokenizer")
    stats = stats if stats is not None else SpeculativeStats()
    context = min(target.config.max_seq_len, draft.config.max_seq_len)
    # The verify forward writes k positions past the last kept token, so the cache needs that much head room.
    max_new_tokens = params.max_tokens
    check_token_ids(prompt, target.config.vocab_size)
    drop, _ = check_length(len(prompt), max_new_tokens + k, context, truncate=truncate)
    seq = list(prompt)[drop:]
    device = model_device(target)
    generator = make_generator(params.seed, device)
    length = len(seq) + max_new_tokens + k + 1
    t_cache, d_cache = target.new_kv_cache(1, length), draft.new_kv_cache(1, length)
    greedy = params.greedy

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, params)

    # The target has seen seq[:-1] (the last token enters with the proposals); the draft has seen seq[:d_len].
    if len(seq) > 1:
        prefill(target, torch.tensor([seq[:-1]], device=device), t_cache)
    d_logits = prefill(draft, torch.tensor([seq], device=device), d_cache)  # [1, vocab]
    d_len = len(seq)
    stop = set(stop_ids)
    produced = 0
    while produced < max_new_tokens:
        # 1. Draft k proposals. d_logits are the draft's logits after seq[:d_len]; first catch up on what it missed.
        if d_len < len(seq):
            pending = torch.tensor([seq[d_len:]], device=device)
            d_logits = decode_tokens(draft, pending, d_len, d_cache)[:, -1]
            d_len = len(seq)
        proposals, q_rows = [], []
        for i in range(k):
            if greedy:
                x = d_logits.argmax(dim=-1)
            else:
                q = probs(d_logits)  # [1, vocab]
                q_rows.append(q)
                x = torch.multinomial(q, 1, generator=generator).view(1)
            proposals.append(x)
            if i + 1 < k:
                d_logits = decode_step(draft, x.view(1, 1), d_len + i, d_cache)
        draft_tokens = torch.cat(proposals)  # [k], on the device: no sync while drafting
        # 2. The target scores seq[-1] and the k proposals in one forward.
        t_in = torch.cat([torch.tensor([seq[-1]], device=device), draft_tokens]).view(1, k + 1)
        t_logits = decode_tokens(target, t_in, len(seq) - 1, t_cache)[0]  # [k + 1, vocab]
        # 3. Accept / reject.
        if greedy:
            n, nxt = greedy_accept(t_logits, draft_tokens)
        else:
            n, nxt = accept_reject(probs(t_logits), torch.cat(q_rows), draft_tokens, generator)
        stats.rounds += 1
        stats.proposed += k
        stats.accepted += n
        # The draft has seen seq + proposals[:k - 1]; of those, seq + the accepted ones are still valid.
        d_len = len(seq) + min(n, k - 1)
        for t in draft_tokens[:n].tolist() + [nxt]:
            if t in stop:
                return
            seq.append(t)
            produced += 1
            stats.emitted += 1
            yield t
            if produced >= max_new_tokens:
                return
