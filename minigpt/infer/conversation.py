"""One conversation's KV cache kept between its turns, for a single-sequence model loop (`minigpt chat --compile`).

Each turn's prompt is the whole conversation so far, re-rendered by the chat template; it starts with the tokens
of the previous turn's prompt and (most of) its answer, whose keys and values the cache still holds. Only the
tokens after the longest common prefix are prefilled: the role the serving engine's prefix cache
(:mod:`minigpt.infer.prefix_cache`) plays for `minigpt chat` without ``--compile``, reduced to the one sequence.

The cache is a :class:`~minigpt.infer.fastpath.FastPath`'s own, so a compiled FastPath decodes through its compiled
step. That step attends to every column of the cache under a mask (135M fp32, 2 threads: 40 tokens/s with a
256-column cache, 28 with 2,048), so the cache grows with the conversation in powers of two from
:data:`~minigpt.infer.kv_cache.FIRST_LENGTH` columns rather than taking the whole context at once: never much longer than the
conversation, and few lengths (a step compiled in-process by ``torch.compile`` may recompile for a new one).
Where the step is an AOTInductor package, which serves every length (``FastPath.any_cache_length``), a turn's
cache holds its prompt and grows with the answer instead (:func:`~minigpt.infer.generate.grown_cache_for`).
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from minigpt.infer.generate import generate_tokens, model_device
from minigpt.infer.kv_cache import grown_cache
from minigpt.infer.request import free_memory, kv_cache_bytes, plan_context
from minigpt.infer.sampling import InvalidRequest, SamplingParams


class Conversation:
    """Generation for one conversation whose turns share their prefix.

    ``model``: a :class:`~minigpt.infer.fastpath.FastPath` (compiled or not) or a
    :class:`~minigpt.model.transformer.Transformer`; ``context``: the most tokens the cache may hold, at most the
    model's ``max_seq_len`` (default: that, capped to half the free memory, as the engine's
    :func:`~minigpt.infer.request.plan_context`, which raises :class:`~minigpt.errors.MiniGPTError` for a bad one).
    """

    def __init__(self, model, context: Optional[int] = None) -> None:
        c = model.config
        dtype = getattr(model, "act_dtype", None) or model.tok_embeddings.weight.dtype  # what new_kv_cache holds
        per_token = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, 1, 1, dtype)
        budget = free_memory(model_device(model)) // 2 if context is None else None
        self.model, self.context = model, plan_context(c.max_seq_len, per_token, context, budget)
        self.cache = None
        self.cached: list[int] = []  # the token ids whose keys and values fill the cache's first columns

    def reset(self) -> None:
        """Forget the conversation (the cache's memory is kept for the next one)."""
        self.cached = []

    def generate(self, prompt: Sequence[int], params: SamplingParams, stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Yield the answer's token ids for ``prompt`` (the whole conversation so far), as
        :func:`~minigpt.infer.generate.generate_tokens` would from an empty cache, prefilling only the prompt's
        tokens after those the cache holds. Raises :class:`~minigpt.infer.sampling.InvalidRequest` when the prompt
        plus ``params.max_tokens`` does not fit in ``context``."""
        prompt = list(prompt)
        need = len(prompt) + params.max_tokens
        if need > self.context:
            raise InvalidRequest(f"the prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceed the "
                                 f"context of {self.context} tokens", "prompt")
        reuse = 0
        for a, b in zip(self.cached, prompt[:-1]):  # at least one prompt token is run: its logits start the answer
            if a != b:
                break
            reuse += 1
        # A step that serves every cache length reads every column it is given: the cache then holds the prompt
        # and grows with the answer (generate.grown_cache_for); other models take the turn's room at once.
        grow = getattr(self.model, "any_cache_length", False)
        self._make_room(len(prompt) + 1 if grow else need, reuse, fitted=grow)
        self.cached = prompt[:reuse]  # the columns after these are about to change
        answer: list[int] = []
        try:
            for token in generate_tokens(self.model, prompt, params, stop_ids=stop_ids, cache=self.cache,
                                         cached=reuse, grow_cache=grow):
                answer.append(token)
                yield token
        finally:
            # Every answer token but the last has been run through the model (the last one too when a stop id
            # followed, but a shorter prefix of what the cache holds is always right); no answer token: the
            # prefill may not have finished (Ctrl-C).
            self.cached = prompt + answer[:-1] if answer else prompt[:reuse]

    def _make_room(self, need: int, keep: int, fitted: bool = False) -> None:
        """A cache of at least ``need`` (:func:`~minigpt.infer.kv_cache.grown_length`) columns whose first ``keep`` columns are the current
        cache's."""
        if self.cache is None or self.cache.max_seq_len < need:
            self.cache = grown_cache(self.model, self.cache, need, self.context, keep, fitted=fitted)
