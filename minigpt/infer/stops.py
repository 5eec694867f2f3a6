"""Where a generation ends: stop token ids and stop strings, and which streamed text is safe to show.

A stop id ends the generation and is not part of the completion. A stop string ends it at the token whose text
completes it; that token stays in the completion's ids but the text is cut before the stop string, which is never
returned. While streaming, text that could be the beginning of a stop string is held back until the next tokens
show whether it is (then it is dropped) or not (then it is released). The same rule as OpenAI's ``stop``.
"""
from __future__ import annotations

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
    """

    def __init__(self, tokenizer: Optional[Tokenizer] = None, stop_ids: Iterable[int] = (),
                 stop: Sequence[str] = ()) -> None:
        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
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
