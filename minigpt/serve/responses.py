"""The answers of ``/v1/completions`` and ``/v1/chat/completions`` (:mod:`minigpt.serve.app`): choices, their
log-probability objects, streamed chunks and usage, in the shapes of OpenAI's public API reference.

* Completions' ``choices[i].logprobs``: ``{"tokens": [str], "token_logprobs": [float | None],
  "top_logprobs": [{str: float} | None], "text_offset": [int]}``, one entry per token of the choice's text (the
  prompt's first with ``echo``; the very first prompt token has no logprob: None). As in OpenAI's legacy API and
  vLLM, a ``top_logprobs`` entry holds the ``logprobs`` most likely tokens *and* the chosen one (so up to
  ``logprobs + 1`` keys; tokens that print alike share a key). ``text_offset``: where each token's text starts in
  the choice's text, counted in characters of the tokens' own texts. A final stop id (EOS, ``stop_token_ids``) is
  listed although its text is not part of the answer, as vLLM does: lm-evaluation-harness sends ``max_tokens: 1``
  and drops the last entry.
* Chat's ``choices[i].logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}`` with ``top_logprobs`` alternatives per token.

A completion's text is decoded after its prompt: the engine decodes generated tokens on their own (what a chat
answer wants), so the whitespace lost at a completion's start (sentencepiece's ``"▁upon"`` after ``"Once"``
decodes to ``"upon"`` alone) is put back here (:func:`~minigpt.infer.stops.leading_text`): ``" upon a time"``, as
OpenAI and vLLM answer, and echo's text is prompt + completion.

A token's text is its decoded text; a token holding part of a UTF-8 character shows as ``"bytes:\\xe2\\x80"``
(OpenAI's form) and ``bytes`` gives its raw bytes (byte-level BPE and sentencepiece byte-fallback tokens are
mapped back to their bytes). Log-probabilities are the model's own (see :mod:`minigpt.infer.sampling`).

With ``n`` > 1 the choices are indexed ``0 .. n - 1``; streamed, each chunk carries one choice and its index, and
choices end independently. Usage counts the prompt once and the completion tokens of every choice (a completions
request with several prompts: every prompt once).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from minigpt.infer.request import Event
from minigpt.infer.sampling import TokenLogprob
from minigpt.infer.stops import leading_text
from minigpt.serve.schemas import ApiError, to_json
from minigpt.tokenizer.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback pieces


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table (Radford et al. 2019, the byte-level BPE of
    GPT-2's ``encoder.py``): printable Latin-1 bytes stand for themselves, the other 68 bytes are shifted to code
    points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


def error_for(event: Event) -> ApiError:
    """The error answering a request whose last event is a failure (504 timeout, 503 cancelled, 500 error)."""
    if event.finish_reason == "timeout":
        return ApiError(504, event.error or "the request timed out", "timeout_error", None, "timeout")
    if event.finish_reason == "cancelled":
        return ApiError(503, event.error or "the request was cancelled", "server_error", None, "cancelled")
    return ApiError(500, f"generation failed: {event.error}", "server_error", None, "generation_error")


class TokenText:
    """A token's text and UTF-8 bytes as logprobs show them (see the module docstring); cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        text = tok.decode([token_id])
        piece = tok.id_to_token(token_id) or ""
        if tok.backend == "sentencepiece" and "\ufffd" not in text and not tok.special_tokens.get(piece) == token_id:
            text = piece.replace("\u2581", " ")  # decoding one piece alone drops its leading space
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            raw = bytes([int(m.group(1), 16)])
        elif piece and all(c in _BYTE_LEVEL for c in piece):
            raw = bytes(_BYTE_LEVEL[c] for c in piece)
        else:
            raw = text.encode("utf-8")
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def completion_logprobs(text_of: TokenText, token_ids: Sequence[int], entries: Sequence[Optional[TokenLogprob]],
                        offset: int = 0) -> dict[str, list]:
    """Completions' logprobs object for ``token_ids`` with their ``entries`` (None: no logprob, the first prompt
    token); ``offset``: characters of the choice's text before the first token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries):
        text = text_of(token)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for i, logprob in (*entry.top, (entry.token_id, entry.logprob)):
            key = text_of(i)[0]
            top[key] = max(top.get(key, -float("inf")), logprob)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(text_of: TokenText, entries: Sequence[TokenLogprob]) -> dict[str, list]:
    """Chat's logprobs object ``{"content": [...]}`` for generated tokens' ``entries``."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}


@dataclass
class Choice:
    """What one choice gathered from its events: text, logprobs, how it ended."""

    index: int
    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the generated ids of its text (stop ids left out)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    last: Optional[Event] = None

    def add(self, ev: Event) -> None:
        self.parts.append(ev.text)
        self.ids += ev.token_ids
        self.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finished:
            self.last = ev


class Shaper:
    """Builds one request's answer or stream chunks.

    ``chat``: chat or completions shapes; ``prompt``: the prompt's token ids (for echo's logprobs); ``echo``: the
    prompt text a completion starts with (None: no echo); ``logprobs``: whether choices carry logprobs;
    ``score_only``: nothing generated is shown (``max_tokens`` 0: the prompt and its logprobs only, ending
    ``"length"``).
    """

    def __init__(self, text_of: TokenText, chat: bool, rid: str, created: int, model: str, prompt: list[int],
                 echo: Optional[str] = None, logprobs: bool = False, score_only: bool = False) -> None:
        self.text_of, self.chat, self.prompt = text_of, chat, prompt
        self.echo, self.logprobs, self.score_only = echo, logprobs, score_only
        self._offsets: dict[int, int] = {}  # streamed: characters of each choice's text so far
        self._first_ids: dict[int, list[int]] = {}  # streamed: the ids of each choice before its text begins
        self._begun: set[int] = set()  # streamed: choices whose text has begun (or ended)
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                     "model": model}

    # -------------------------------------------------------------------------------------------- non-streamed
    def answer(self, choices: list[Choice]) -> dict:
        """The whole answer of finished ``choices``."""
        shaped = [self._choice(c) for c in choices]
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion", "choices": shaped,
                "usage": self.usage([c.last for c in choices])}

    def _choice(self, c: Choice) -> dict:
        text = "" if self.score_only else self._lead(c.ids) + "".join(c.parts)
        entries = [] if self.score_only else c.logprobs
        ids = [e.token_id for e in entries]  # a final stop id included (not in the text)
        finish = "length" if self.score_only else c.last.finish_reason
        if self.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(self.text_of, entries) if self.logprobs else None,
                    "finish_reason": finish}
        logprobs = None
        if self.logprobs:
            logprobs = self._completion_logprobs(c.prompt_logprobs, ids, entries, len(self.echo or ""))
        return {"index": c.index, "text": (self.echo or "") + text, "logprobs": logprobs, "finish_reason": finish}

    def _lead(self, ids: list[int]) -> str:
        """What a completion's text decoded on its own lacks at its start (:func:`leading_text`); none for chat."""
        if self.chat or self.score_only or not ids:
            return ""
        return leading_text(self.text_of.tokenizer, self.prompt, ids)

    def _completion_logprobs(self, prompt_entries, ids: list[int], entries: list[TokenLogprob], start: int) -> dict:
        if self.echo is None or prompt_entries is None:
            return completion_logprobs(self.text_of, ids, entries, start)
        return completion_logprobs(self.text_of, [*self.prompt, *ids], [*prompt_entries, *entries])

    def usage(self, finals: Sequence[Optional[Event]]) -> dict:
        """Usage of a request's choices (their last events): the prompt once, every choice's completion tokens."""
        prompt = len(self.prompt)
        completion = 0 if self.score_only else sum(ev.completion_tokens for ev in finals if ev is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -------------------------------------------------------------------------------------------- streamed
    def _sse(self, obj: dict) -> str:
        return f"data: {to_json(obj)}\n\n"

    def role_chunks(self, n: int) -> list[str]:
        """Chat's first chunk per choice: the role, empty content."""
        return [self._sse({**self.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                for i in range(n)] if self.chat else []

    def chunks(self, index: int, ev: Event) -> list[str]:
        """The chunks an event of choice ``index`` gives: with echo, the prompt first (on the choice's first
        event); its text (and logprobs); then the finish."""
        out = []
        if self.echo is not None and index not in self._offsets:
            logprobs = None
            if self.logprobs and ev.prompt_logprobs is not None:
                logprobs = completion_logprobs(self.text_of, self.prompt, ev.prompt_logprobs)
            out.append(self._piece(index, self.echo, logprobs, None))
        offset = self._offsets.setdefault(index, len(self.echo or ""))
        text = ev.text
        if not self.chat and index not in self._begun:  # its first text carries what that text lacks at its start
            ids = self._first_ids.setdefault(index, [])
            ids += ev.token_ids
            if ev.text or ev.finished:
                self._begun.add(index)
                text = self._lead(self._first_ids.pop(index)) + text
        if not self.score_only and (text or (self.logprobs and ev.logprobs)):
            logprobs = None
            if self.logprobs and self.chat:
                logprobs = chat_logprobs(self.text_of, ev.logprobs)
            elif self.logprobs:
                logprobs = completion_logprobs(self.text_of, [e.token_id for e in ev.logprobs], ev.logprobs, offset)
                self._offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
            out.append(self._piece(index, text, logprobs, None))
        if ev.finished:
            out.append(self._piece(index, None if self.chat else "", None,
                                   "length" if self.score_only else ev.finish_reason))
        return out

    def _piece(self, index: int, text: Optional[str], logprobs: Optional[dict], finish: Optional[str]) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self._sse({**self.head, "choices": [choice]})

    def usage_chunk(self, usage: dict) -> str:
        """The last chunk of a stream with ``stream_options.include_usage``: ``usage`` (a :meth:`usage` or several
        summed), no choices."""
        return self._sse({**self.head, "choices": [], "usage": usage})


def combined_usage(shapers: list[Shaper], choices: list[Choice], n: int) -> dict:
    """The usage of a response to several prompts: every prompt once (``shapers[k]`` holds prompt ``k``, whose
    choices are ``choices[k * n:(k + 1) * n]``), the completion tokens of every choice."""
    parts = [s.usage([c.last for c in choices[k * n:(k + 1) * n]]) for k, s in enumerate(shapers)]
    return {key: sum(p[key] for p in parts) for key in parts[0]}
