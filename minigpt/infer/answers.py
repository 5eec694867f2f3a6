"""A chat model's answers to many conversations at once: what the poetry scripts sample and score.

:func:`load_chat_model` loads a model source with its tokenizer and chat template, as ``minigpt chat`` does (a
model without a template gets the plain ``User: ... / Assistant:`` one). :func:`answer_batch` renders each
conversation with that template and answers them through :func:`~minigpt.infer.generate.generate_batch`, several
sequences per forward pass; greedy answers equal those of :func:`~minigpt.infer.generate.generate_tokens` one
prompt at a time.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
from minigpt.errors import MiniGPTError
from minigpt.infer.generate import generate_batch
from minigpt.infer.sampling import SamplingParams
from minigpt.infer.stops import default_stop_ids
from minigpt.tokenizer.chat_template import ChatTemplate


@dataclass
class ChatModel:
    """A loaded model with what answering needs: its tokenizer, chat template and stop ids."""

    model: object
    tokenizer: object
    template: ChatTemplate
    stop_ids: list[int]


def load_chat_model(source: str | Path) -> ChatModel:
    """The model at ``source`` (run dir, model dir, ``.gguf``, llama2.c ``.bin``) with its tokenizer, chat template
    and default stop ids. Raises :class:`MiniGPTError` for a source that is none of these or lacks a tokenizer."""
    ckpt = resolve_checkpoint(source)
    model, tokenizer = load_model(ckpt), load_tokenizer(ckpt)
    template = ChatTemplate.for_model(tokenizer, load_chat_template(ckpt))
    return ChatModel(model, tokenizer, template, default_stop_ids(tokenizer, template))


def answer_batch(chat: ChatModel, conversations: Sequence[Sequence[dict]], params: SamplingParams,
                 batch_size: int = 64, progress: bool = False) -> list[str]:
    """One answer per conversation (a list of ``{"role", "content"}`` messages), in order, stripped of surrounding
    whitespace.

    Up to ``batch_size`` conversations share a forward pass. Each answer ends at a stop id, at a stop string of
    ``params`` or of the template (the plain template's ``User:``; cut off, as in ``minigpt chat``) or after
    ``params.max_tokens`` tokens, fewer where the context is shorter than prompt + budget (such a prompt is
    answered alone). With a ``params.seed``, the conversations answered together whose first is conversation ``i``
    (a batch, or such a prompt alone) are sampled with seed ``seed + i``: the same inputs and ``batch_size`` give
    the same answers, and a prompt answered alone draws its own numbers. ``progress`` prints a count to stderr.
    Raises :class:`MiniGPTError`, before answering any, for ``batch_size`` < 1 or a prompt that leaves no room
    for one new token.
    """
    if batch_size < 1:
        raise MiniGPTError(f"batch_size must be at least 1, got {batch_size}")
    max_seq_len = chat.model.config.max_seq_len
    prompts = [chat.template.prompt(list(c)) for c in conversations]
    longest = max(map(len, prompts), default=0)
    if longest >= max_seq_len:
        raise MiniGPTError(f"a prompt of {longest} tokens leaves no room to answer in the model's context of "
                           f"{max_seq_len}")
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        # A batch's cache holds its longest prompt + the largest budget: a prompt with less room than the budget
        # is answered alone, with the room it has, so that it shortens no other row's answer.
        roomy = [len(p) + params.max_tokens <= max_seq_len for p in batch]
        groups = [[i for i, ok in enumerate(roomy) if ok]] if any(roomy) else []
        groups += [[i] for i, ok in enumerate(roomy) if not ok]
        texts: dict[int, str] = {}
        for group in groups:
            room = min(params.max_tokens, max_seq_len - max(len(batch[i]) for i in group))
            seed = None if params.seed is None else params.seed + start + group[0]
            group_params = replace(params, max_tokens=room, seed=seed, stop=(*params.stop, *chat.template.stop))
            done = generate_batch(chat.model, [batch[i] for i in group], group_params, stop_ids=chat.stop_ids,
                                  tokenizer=chat.tokenizer)
            texts.update((i, c.text.strip()) for i, c in zip(group, done))
        answers.extend(texts[i] for i in range(len(batch)))
        if progress:
            print(f"\r{len(answers)}/{len(prompts)} answers", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return answers
