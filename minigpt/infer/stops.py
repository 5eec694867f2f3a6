"""Where a generation ends: stop token ids and stop strings, and which streamed text is safe to show.

A stop id ends the generation and is not part of the completion. A stop string ends it at the token whose text
completes it; that token stays in the completion's ids but the text is cut before the stop string, which is never
returned. While streaming, text that could be the beginning of a stop string is held back until the next tokens
show whether it is (then it is dropped) or not (then it is released). The same rule as OpenAI's ``stop``.

A completion's text is decoded in the context of its prompt (:func:`decode_context`): the difference between
decoding the prompt's last tokens with and without the new ids, as vLLM's incremental detokenizer (prefix and read
offsets) does. Decoded alone, a sentencepiece completion would lose the leading space of its first piece
(``"▁upon"`` -> ``"upon"``), so that prompt + completion read ``"Onceupon"``; a byte-level BPE (``"Ġupon"``)
decodes the same either way. :func:`leading_text` is that difference for a text already decoded alone.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional, Sequence

from minigpt.tokenizer.chat_template import ChatTemplate
from minigpt.tokenizer.tokenizer import StreamDecoder, Tokenizer


def default_stop_ids(tokenizer: Optional[Tokenizer], chat: Optional[ChatTemplate] = None) -> list[int]:
    """The ids that end a generation by default, in order: every id of ``tokenizer.stop_ids`` (EOS, the
    ``eos_token_id`` list of generation_config.json, a GGUF's end-of-turn / end-of-message ids; see
    :attr:`~minigpt.tokenizer.tokenizer.Tokenizer.stop_ids`), EOS if missing there, BOS when it differs
    (llama2.c-style models start each new story with BOS), and with a ``chat`` template its end-of-turn token
    (:attr:`~minigpt.tokenizer.chat_template.ChatTemplate.end_of_turn_id`: ``<|im_end|>``, ``<|eot_id|>``), which
    a base model's files may not list. Empty without a tokenizer.

    Transformers' ``generate`` stops on the generation config's EOS list and llama.cpp on every end-of-generation
    token; this is their union, as the model's own files state it."""
    if tokenizer is None:
        return []
    # getattr: duck-typed tokenizers (tests, adapters) may only have eos_id / bos_id.
    ids = [int(i) for i in getattr(tokenizer, "stop_ids", ())]
    extra = (tokenizer.eos_id, tokenizer.bos_id, chat.end_of_turn_id if chat is not None else None)
    ids += [i for i in extra if i is not None]
    return list(dict.fromkeys(ids))


CONTEXT_TOKENS = 4  # prompt tokens decoded before a completion's ids (vLLM keeps 5 before its read offset)

_special_ids: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of ``tokenizer``'s special tokens (:attr:`~minigpt.tokenizer.tokenizer.Tokenizer.special_tokens`,
    BOS, EOS, pad), computed once per tokenizer; duck-typed tokenizers may lack any of them."""
    try:
        return _special_ids[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = set(getattr(tokenizer, "special_tokens", {}).values())
    ids.update(i for i in (getattr(tokenizer, n, None) for n in ("bos_id", "eos_id", "pad_id")) if i is not None)
    found = frozenset(int(i) for i in ids)
    try:
        _special_ids[tokenizer] = found
    except TypeError:  # not weakly referenceable: computed each time
        pass
    return found


def decode_context(tokenizer, prompt: Sequence[int]) -> list[int]:
    """The left context a completion of ``prompt`` is decoded in: the last :data:`CONTEXT_TOKENS` ids of
    ``prompt`` after its last special token (so a completion after BOS alone, or after a template's special token,
    starts as a text of its own on both back ends: sentencepiece decodes BOS to nothing, ``tokenizers`` to
    ``"<s>"``), less trailing ids whose bytes leave a character incomplete (they stay the prompt's: the
    completion's continuation bytes then decode as they would alone). Empty without a tokenizer."""
    if tokenizer is None:
        return []
    specials = special_ids(tokenizer)
    tail: list[int] = []
    for token in reversed(prompt):
        if len(tail) == CONTEXT_TOKENS or int(token) in specials:
            break
        tail.append(int(token))
    tail.reverse()
    while tail and tokenizer.decode(tail).endswith("\ufffd"):
        tail.pop()
    return tail


def leading_text(tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The whitespace that decoding ``ids`` (a completion's first tokens) on their own drops at their start and
    decoding them after ``prompt`` (its :func:`decode_context`) keeps: ``" "`` for a sentencepiece ``"▁upon"``
    after ``"Once"``, ``""`` for a byte-level BPE, after an empty prompt or BOS alone. So a text decoded alone (a
    :class:`StopChecker` without context) reads ``leading_text(...) + text`` in context."""
    context = decode_context(tokenizer, prompt)
    if not context or not ids:
        return ""
    before, full = tokenizer.decode(context), tokenizer.decode([*context, *ids])
    alone = tokenizer.decode(ids)
    if not full.startswith(before) or not full.endswith(alone):
        return ""
    lead = full[len(before):len(full) - len(alone)]
    return lead if lead.isspace() else ""


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a stop string (kept until resolved)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopChecker:
    """The stop handling of one generation, fed token by token; detokenizes when given a tokenizer.

    * :meth:`push` (each generated token) returns the text that became safe to show; afterwards :attr:`stopped`
      says whether the generation ends here (a stop id or a stop string) and :attr:`kept` whether the token belongs
      to the completion (False only for a stop id).
    * :meth:`finish` ends a generation that stopped for another reason (its token budget): it returns the rest of
      the text (the decoder's pending bytes and the held-back text), still cut at a stop string.

    :attr:`text` is the completion's text so far, cut before the first stop string. Without a tokenizer there is no
    text and stop strings cannot apply (only ``stop_ids`` stop).

    ``context``: the prompt's ids (its last few are used, see :func:`decode_context`): the text is decoded after
    them, so the first piece keeps its leading space (``" upon"`` after ``"Once"``) and prompt + text is the text
    of prompt + completion. Without it the text starts as a text of its own (``"upon"``): what a chat answer
    wants, whose separating space belongs to the template.
    """

    def __init__(self, tokenizer: Optional[Tokenizer] = None, stop_ids: Iterable[int] = (),
                 stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self.decoder = StreamDecoder(tokenizer, decode_context(tokenizer, context)) if tokenizer is not None else None
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.stop = tuple(stop) if self.decoder is not None else ()
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0  # len(text) already returned
        self.stopped = False
        self.kept = True

    def push(self, token: int) -> str:
        """Take one generated token; returns the newly safe text (often ``""``)."""
        if self.stopped:
            raise RuntimeError("this generation has stopped already")
        if token in self.stop_ids:
            self.stopped, self.kept = True, False
            return self._add(self.decoder.flush() if self.decoder else "", final=True)
        return self._add(self.decoder.push(token) if self.decoder else "", final=False)

    def finish(self) -> str:
        """End the generation here (budget reached); returns the text still held back. Idempotent."""
        if self.stopped:
            return ""
        return self._add(self.decoder.flush() if self.decoder else "", final=True)

    def _add(self, piece: str, final: bool) -> str:
        start = len(self.text)
        self.text += piece
        safe = len(self.text)
        if self.stop:
            # Earlier text held no stop string, so only one ending in the new piece can start this late.
            lo = max(0, start - self._longest + 1)
            hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                safe, self.stopped = len(self.text), True
            elif not final:
                safe -= held_back(self.text, self.stop)
        out = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return out
