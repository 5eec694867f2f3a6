"""``minigpt chat``: an interactive terminal chat with a model, in-process (no server), streaming its answers.

Each turn renders the whole conversation with the model's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`) and
generates through a one-slot :class:`~minigpt.infer.engine.Engine`. When the conversation no longer fits the
context, the oldest turns (after a system message) are dropped, and the user is told. Commands: ``/reset`` forgets
the conversation, ``/quit`` (or end of input) leaves; Ctrl-C stops the current answer.

:class:`ChatFormatter` (messages -> prompt ids) is shared with ``minigpt serve``.
"""
from __future__ import annotations

import sys
from typing import Optional, TextIO

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine
from minigpt.infer.sampling import InvalidRequest, SamplingParams, check_length
from minigpt.runtime import DTYPES, pick_device
from minigpt.tokenizer.tokenizer import Tokenizer

# Used when the model ships no chat template: one "Role: content" line per message, then "Assistant:". The model
# is told where its turn ends by an implicit stop string DEFAULT_CHAT_STOP (a base model trained on plain text
# would otherwise go on writing the user's next line).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
DEFAULT_CHAT_STOP = "\nUser:"


class TemplateRejected(MiniGPTError):
    """The chat template raised on these messages (e.g. roles that do not alternate)."""


class ChatFormatter:
    """Renders messages into prompt token ids with a Jinja chat template (Hugging Face's convention: variables
    ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``; ``raise_exception(msg)``) in a sandbox.

    With a model's own template, special-token strings in the rendered text (the tokenizer's BOS/EOS/pad) are
    encoded as their ids, because our :class:`Tokenizer` encodes such text literally; the messages' own text goes
    through the same split, as with ``transformers``' ``apply_chat_template``. The default template emits no special
    tokens, so with it everything is encoded as text and a user cannot inject an end-of-text token.
    """

    def __init__(self, tokenizer: Tokenizer, template: Optional[str] = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer = tokenizer
        self.is_default = not template
        self.source = template or DEFAULT_CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(self.source)
        self._specials: dict[str, int] = {}
        for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if template else ():
            if i is not None:
                text = tokenizer.decode([i])
                if text and text.strip():
                    self._specials[text] = i
        self.stop: tuple[str, ...] = (DEFAULT_CHAT_STOP,) if self.is_default else ()

    def _token_text(self, i: Optional[int]) -> str:
        return self.tokenizer.decode([i]) if i is not None else ""

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self._token_text(self.tokenizer.bos_id),
                                         eos_token=self._token_text(self.tokenizer.eos_id))
        except TemplateError as e:
            raise TemplateRejected(f"the chat template rejected the messages: {e}") from None

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.render(messages)
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            hits = [(text.find(s, pos), s) for s in self._specials]
            hits = [(i, s) for i, s in hits if i >= 0]
            if not hits:
                ids += self.tokenizer.encode(text[pos:])
                break
            i, s = min(hits)
            if i > pos:
                ids += self.tokenizer.encode(text[pos:i])
            ids.append(self._specials[s])
            pos = i + len(s)
        return ids


def _room(ids: list[int], context: int) -> Optional[int]:
    """How many tokens may answer the prompt ``ids`` within the context; None when none fits."""
    try:
        return check_length(len(ids), None, context)[1]
    except InvalidRequest:
        return None


def run_chat(source: str, max_tokens: int = 256, temperature: float = 0.8, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: Optional[int] = None, system: Optional[str] = None,
             device: str = "auto", dtype: str = "float32", stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout
             ) -> int:
    """Run the chat loop on ``stdin``/``stdout`` until ``/quit`` or end of input; returns the exit status 0.

    ``seed``: turn ``i`` (from 0) samples with seed ``seed + i``, so a replayed conversation answers the same.
    Raises :class:`~minigpt.errors.MiniGPTError` for an unreadable checkpoint.
    """
    ckpt = resolve_checkpoint(source)
    model = load_model(ckpt, device=pick_device(device), dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(ckpt)
    formatter = ChatFormatter(tokenizer, load_chat_template(ckpt))
    engine = Engine(model, tokenizer, max_batch_size=1).start()
    context = model.config.max_seq_len
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    interactive = stdin.isatty()
    out = stdout
    out.write(f"chatting with {ckpt} ({context}-token context). /reset clears the conversation, /quit leaves.\n")
    turn = 0
    try:
        while True:
            out.write("you> ")
            out.flush()
            line = stdin.readline()
            if not line:
                out.write("\n")
                break
            text = line.rstrip("\n")
            if not interactive:
                out.write(text + "\n")  # echo piped input so a transcript reads like a session
            command = text.strip()
            if command == "/quit":
                break
            if command == "/reset":
                history = list(base)
                out.write("(conversation cleared)\n")
                continue
            if not command:
                continue
            history.append({"role": "user", "content": text})
            # Keep room to answer (at least one token); drop whole user/assistant turns from the oldest.
            ids = formatter.encode(history)
            room, dropped = _room(ids, context), False
            while room is None and len(history) > len(base) + 1:
                del history[len(base):len(base) + 2]
                ids = formatter.encode(history)
                room, dropped = _room(ids, context), True
            if room is None:
                history.pop()
                out.write(f"(that message alone is {len(ids)} tokens; the context is {context})\n")
                continue
            if dropped:
                out.write("(older turns were dropped to fit the context)\n")
            params = SamplingParams(max_tokens=min(max_tokens, room), temperature=temperature, top_k=top_k,
                                    top_p=top_p, stop=formatter.stop, seed=None if seed is None else seed + turn)
            turn += 1
            out.write("assistant> ")
            out.flush()
            reply = []
            events = engine.generate(ids, params)
            try:
                for ev in events:
                    if ev.text:
                        reply.append(ev.text)
                        out.write(ev.text)
                        out.flush()
                    if ev.error:
                        out.write(f"\n(error: {ev.error})")
            except KeyboardInterrupt:
                events.close()  # cancels the generation
                out.write(" (stopped)")
            out.write("\n")
            history.append({"role": "assistant", "content": "".join(reply).strip()})
    except KeyboardInterrupt:
        out.write("\n")
    finally:
        engine.close()
    return 0
