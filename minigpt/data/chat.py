"""Chat data for supervised fine-tuning: JSONL conversations -> token ids with loss labels -> padded or packed batches.

Input: one JSON object per line, in any of five layouts, converted on load to OpenAI's ``messages`` (all but
prompt-completion and text records):

* OpenAI / TRL: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...], "tools"?}``
  (multi-turn; a content may also be a list of text parts, ``[{"type": "text", "text": str}, ...]``, which are
  joined; tool use below);
* TRL's prompt-completion: ``{"prompt": [messages], "completion": [messages]}`` (through the chat template) or
  ``{"prompt": str, "completion": str}`` (the strings joined, no template, EOS appended), kept as a
  :class:`PromptCompletion`: only the completion is scored, as TRL's ``SFTTrainer`` does for this layout;
* TRL's language modeling: ``{"text": str}`` -> the text and EOS, every token scored;
* Alpaca (Taori et al. 2023): ``{"instruction", "input", "output"}`` -> one user turn (``instruction``, plus
  ``"\\n\\n" + input`` when ``input`` is non-empty, the rule of the data in ``shared/data/sft``) and one assistant turn;
* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...], "system"?}``; with tools
  as LLaMA-Factory writes them: ``function_call`` turns (a JSON ``{"name", "arguments"}`` or a list of them: an
  assistant's calls), ``observation`` turns (a tool's result) and a ``tools`` JSON string.

A line that cannot be used (not valid UTF-8, invalid JSON, unknown layout or role, empty content, no assistant turn,
a malformed tool call or ``tools``, messages the template rejects or whose tools it leaves out, longer than the
model's context once rendered) is skipped and counted; :class:`SkipReport` prints one summary line
(with the line numbers of the lines that are not UTF-8). With ``strict=True`` the first such line raises
:class:`~minigpt.errors.MiniGPTError` naming ``file:line`` instead.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` and holds ``-100`` (ignored)
everywhere except the assistant turns' tokens, their closing ``<|im_end|>`` included (``train_on_prompt``: every
token); the model's logits at position ``t`` are scored against ``labels[t + 1]``
(:func:`minigpt.data.chat_batches.masked_lm_loss`, beside the padded and packed batches).

Tool use, as TRL reads it: a row's ``tools`` column (function definitions, or a JSON string of them) is given to the
chat template; assistant messages may carry OpenAI ``tool_calls`` (their ``arguments`` decoded to objects, as the
server does) with no content, and ``tool`` messages hold the results. Calls are assistant tokens, scored; results
are not. A template that leaves any of them out of the text skips the row (``tools not rendered``); the default
ChatML writes them in the Hermes format (:mod:`minigpt.tokenizer.chat_template`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from minigpt.data.text import utf8_message
from minigpt.errors import MiniGPTError, json_loads, shown_json
from minigpt.tokenizer.chat_template import ChatTemplate, TemplateRejected
from minigpt.tokenizer.text import InvalidText
from minigpt.tokenizer.tool_messages import BadToolPart, template_tool_calls, tool_names, tools_column

IGNORE_INDEX = -100  # PyTorch's cross_entropy default ignore_index, and Hugging Face's label convention
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "system": "system", "observation": "tool", "function_call": "assistant"}


@dataclass
class ChatExample:
    """One tokenized conversation: ``input_ids`` and ``labels`` (same length, ``-100`` = not scored); ``source``
    is ``file:line``."""

    input_ids: list[int]
    labels: list[int]
    source: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_targets(self) -> int:
        """Tokens the loss scores (the first token is never predicted)."""
        return sum(1 for y in self.labels[1:] if y != IGNORE_INDEX)


NOT_UTF8 = "not valid UTF-8"  # the reason of a line whose bytes do not decode (always shown with its line numbers)
SHOWN_LINES = 5  # line numbers a summary lists per reason at most


@dataclass
class SkipReport:
    """Counts of lines kept and skipped by reason (``invalid JSON``, ``unknown role``...); ``lines``: the line
    numbers of the skipped lines of :func:`read_jsonl`, by reason."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    lines: dict[str, list[int]] = field(default_factory=dict)

    def skip(self, reason: str, lineno: Optional[int] = None) -> None:
        """Count one skipped line (``lineno``: its 1-based line number, when known)."""
        self.skipped[reason] += 1
        if lineno is not None:
            self.lines.setdefault(reason, []).append(lineno)

    def summary(self, name: str, unit: str = "conversations") -> str:
        """One line: ``NAME: 98 conversations, 2 skipped (invalid JSON 1, too long 1)`` (``unit``: what is kept);
        lines that are not UTF-8 also get their line numbers: ``not valid UTF-8 2 [lines 7, 9]``."""
        n = sum(self.skipped.values())
        reasons = ", ".join(f"{reason} {count}{self._where(reason)}" for reason, count in sorted(self.skipped.items()))
        return f"{name}: {self.kept} {unit}" + (f", {n} skipped ({reasons})" if n else "")

    def _where(self, reason: str) -> str:
        numbers = self.lines.get(reason, []) if reason == NOT_UTF8 else []
        if not numbers:
            return ""
        shown = ", ".join(map(str, numbers[:SHOWN_LINES])) + (", ..." if len(numbers) > SHOWN_LINES else "")
        return f" [line{'s' if len(numbers) > 1 else ''} {shown}]"


class BadLine(ValueError):
    """A line that cannot be used; ``reason`` is the short counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


def content_text(content: Any) -> Any:
    """A message's ``content`` as text: a string as it is; a list of OpenAI text parts (``[{"type": "text",
    "text": ...}, ...]``, the chat completions API's other form, which exported conversations keep) joined without
    a separator, as ``minigpt serve`` joins them; anything else unchanged, for the caller to reject. Raises
    :class:`BadLine` for a part that is not text (an image, audio)."""
    if not isinstance(content, list) or not content:
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadLine("content not text", f"a content part of type {kind!r}; only text parts are read")
        texts.append(part["text"])
    return "".join(texts)


class Conversation(list):
    """A conversation's messages (a list of OpenAI message dicts) and its row's ``tools``: the function
    definitions the chat template is given (TRL's ``tools`` column), or None."""

    def __init__(self, messages: Iterable[dict[str, Any]] = (), tools: Optional[list[dict]] = None) -> None:
        super().__init__(messages)
        self.tools = tools


def openai_messages(raw: Any, what: str) -> list[dict[str, Any]]:
    """Messages with their ``role`` and text ``content``; an assistant's ``tool_calls`` (decoded as the server
    decodes them: :func:`~minigpt.tokenizer.tool_messages.template_tool_calls`; its content may then be absent)
    and a tool message's ``tool_call_id`` and ``name`` are kept."""
    if not isinstance(raw, list):
        raise BadLine("unknown format", f"{what} is not a list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m:
            raise BadLine("unknown format", f"a message of {what} is not an object with a 'role'")
        message = {"role": m["role"], "content": content_text(m.get("content"))}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            try:
                message["tool_calls"] = template_tool_calls(m["tool_calls"], f"{what}[{i}].tool_calls")
            except BadToolPart as e:
                raise BadLine("bad tool call", str(e)) from None
            if message["content"] is None:
                message["content"] = ""
        elif m["role"] == "tool":
            message.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        messages.append(message)
    return messages


def _sharegpt_calls(value: Any, i: int) -> list[dict]:
    """The calls of LLaMA-Factory's ShareGPT ``function_call`` turn (a JSON string of ``{"name", "arguments"}`` or
    of a list of them) as OpenAI ``tool_calls`` for the template. Raises :class:`BadLine`."""
    where = f"'conversations'[{i}].value"
    try:
        calls = json_loads(value) if isinstance(value, str) else value
    except ValueError:
        raise BadLine("bad tool call", f"{where} is not JSON") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) for c in calls):
        raise BadLine("bad tool call", f"{where} must hold {{'name', 'arguments'}} or a list of them")
    try:
        return template_tool_calls([{"type": "function", "function": {"name": c.get("name"),
                                                                      "arguments": c.get("arguments", {})}}
                                    for c in calls], where)
    except BadToolPart as e:
        raise BadLine("bad tool call", str(e)) from None


def row_tools(record: dict) -> Optional[list[dict]]:
    """The row's ``tools`` column (:func:`~minigpt.tokenizer.tool_messages.tools_column`); :class:`BadLine` if
    malformed."""
    try:
        return tools_column(record.get("tools"))
    except BadToolPart as e:
        raise BadLine("bad tools", str(e)) from None


def to_messages(record: Any) -> Conversation:
    """A parsed JSON line in any supported layout -> validated OpenAI ``messages`` and the row's ``tools``. Raises
    :class:`BadLine`."""
    if not isinstance(record, dict):
        raise BadLine("unknown format", f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = openai_messages(record["messages"], "'messages'")
    elif "conversations" in record:
        raw = record["conversations"]
        if not isinstance(raw, list):
            raise BadLine("unknown format", "'conversations' is not a list")
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or "from" not in m:
                raise BadLine("unknown format", "a ShareGPT turn is not an object with 'from'")
            if not isinstance(m["from"], str) or m["from"] not in SHAREGPT_ROLES:
                raise BadLine("unknown role", shown_json(m["from"]))
            if m["from"] == "function_call":
                messages.append({"role": "assistant", "content": "", "tool_calls": _sharegpt_calls(m.get("value"), i)})
            else:
                messages.append({"role": SHAREGPT_ROLES[m["from"]], "content": m.get("value")})
    elif "instruction" in record and "output" in record:
        prompt, extra = record["instruction"], record.get("input") or ""
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
        if record.get("system"):
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise BadLine("unknown format", "expected 'messages', 'prompt'/'completion', 'text', 'conversations' or "
                                        "'instruction'/'output'")
    check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadLine("no assistant turn")
    return Conversation(messages, row_tools(record))


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Raise :class:`BadLine` for an unknown role, a content that is not a string, or an empty one (allowed for an
    assistant message with calls and for a tool's result)."""
    for m in messages:
        if m["role"] not in ROLES:
            raise BadLine("unknown role", shown_json(m["role"]))
        if not isinstance(m["content"], str):
            raise BadLine("content not text", f"a {m['role']} message's content is a JSON "
                          f"{type(m['content']).__name__}, not a string")
        # A call may come without words, and a tool may answer with an empty string.
        if not m["content"].strip() and not m.get("tool_calls") and m["role"] != "tool":
            raise BadLine("empty content", f"a {m['role']} message")


@dataclass(frozen=True)
class PromptCompletion:
    """A record of TRL's prompt-completion layout: ``prompt`` and ``completion`` both non-empty strings (standard)
    or both lists of validated messages (conversational, with the row's ``tools``). Only the completion is scored,
    as TRL's ``completion_only_loss`` does for this layout (:func:`tokenize_conversation`)."""

    prompt: Any
    completion: Any
    tools: Optional[list[dict]] = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def to_record(record: Any) -> "list[dict[str, str]] | PromptCompletion":
    """A parsed JSON line -> a :class:`PromptCompletion` (``prompt`` and ``completion`` keys; or TRL's standard
    language-modeling row, ``{"text": str}``, a completion with an empty prompt: every token scored) or validated
    ``messages`` (:func:`to_messages`). Raises :class:`BadLine`."""
    if isinstance(record, dict) and set(record) & {"text", "messages", "prompt", "conversations", "instruction"} \
            == {"text"}:
        if not isinstance(record["text"], str) or not record["text"].strip():
            raise BadLine("empty content", "'text' is not a non-empty string")
        return PromptCompletion("", record["text"])
    if not isinstance(record, dict) or "messages" in record or not ("prompt" in record and "completion" in record):
        return to_messages(record)
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt, completion = openai_messages(prompt, "'prompt'"), openai_messages(completion, "'completion'")
        if not prompt or not completion:
            raise BadLine("unknown format", "'prompt' and 'completion' must not be empty lists")
        check_messages(prompt + completion)
        if not any(m["role"] == "assistant" for m in completion):
            raise BadLine("no assistant turn", "the completion has no assistant message")
        return PromptCompletion(prompt, completion, row_tools(record))
    elif isinstance(prompt, str) and isinstance(completion, str):
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not value.strip():
                raise BadLine("empty content", f"{name!r} is empty")
    else:
        raise BadLine("unknown format", "'prompt' and 'completion' must both be strings or both message lists")
    return PromptCompletion(prompt, completion)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


T = TypeVar("T")


def read_jsonl(path: str | Path, what: str, convert: Callable[[Any, str], T], strict: bool = False,
               report: Optional[SkipReport] = None) -> list[T]:
    """``convert(record, "file:line")`` of every JSON line of ``path``; a line that is not valid UTF-8, not JSON, or
    that ``convert`` rejects with :class:`BadLine` is counted in ``report`` with its line number (or, ``strict``,
    raises :class:`MiniGPTError` naming file and line). Blank lines are ignored.

    Raises :class:`MiniGPTError` when ``path`` is missing or a directory (``what`` names the file in the message),
    and, ``strict``, at the first unusable line.
    """
    path = Path(path)
    if path.is_dir():
        raise MiniGPTError(f"{what} file {path} is a directory; give a .jsonl file")
    if not path.is_file():
        raise MiniGPTError(f"{what} file {path} does not exist")
    report = report if report is not None else SkipReport()
    out = []
    offset = 0  # of the line's first byte, for the message about a byte that is not UTF-8
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if strict:
                    raise MiniGPTError(utf8_message(path, start + e.start, e) + f" (line {lineno})") from None
                report.skip(NOT_UTF8, lineno)
                continue
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                try:
                    record = json_loads(line)
                except ValueError as e:  # bad syntax, nesting thousands deep, an integer of thousands of digits
                    raise BadLine("invalid JSON", str(e)) from None
                out.append(convert(record, where))
            except BadLine as e:
                if strict:
                    raise MiniGPTError(f"{where}: {e}") from None
                report.skip(e.reason, lineno)
    report.kept = len(out)
    return out


def read_conversations(path: str | Path, strict: bool = False, report: Optional[SkipReport] = None
                       ) -> list[tuple[str, "list[dict[str, str]] | PromptCompletion"]]:
    """``[(file:line, messages or PromptCompletion), ...]`` of a JSONL file (:func:`read_jsonl`, :func:`to_record`)."""
    return read_jsonl(path, "chat data", lambda record, where: (where, to_record(record)), strict, report)


def encode_plain(template: ChatTemplate, text: str, bos_id: Optional[int] = None) -> list[int]:
    """Token ids of plain ``text`` (no chat template) as ``transformers``' ``tokenizer(text)`` gives them, which
    TRL's trainers use for standard (string) rows: ``bos_id`` first when given (the model's tokenizer prepends BOS
    by default: :func:`~minigpt.checkpoint.tokenizer_bos.adds_bos`), unless the text already starts with it."""
    ids = template.encode_text(text)
    return [bos_id] + ids if bos_id is not None and ids[:1] != [bos_id] else ids


def tokenize_conversation(template: ChatTemplate, messages: "list[dict[str, str]] | PromptCompletion",
                          train_on_prompt: bool = False, source: str = "", bos_id: Optional[int] = None
                          ) -> ChatExample:
    """Render and tokenize one conversation; labels are the ids on assistant tokens (every id with
    ``train_on_prompt``) and ``-100`` elsewhere.

    A :class:`PromptCompletion` is tokenized as TRL's ``SFTTrainer`` tokenizes that layout: the ids of prompt +
    completion (conversational: through the chat template; standard: the two strings joined, with the tokenizer's
    EOS text appended to the completion unless it ends with it, or the EOS id where that token has no text), and
    labels only after the longest prefix those ids share with the prompt's own ids (conversational: the prompt
    with the generation prompt). Standard text is encoded by :func:`encode_plain` (``bos_id``).

    The record's ``tools`` (:class:`Conversation`, :class:`PromptCompletion`) are given to the template, as TRL
    gives a row's ``tools`` column. Raises :class:`BadLine` (``tools not rendered``) when the record has tools,
    tool calls or tool results and the template leaves any of them out of the text (a template without a tools
    section: training on it would teach answers to questions the model never saw), :class:`TemplateRejected` when
    the template rejects the messages, and :class:`MiniGPTError` for a standard record when the tokenizer has no
    EOS."""
    tools = getattr(messages, "tools", None)
    if not isinstance(messages, PromptCompletion):
        check_tools_rendered(template, messages, tools)
        ids, mask = template.encode_with_mask(messages, tools)
        labels = [i if (m or train_on_prompt) else IGNORE_INDEX for i, m in zip(ids, mask)]
        return ChatExample(ids, labels, source)
    record = messages
    if record.conversational:
        check_tools_rendered(template, record.prompt + record.completion, tools)
        prompt_ids = template.encode(record.prompt, add_generation_prompt=True, tools=tools)
        ids = template.encode(record.prompt + record.completion, tools=tools)
    else:
        tok = template.tokenizer
        if tok.eos_id is None:
            raise MiniGPTError("the tokenizer has no EOS token to end the standard (string) completions with")
        eos_text = tok.decode([tok.eos_id])
        prompt_ids = encode_plain(template, record.prompt, bos_id)
        if eos_text:
            completion = record.completion if record.completion.endswith(eos_text) else record.completion + eos_text
            ids = encode_plain(template, record.prompt + completion, bos_id)
        else:
            ids = encode_plain(template, record.prompt + record.completion, bos_id) + [tok.eos_id]
    start = 0 if train_on_prompt or not record.prompt else common_prefix(prompt_ids, ids)
    return ChatExample(ids, [IGNORE_INDEX] * start + ids[start:], source)


def skip_reason(e: Exception) -> str:
    """The counted reason of a row that tokenizing rejected (a :class:`BadLine`, a template's rejection, text that
    is not valid Unicode: a lone surrogate from a JSON escape, in a row that no template renders)."""
    if isinstance(e, BadLine):
        return e.reason
    return "template rejected" if isinstance(e, TemplateRejected) else "not valid Unicode"


TOOLS_HINT = "train with a template that writes tools (--template chatml, the built-in ChatML, does)"


def check_tools_rendered(template: ChatTemplate, messages: list[dict[str, Any]], tools: Optional[list[dict]]) -> None:
    """Raise :class:`BadLine` (``tools not rendered``) unless the rendered text names every defined tool and every
    call, and holds every tool result. Nothing is rendered for a conversation without any of them."""
    calls = [c["function"]["name"] for m in messages for c in m.get("tool_calls") or []]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if not (tools or calls or results):
        return
    text = template.render(messages, tools=tools)
    for kind, values in (("tool", tool_names(tools)), ("call of", calls), ("tool result", results)):
        missing = next((v for v in values if v not in text), None)
        if missing is not None:
            raise BadLine("tools not rendered", f"the chat template leaves out the {kind} {missing[:40]!r}; "
                          + TOOLS_HINT)


def is_plain(record: "list[dict[str, str]] | PromptCompletion") -> bool:
    """True for a standard (string) prompt-completion or text row, which goes through no chat template."""
    return isinstance(record, PromptCompletion) and not record.conversational


def load_chat_dataset(path: str | Path, template: ChatTemplate, max_seq_len: int, train_on_prompt: bool = False,
                      strict: bool = False, report: Optional[SkipReport] = None, bos_id: Optional[int] = None,
                      records: Optional[list] = None) -> list[ChatExample]:
    """Read, convert, render and tokenize a JSONL chat file; conversations longer than ``max_seq_len`` tokens are
    skipped as ``too long`` (never truncated: a cut conversation would teach the model to stop mid-answer).

    ``report`` (filled in) gives the counts; ``strict`` raises :class:`MiniGPTError` on the first unusable line;
    ``bos_id``: what standard rows start with (:func:`tokenize_conversation`); ``records``: what
    :func:`read_conversations` read from ``path`` already. Raises :class:`MiniGPTError` when no conversation is
    left.
    """
    report = report if report is not None else SkipReport()
    examples = []
    for where, messages in (records if records is not None else read_conversations(path, strict, report)):
        try:
            example = tokenize_conversation(template, messages, train_on_prompt, where, bos_id)
        except (BadLine, TemplateRejected, InvalidText) as e:
            reason = skip_reason(e)
            if strict:
                raise MiniGPTError(f"{where}: {e}") from None
            report.skipped[reason] += 1
            continue
        if len(example) > max_seq_len or example.n_targets == 0:
            reason = "too long" if len(example) > max_seq_len else "no assistant tokens"
            if strict:
                raise MiniGPTError(f"{where}: {reason} ({len(example)} tokens, the context is {max_seq_len})")
            report.skipped[reason] += 1
            continue
        examples.append(example)
    report.kept = len(examples)
    if not examples:
        hint = f"; {TOOLS_HINT}" if report.skipped.get("tools not rendered") else ""
        raise MiniGPTError(f"{report.summary(str(path))}: no usable conversation{hint}")
    return examples
