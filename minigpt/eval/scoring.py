"""Log-likelihood of continuations, batched, with the key/value cache of a shared context computed once.

The numbers are lm-evaluation-harness's (``lm_eval/models/huggingface.py`` ``HFLM._loglikelihood_tokens`` and
``lm_eval/api/model.py`` ``TemplateLM._encode_pair``, lm-eval 0.4):

* tokenization: whitespace at the end of the context moves to the front of the continuation; ``context +
  continuation`` is encoded as one string and the continuation's tokens are what follows the context's own
  encoding (``whole[len(encode(context)):]``), so a word is tokenized as it is in running text. The model reads
  ``context_ids + continuation_ids``, left-truncated to ``max_seq_len + 1`` tokens, minus the last token (lm-eval
  logs a warning and goes on; :attr:`Score.truncated` marks such requests so that a run can count them);
* a continuation longer than the window by itself: lm-eval 0.4.13 stops the whole run there (``assert
  len(continuation_enc) <= self.max_length``). We apply the same left truncation instead and score what it leaves
  in the window, the continuation's last ``max_seq_len`` tokens (:attr:`Score.continuation_truncated`); lm-eval has
  no number to compare for such a request;
* ``loglikelihood`` = sum over the continuation's tokens of ``log_softmax(logits)`` (float32) at the positions
  that predict them; ``is_greedy`` = every one of those tokens is the argmax;
* an empty context is the prefix token (BOS, else EOS) alone;
* BOS is prepended to every encoding when the tokenizer adds it by default (what ``transformers`` does for Llama
  tokenizers, hence lm-eval's ``hf`` model).

Speed. Requests come in groups that share a context (the choices of one item). The longest common token prefix of
a group, up to the token before the first scored position, is run once; its keys and values are copied to one
cache row per request, and only the rest of each request (the context's last token and the continuation) is run
on top of it. Groups are batched up to ``batch_size`` request rows: prefixes are right-padded (causal attention
never reads a later pad), and the suffix pass masks each row's prefix padding so its positions continue at its
own prefix length (:func:`~minigpt.model.transformer.positions_from_mask`). The logits equal a full forward of each
request alone to float rounding (tested against ``reuse_prefix=False``, which runs every request whole).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath


@dataclass(frozen=True)
class Score:
    """Log-likelihood (nats) of a continuation, whether greedy decoding reproduces it, and its length in tokens
    (the tokens scored). ``truncated``: context + continuation did not fit the window and lost tokens on the left;
    ``continuation_truncated``: the continuation alone did not fit, and only its last ``n_tokens`` were scored."""

    loglikelihood: float
    is_greedy: bool
    n_tokens: int
    truncated: bool = False
    continuation_truncated: bool = False


def rolling_windows(tokens: list[int], prefix_token: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Disjoint ``(context, continuation)`` windows scoring every token of ``tokens`` once, as lm-eval's
    ``get_rolling_token_windows(context_len=1)`` + ``make_disjoint_window`` (``lm_eval/utils.py``): the first window
    predicts ``tokens[:max_len]`` after ``prefix_token``; each later one predicts the next ``max_len`` tokens (fewer
    at the end) after as many earlier tokens as fit."""
    windows = []
    first = min(max_len, len(tokens))
    if first:
        windows.append(([prefix_token], tokens[:first]))
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_len)
        end = done + n
        context = tokens[max(0, end - max_len - 1):end - 1]
        windows.append((context[:len(context) - (n - 1)], tokens[end - n:end]))
        done = end
    return windows


class Scorer:
    """Scores ``(context, continuation)`` requests with ``model`` (a :class:`~minigpt.infer.fastpath.FastPath` or a
    :class:`~minigpt.model.transformer.Transformer`) and ``tokenizer``.

    ``add_bos``: prepend the tokenizer's BOS to every encoding (see module docstring). ``batch_size``: request rows
    per forward. ``reuse_prefix``: compute a group's shared prefix once (False: every request runs whole; same
    numbers, slower). ``max_length``: context window in tokens (default: the model's ``max_seq_len``).
    """

    def __init__(self, model, tokenizer, add_bos: bool = False, batch_size: int = 16, reuse_prefix: bool = True,
                 max_length: Optional[int] = None) -> None:
        if batch_size < 1:
            raise MiniGPTError(f"--batch-size must be at least 1, got {batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.add_bos = add_bos
        if add_bos and tokenizer.bos_id is None:
            raise MiniGPTError("the tokenizer has no BOS token to prepend (drop --bos)")
        if tokenizer.vocab_size > model.config.vocab_size:  # some text would index past the embedding
            raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                               f"{model.config.vocab_size} embedding rows: is the tokenizer the model's own?")
        self.batch_size = batch_size
        self.reuse_prefix = reuse_prefix
        self.max_length = max_length or model.config.max_seq_len
        self.device = model.device if isinstance(model, FastPath) else next(model.parameters()).device
        self._encoded: dict[str, list[int]] = {}

    # -------------------------------------------------------------------------------------------- tokenization
    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for: BOS, else EOS (lm-eval's ``prefix_token_id``)."""
        token = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id
        if token is None:
            raise MiniGPTError("the tokenizer has neither a BOS nor an EOS token to stand for an empty context")
        return token

    def encode(self, text: str, bos: Optional[bool] = None) -> list[int]:
        """Token ids of ``text``, BOS first when ``bos`` (default: ``add_bos``)."""
        ids = list(self.tokenizer.encode(text))
        return [self.tokenizer.bos_id] + ids if (self.add_bos if bos is None else bos) else ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """``(context_ids, continuation_ids)`` as lm-eval's ``_encode_pair`` (see module docstring)."""
        if context == "":
            cont = self.encode(continuation, bos=False)
            prefix = self.prefix_token_id
            return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        context_ids = self._encoded.get(context)
        if context_ids is None:
            context_ids = self._encoded[context] = self.encode(context)
            if len(self._encoded) > 4096:  # contexts repeat within an item, not across the run
                self._encoded.pop(next(iter(self._encoded)))
        whole = self.encode(context + continuation)
        return context_ids, whole[len(context_ids):]

    # ----------------------------------------------------------------------------------------------- scoring
    def loglikelihood(self, groups: Sequence[Sequence[tuple[str, str]]]) -> list[list[Score]]:
        """A :class:`Score` for every ``(context, continuation)`` request, grouped as given (requests of a group
        should share their context: that prefix is computed once). A request longer than the context window is
        left-truncated (see the module docstring). Raises :class:`MiniGPTError` for a continuation that is empty
        once tokenized."""
        encoded = [[self.encode_pair(c, x) for c, x in group] for group in groups]
        return self.loglikelihood_tokens(encoded)

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[Score]:
        """Log-likelihood of each whole text (lm-eval's ``loglikelihood_rolling``): its tokens (no BOS) scored in
        disjoint windows of up to ``max_length`` tokens after the prefix token (:func:`rolling_windows`)."""
        windows, owners = [], []
        for i, text in enumerate(texts):
            for window in rolling_windows(self.encode(text, bos=False), self.prefix_token_id, self.max_length):
                windows.append([window])
                owners.append(i)
        totals = [[0.0, True, 0] for _ in texts]
        for owner, (score,) in zip(owners, self.loglikelihood_tokens(windows)):
            total = totals[owner]
            total[0] += score.loglikelihood
            total[1] = total[1] and score.is_greedy
            total[2] += score.n_tokens
        return [Score(ll, greedy, n) for ll, greedy, n in totals]

    def loglikelihood_tokens(self, groups: Sequence[Sequence[tuple[list[int], list[int]]]]) -> list[list[Score]]:
        """:meth:`loglikelihood` on token ids: ``groups`` of ``(context_ids, continuation_ids)``."""
        prepared = [self._prepare(group) for group in groups]
        results: list[Optional[list[Score]]] = [None] * len(groups)
        for batch in self._batches(prepared):
            for index, scores in zip(batch, self._run_batch([prepared[i] for i in batch])):
                results[index] = [
                    replace(score, truncated=len(ctx) + len(cont) > self.max_length + 1,
                            continuation_truncated=len(cont) > self.max_length)
                    for score, (ctx, cont) in zip(scores, groups[index])]
        return results  # type: ignore[return-value]

    def _prepare(self, group) -> tuple[list[list[int]], list[list[int]], int]:
        """``(inputs, continuations, prefix_length)`` of one group: each request's model input (left-truncated),
        the continuation ids it scores (the last ``max_length`` of a longer continuation: all the window holds),
        and the length of the token prefix all inputs share before any scored position."""
        inputs, conts = [], []
        for context_ids, cont_ids in group:
            if not cont_ids:
                raise MiniGPTError("a continuation is empty once tokenized: nothing to score")
            inputs.append((context_ids + cont_ids)[-(self.max_length + 1):][:-1])
            conts.append(cont_ids[-self.max_length:])
        prefix = 0
        if self.reuse_prefix and inputs:
            # The suffix pass must compute every scored position (the one before each continuation and after).
            limit = min(len(x) - len(c) for x, c in zip(inputs, conts))
            first = inputs[0]
            while prefix < limit and all(x[prefix] == first[prefix] for x in inputs):
                prefix += 1
        return inputs, conts, prefix

    def _batches(self, prepared) -> Iterator[list[int]]:
        """Indices of the groups to run together: longest first (padding stays small, as lm-eval sorts), up to
        ``batch_size`` rows, and the longest prefix plus the longest suffix within the context window."""
        def length(i):
            inputs, _, prefix = prepared[i]
            return -max(len(x) for x in inputs), -prefix

        order = sorted(range(len(prepared)), key=length)
        batch, rows, longest_prefix, longest_suffix = [], 0, 0, 0
        for i in order:
            inputs, _, prefix = prepared[i]
            suffix = max(len(x) for x in inputs) - prefix
            fits = (rows + len(inputs) <= self.batch_size
                    and max(longest_prefix, prefix) + max(longest_suffix, suffix) <= self.max_length)
            if batch and not fits:
                yield batch
                batch, rows, longest_prefix, longest_suffix = [], 0, 0, 0
            batch.append(i)
            rows += len(inputs)
            longest_prefix, longest_suffix = max(longest_prefix, prefix), max(longest_suffix, suffix)
        if batch:
            yield batch

    @torch.inference_mode()
    def _run_batch(self, groups) -> list[list[Score]]:
        """Scores of the requests of ``groups`` (prepared by :meth:`_prepare`), in one prefix and one suffix pass."""
        model, device = self.model, self.device
        prefixes = [prefix for _, _, prefix in groups]
        rows = [(g, x, c) for g, (inputs, conts, _) in enumerate(groups) for x, c in zip(inputs, conts)]
        p_max = max(prefixes)
        s_max = max(len(x) - prefixes[g] for g, x, _ in rows)
        suffix = torch.zeros(len(rows), s_max, dtype=torch.long)
        for r, (g, x, _) in enumerate(rows):
            suffix[r, :len(x) - prefixes[g]] = torch.tensor(x[prefixes[g]:])
        suffix = suffix.to(device)
        if p_max == 0:
            # Right padding alone: a causal model never lets a real token read a later pad.
            logits = model(suffix)
        else:
            cache = model.new_kv_cache(len(rows), p_max + s_max)
            prefix = torch.zeros(len(groups), p_max, dtype=torch.long)
            for g, (inputs, _, p) in enumerate(groups):
                prefix[g, :p] = torch.tensor(inputs[0][:p], dtype=torch.long)
            # The prefix's logits are never read: on the fast path its LM head runs for one position only.
            model(prefix.to(device), 0, cache, **({"last_only": True} if isinstance(model, FastPath) else {}))
            owner = torch.tensor([g for g, _, _ in rows], device=device)
            for layer in range(model.config.n_layers):
                for buffer in (cache.k, cache.v):
                    buffer[layer][:len(rows), :, :p_max] = buffer[layer][owner, :, :p_max]
            mask = torch.zeros(len(rows), p_max + s_max, dtype=torch.long)
            for r, (g, x, _) in enumerate(rows):
                mask[r, :prefixes[g]] = 1
                mask[r, p_max:p_max + len(x) - prefixes[g]] = 1
            logits = model(suffix, p_max, cache, mask.to(device))
        # The scored positions of each row, in suffix coordinates: the last len(cont) positions of its input.
        row_index, position, target, lengths = [], [], [], []
        for r, (g, x, c) in enumerate(rows):
            end = len(x) - prefixes[g]
            row_index += [r] * len(c)
            position += range(end - len(c), end)
            target += c
            lengths.append(len(c))
        picked = logits[torch.tensor(row_index, device=device), torch.tensor(position, device=device)].float()
        target_t = torch.tensor(target, device=device)
        token_lp = torch.log_softmax(picked, dim=-1).gather(-1, target_t[:, None])[:, 0]
        greedy = picked.argmax(dim=-1) == target_t
        scores: list[list[Score]] = [[] for _ in groups]
        start = 0
        for (g, _, _), n in zip(rows, lengths):
            scores[g].append(Score(float(token_lp[start:start + n].double().sum()),
                                   bool(greedy[start:start + n].all()), n))
            start += n
        return scores
