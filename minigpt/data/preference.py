"""Preference data for DPO: JSONL pairs -> prompt / chosen / rejected token ids -> padded pair batches.

One JSON object per line, in TRL's preference layouts (``trl`` 1.x "preference" dataset type):

* standard: ``{"prompt": str, "chosen": str, "rejected": str}``; the texts are concatenated (``prompt + chosen``);
* conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` with OpenAI messages
  (``{"role", "content"}``), rendered with the model's chat template: the prompt with the generation prompt, the
  prompt plus each answer without it;
* conversational with plain-string answers, ``{"prompt": [messages], "chosen": str, "rejected": str}`` (the layout of
  ``shared/data/dpo``): each string becomes one assistant message;
* implicit prompt: no ``"prompt"``, ``chosen`` and ``rejected`` both whole conversations (or both strings); the prompt
  is their longest common prefix (TRL's ``extract_prompt``: whole messages, or characters backed off by one when the
  prefix ends with a space).

Conversational rows may use tools as in SFT data (:mod:`minigpt.data.chat`): a ``tools`` column given to the template
(as TRL's ``DPOTrainer`` gives it), assistant ``tool_calls``, ``tool`` messages; a pair may then prefer a call to an
answer.

Tokenization follows TRL's ``DPOTrainer._prepare_dataset``: ``prompt_ids`` are the ids of the prompt alone, each
completion is the part of ``ids(prompt + answer)`` after the longest prefix it shares with ``prompt_ids`` (so a token
merging across the boundary goes to the completion), standard answers get the EOS token's text appended unless
they already end with it (the EOS id itself where that token has no text, as SentencePiece's ``</s>``; TRL appends
the text ``</s>``, which such a tokenizer may split into characters), and standard text starts with BOS where the
model's tokenizer prepends one (TRL 1.x encodes it with ``tokenizer(text)``). Unlike TRL (``max_length`` 1024,
cutting the end), a pair longer than the context is skipped, never truncated: a cut answer would be judged on text
the annotator never saw.

A line that cannot be used (not valid UTF-8, invalid JSON, unknown layout or role, empty text, identical answers, a
malformed tool call, tools the template leaves out, messages it rejects, too long) is skipped and counted in a
:class:`~minigpt.data.chat.SkipReport`; with ``strict=True`` the first one raises
:class:`~minigpt.errors.MiniGPTError` naming ``file:line``.

Batches (:func:`pad_pairs`) stack the chosen sequences then the rejected ones, ``[2 * batch, seq_len]``, right-padded,
with ``labels = -100`` outside the completions: one forward pass scores both answers (TRL's "concatenated forward").
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from minigpt.data.chat import (
    IGNORE_INDEX,
    BadLine,
    SkipReport,
    check_messages,
    check_tools_rendered,
    common_prefix,
    encode_plain,
    openai_messages,
    read_jsonl,
    row_tools,
    skip_reason,
)
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.chat_template import ChatTemplate, TemplateRejected
from minigpt.tokenizer.text import InvalidText

Messages = list[dict[str, str]]


@dataclass
class PreferenceRecord:
    """One validated pair before tokenization: ``prompt`` / ``chosen`` / ``rejected`` are all strings (standard) or
    all message lists (conversational, with the row's ``tools`` for the template); ``source`` is ``file:line``."""

    prompt: Any
    chosen: Any
    rejected: Any
    source: str = ""
    tools: Optional[list[dict]] = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class PreferencePair:
    """A tokenized pair: the shared ``prompt_ids`` and the two completions' ids; ``source`` is ``file:line``."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str = ""

    def __len__(self) -> int:
        """Tokens of the longer of the two sequences ``prompt + completion``."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


def _messages(value: Any, what: str) -> Messages:
    """A non-empty list of OpenAI messages (:func:`~minigpt.data.chat.openai_messages`: known roles, text contents,
    tool calls). Raises :class:`BadLine`."""
    if not isinstance(value, list) or not value:
        raise BadLine("unknown format", f"{what!r} is not a non-empty list of messages")
    messages = openai_messages(value, repr(what))
    check_messages(messages)
    return messages


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def to_preference(record: Any) -> tuple[Any, Any, Any]:
    """A parsed JSON line in any supported layout -> ``(prompt, chosen, rejected)``, all strings or all message
    lists (validated). Raises :class:`BadLine`."""
    if not isinstance(record, dict):
        raise BadLine("unknown format", f"expected a JSON object, got {type(record).__name__}")
    if "chosen" not in record or "rejected" not in record:
        raise BadLine("unknown format", "expected 'chosen' and 'rejected' (and usually 'prompt')")
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" not in record:  # implicit prompt: the shared beginning of the two answers
        if _is_messages(chosen) and _is_messages(rejected):
            chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
            n = common_prefix(chosen, rejected)
        elif isinstance(chosen, str) and isinstance(rejected, str):
            n = common_prefix(chosen, rejected)
            if 0 < n < len(chosen) and chosen[n - 1] == " ":  # TRL: the space starts the completion
                n -= 1
        else:
            raise BadLine("unknown format", "without 'prompt', 'chosen' and 'rejected' must both be strings or "
                                            "both message lists")
        if n == 0:
            raise BadLine("empty prompt", "'chosen' and 'rejected' share no beginning to use as the prompt")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        prompt = record["prompt"]
    if isinstance(prompt, list):
        prompt = _messages(prompt, "prompt")
        chosen = [{"role": "assistant", "content": chosen}] if isinstance(chosen, str) else chosen
        rejected = [{"role": "assistant", "content": rejected}] if isinstance(rejected, str) else rejected
        chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    elif isinstance(prompt, str):
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise BadLine("unknown format", f"the prompt is a string but {name!r} is {type(value).__name__}")
            if not value.strip():
                raise BadLine("empty content" if name != "prompt" else "empty prompt", f"{name!r} is empty")
    else:
        raise BadLine("unknown format", f"'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
    if chosen == rejected:
        raise BadLine("identical answers", "'chosen' equals 'rejected'")
    return prompt, chosen, rejected


def read_preferences(path: str | Path, strict: bool = False, report: Optional[SkipReport] = None
                     ) -> list[PreferenceRecord]:
    """Validated records of a JSONL preference file (:func:`minigpt.data.chat.read_jsonl`: unusable lines, those
    that are not valid UTF-8 included, are counted in ``report`` with their line numbers).

    Raises :class:`MiniGPTError` for a missing file or a directory, and (``strict``) at the first unusable line,
    naming file and line."""
    def convert(record: Any, where: str) -> PreferenceRecord:
        prompt, chosen, rejected = to_preference(record)
        return PreferenceRecord(prompt, chosen, rejected, where, row_tools(record) if isinstance(prompt, list) else None)

    return read_jsonl(path, "preference data", convert, strict, report)


def tokenize_preference(template: ChatTemplate, record: PreferenceRecord, eos_text: Optional[str] = None,
                        eos_id: Optional[int] = None, bos_id: Optional[int] = None) -> PreferencePair:
    """Token ids of one record, the TRL way (see the module docstring). ``template`` renders conversational
    records and tokenizes standard ones (its tokenizer recognises added tokens in text, as ``transformers``' does);
    ``eos_text`` is appended to standard answers that do not end with it. A SentencePiece EOS is a control piece
    with no text (``eos_text`` empty): then ``eos_id`` is appended to the ids instead. Standard text starts with
    ``bos_id`` when given (:func:`~minigpt.data.chat.encode_plain`). Raises
    :class:`MiniGPTError` for a standard record with neither; for a conversational one, :class:`BadLine` when the
    template leaves out its tools (:func:`~minigpt.data.chat.check_tools_rendered`) and :class:`TemplateRejected`
    when it rejects the messages."""
    if record.conversational:
        tools = record.tools
        for answer in (record.chosen, record.rejected):
            check_tools_rendered(template, record.prompt + answer, tools)
        prompt_ids = template.encode(record.prompt, add_generation_prompt=True, tools=tools)
        full = [template.encode(record.prompt + answer, tools=tools) for answer in (record.chosen, record.rejected)]
    else:
        if not eos_text and eos_id is None:
            raise MiniGPTError("the tokenizer has no EOS token to end the standard (string) answers with")
        prompt_ids = encode_plain(template, record.prompt, bos_id)
        if eos_text:
            full = [encode_plain(template, record.prompt + (a if a.endswith(eos_text) else a + eos_text), bos_id)
                    for a in (record.chosen, record.rejected)]
        else:
            full = [encode_plain(template, record.prompt + a, bos_id) + [eos_id]
                    for a in (record.chosen, record.rejected)]
    n = min(common_prefix(prompt_ids, ids) for ids in full)
    return PreferencePair(prompt_ids[:n], full[0][n:], full[1][n:], record.source)


def load_preference_dataset(path: str | Path, template: Optional[ChatTemplate], max_seq_len: int,
                            eos_text: Optional[str] = None, strict: bool = False,
                            report: Optional[SkipReport] = None,
                            records: Optional[list[PreferenceRecord]] = None,
                            eos_id: Optional[int] = None, bos_id: Optional[int] = None) -> list[PreferencePair]:
    """Read (unless ``records`` are given), validate and tokenize (:func:`tokenize_preference`) a JSONL preference
    file; pairs longer than ``max_seq_len`` tokens are skipped as ``too long``. Raises :class:`MiniGPTError` when no pair is left, or
    (``strict``) at the first unusable line."""
    report = report if report is not None else SkipReport()
    if records is None:
        records = read_preferences(path, strict, report)
    pairs = []
    for record in records:
        try:
            pair = tokenize_preference(template, record, eos_text, eos_id, bos_id)
        except (BadLine, TemplateRejected, InvalidText) as e:
            if strict:
                raise MiniGPTError(f"{record.source}: {e}") from None
            report.skipped[skip_reason(e)] += 1
            continue
        if len(pair) > max_seq_len:
            reason, detail = "too long", f" ({len(pair)} tokens, the context is {max_seq_len})"
        elif not (pair.chosen_ids and pair.rejected_ids and pair.prompt_ids):
            reason, detail = "empty prompt" if not pair.prompt_ids else "empty completion", ""
        else:
            pairs.append(pair)
            continue
        if strict:
            raise MiniGPTError(f"{record.source}: {reason}{detail}")
        report.skipped[reason] += 1
    report.kept = len(pairs)
    if not pairs:
        raise MiniGPTError(f"{report.summary(str(path), 'pairs')}: no usable preference pair")
    return pairs


# ------------------------------------------------------------------------------------------------ batching
@dataclass
class PairBatch:
    """``tokens`` / ``labels`` ``[2 * batch, seq_len]`` (int64): rows ``0..batch-1`` are prompt + chosen, rows
    ``batch..2*batch-1`` prompt + rejected, right-padded; ``labels`` hold the ids on completion tokens and ``-100``
    elsewhere. ``completion_lengths`` ``[2 * batch]``: completion tokens per row. ``index``: the pairs' positions
    in their dataset (to look up precomputed reference log-probs). ``n_pad``: padding tokens."""

    tokens: torch.Tensor
    labels: torch.Tensor
    completion_lengths: torch.Tensor
    index: list[int]
    n_pad: int = 0

    def to(self, device) -> "PairBatch":
        return PairBatch(self.tokens.to(device), self.labels.to(device), self.completion_lengths.to(device),
                         self.index, self.n_pad)


def pad_pairs(pairs: list[PreferencePair], pad_id: int, index: Optional[list[int]] = None) -> PairBatch:
    """Stack ``pairs`` as chosen rows then rejected rows (TRL's ``DataCollatorForPreference`` layout), right-padded
    to the longest with ``pad_id``; padding and prompts get label ``-100``."""
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    width = max(len(a) + len(b) for a, b in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        tokens[r, :n] = torch.tensor(prompt + completion)
        labels[r, len(prompt):n] = torch.tensor(completion)
    lengths = torch.tensor([len(c) for _, c in rows], dtype=torch.long)
    real = sum(len(a) + len(b) for a, b in rows)
    return PairBatch(tokens, labels, lengths, list(index) if index is not None else list(range(len(pairs))),
                     n_pad=tokens.numel() - real)
