"""``minigpt chat``: an interactive terminal chat with a model, in-process (no server), streaming its answers; and
how prompts become token ids for every generating command.

Each turn renders the whole conversation with the model's chat template (:meth:`ChatTemplate.for_model
<minigpt.tokenizer.chat_template.ChatTemplate.for_model>`: the model's own, else the plain ``User: ... /
Assistant:`` one) and generates through a one-slot :class:`~minigpt.infer.engine.Engine`, stopping on the
tokenizer's stop ids and the template's end-of-turn token. The engine's prefix cache (:mod:`minigpt.infer.prefix_cache`,
one context's worth) keeps the conversation's keys and values between turns, so a turn prefills only what is new
since the last one (from the first token where the re-rendered conversation differs from the tokens already
computed, block-aligned). When the conversation no longer fits the context, the
oldest turns (after a system message) are dropped, and the user is told. Commands: ``/reset`` forgets the
conversation, ``/quit`` (or end of input) leaves; Ctrl-C stops the current answer.

:func:`encode_prompt` and :func:`prompt_bos` (a plain-text prompt -> ids) are shared with ``minigpt generate`` and
the server's ``/v1/completions``.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, TextIO

from minigpt.checkpoint.adapter import load_merged, tokenizer_source
from minigpt.checkpoint.native import load_chat_template, load_tokenizer, resolve_checkpoint
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.errors import MiniGPTError
from minigpt.infer.conversation import Conversation
from minigpt.infer.engine import Engine
from minigpt.infer.fastpath import load_for_inference
from minigpt.infer.request import Event
from minigpt.infer.sampling import InvalidRequest, SamplingParams, check_length
from minigpt.infer.stops import StopChecker, default_stop_ids
from minigpt.runtime import DTYPES, pick_device, run_in_thread
from minigpt.tokenizer.chat_template import ChatTemplate, TemplateRejected
from minigpt.tokenizer.prompt import encode_prompt  # noqa: F401  (re-exported)
from minigpt.tokenizer.tokenizer import Tokenizer

# Lone surrogates: the bytes of an input line that are not UTF-8 (stdin decodes them with surrogateescape).
_SURROGATES = re.compile("[\ud800-\udfff]")


def prompt_bos(source: str | Path, tokenizer: Tokenizer) -> bool:
    """Whether a plain-text prompt to the model at ``source`` starts with BOS, as its own tokenizer would encode it
    (``transformers``' ``tokenizer(text)``, llama.cpp): a GGUF's ``tokenizer.ggml.add_bos_token``; otherwise
    :func:`~minigpt.checkpoint.tokenizer_bos.adds_bos` (the ``tokenizer.json`` post-processor, ``add_bos_token``,
    Llama's SentencePiece default; MiniGPT's own byte-level BPE: no)."""
    if tokenizer.bos_id is None:
        return False
    if Path(source).suffix == ".gguf":
        return bool(tokenizer.add_bos)
    return adds_bos(source, tokenizer)


def _room(ids: list[int], context: int) -> Optional[int]:
    """How many tokens may answer the prompt ``ids`` within the context; None when none fits."""
    try:
        return check_length(len(ids), None, context)[1]
    except InvalidRequest:
        return None


def run_chat(source: str, max_tokens: int = 256, temperature: float = 0.8, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: Optional[int] = None, system: Optional[str] = None,
             device: str = "auto", dtype: str = "float32", stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
             adapter: Optional[str] = None, context: Optional[int] = None, prefix_cache: bool = True,
             compile: bool = False, stats: bool = False) -> int:
    """Run the chat loop on ``stdin``/``stdout`` until ``/quit`` or end of input; returns the exit status 0.

    ``seed``: turn ``i`` (from 0) samples with seed ``seed + i``, so a replayed conversation answers the same.
    ``adapter``: a PEFT LoRA folder merged into the weights at load. ``prefix_cache``: False prefills every turn's
    whole conversation (the answers are the same). ``compile``: no engine; the fast path's compiled decode step
    over the conversation's own cache (:class:`~minigpt.infer.conversation.Conversation`), the step compiled at the
    first answer and saved for later runs as `minigpt generate --compile` does (greedy answers are the same). ``stats``: after each answer, one line on stderr: prompt
    tokens, time to first token (s), decode tokens/s after the first token, compilation (s, excluded from both).
    Raises :class:`~minigpt.errors.MiniGPTError`
    for an unreadable checkpoint, an adapter made for another base, or sampling settings out of range (before
    loading anything).
    """
    # The sampling flags are checked before loading: they used to fail only once the first message was typed.
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise MiniGPTError(f"--max-tokens must be a positive integer, got {max_tokens!r}")
    SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    ckpt = resolve_checkpoint(source)

    def load() -> tuple[Engine | Conversation, Tokenizer, ChatTemplate]:
        words = tokenizer_source(ckpt, adapter)  # an adapter's own tokenizer and template, with tokens it added
        tokenizer = load_tokenizer(words)
        chat = ChatTemplate.for_model(tokenizer, load_chat_template(words))
        if compile:
            model = load_for_inference(ckpt, device=pick_device(device), dtype=DTYPES[dtype], compile=True,
                                       adapter=adapter, aoti=True)
            return Conversation(model, context), tokenizer, chat
        model = load_merged(ckpt, adapter, device=pick_device(device), dtype=DTYPES[dtype])
        # One slot; the prefix cache's default budget is one slot's context: the whole conversation.
        return Engine(model, tokenizer, max_batch_size=1, stop_ids=default_stop_ids(tokenizer, chat),
                      context=context, prefix_cache_bytes=None if prefix_cache else 0), tokenizer, chat

    # Loaded in a thread that ends, so that the engine's worker is the process's one OpenMP team (run_in_thread).
    loaded, tokenizer, chat = run_in_thread(load)
    conversation = loaded if isinstance(loaded, Conversation) else None
    engine = None if conversation is not None else loaded.start()
    # --context, else the model's (the engine's: within half the free memory)
    context = conversation.context if conversation is not None else engine.max_seq_len
    stop_ids = default_stop_ids(tokenizer, chat)
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    interactive = stdin.isatty()
    if callable(getattr(stdin, "reconfigure", None)):
        # A line that is not UTF-8 then reaches the template as surrogates and is refused alone (TemplateRejected),
        # instead of a UnicodeDecodeError ending the conversation in a locale whose stdin decodes strictly.
        stdin.reconfigure(errors="surrogateescape")
    out = stdout
    out.write(f"chatting with {ckpt} ({context}-token context). /reset clears the conversation, /quit leaves.\n")
    if conversation is not None:  # a step not saved yet compiles silently inside the first answer (135M: ~100 s)
        out.write("(--compile: unless this model's decode step was compiled and saved before, the first answer "
                  "waits for it to compile, a minute or more)\n")
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
                # Echo piped input so a transcript reads like a session (bytes that are not UTF-8 as U+FFFD).
                out.write(_SURROGATES.sub("\ufffd", text) + "\n")
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
            try:
                ids = chat.prompt(history)
                room, dropped = _room(ids, context), False
                while room is None and len(history) > len(base) + 1:
                    del history[len(base):len(base) + 2]
                    ids = chat.prompt(history)
                    room, dropped = _room(ids, context), True
            except TemplateRejected as e:
                history.pop()
                out.write(f"({e})\n")
                continue
            if room is None:
                history.pop()
                out.write(f"(that message alone is {len(ids)} tokens; the context is {context})\n")
                continue
            if dropped:
                out.write("(older turns were dropped to fit the context)\n")
            params = SamplingParams(max_tokens=min(max_tokens, room), temperature=temperature, top_k=top_k,
                                    top_p=top_p, stop=chat.stop, seed=None if seed is None else seed + turn)
            turn += 1
            out.write("assistant> ")
            out.flush()
            reply = []
            if conversation is not None and not prefix_cache:
                conversation.reset()
            events = (engine.generate(ids, params) if conversation is None
                      else _answer(conversation, tokenizer, ids, params, stop_ids))
            clock = _AnswerClock(conversation)
            try:
                for ev in events:
                    clock.tick(ev.completion_tokens)
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
            if stats:
                print(clock.line(len(ids)), file=sys.stderr, flush=True)
            history.append({"role": "assistant", "content": "".join(reply).strip()})
    except KeyboardInterrupt:
        out.write("\n")
    finally:
        if engine is not None:
            engine.close()
    return 0


def _answer(conversation: Conversation, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams,
            stop_ids: list[int]) -> Iterator[Event]:
    """An answer of ``conversation`` as the engine's events: each piece of text once it is final (text that could
    start a stop string held back), or one error event."""
    stops = StopChecker(tokenizer, stop=params.stop)
    tokens = conversation.generate(prompt, params, stop_ids)
    n = 0
    try:
        for n, token in enumerate(tokens, 1):
            yield Event(text=stops.push(token), completion_tokens=n)
            if stops.stopped:
                return
        yield Event(text=stops.finish(), completion_tokens=n)
    except InvalidRequest as e:
        yield Event(error=str(e))
    finally:
        tokens.close()


class _AnswerClock:
    """``--stats`` of one answer: time to first token, and the decode rate of the tokens after it, compilation
    (the compiled step's first call at a new cache length) excluded as `minigpt generate --stats` does."""

    def __init__(self, conversation: Optional[Conversation]) -> None:
        self.model = conversation.model if conversation is not None else None
        self.start, self.first, self.last, self.tokens = time.perf_counter(), None, None, 0
        self.compiled = self.first_compiled = self._compile_seconds()

    def _compile_seconds(self) -> float:
        return getattr(self.model, "compile_seconds", 0.0)

    def tick(self, tokens: int) -> None:
        """An event that reports ``tokens`` generated so far."""
        if tokens > self.tokens:
            self.last, self.tokens = time.perf_counter(), tokens
            if self.first is None:
                self.first, self.first_compiled = self.last, self._compile_seconds()

    def line(self, prompt_tokens: int) -> str:
        if self.first is None:
            return f"[prompt {prompt_tokens} tokens | no answer tokens]"
        compile_s = self._compile_seconds() - self.compiled
        decode_s = self.last - self.first - (self._compile_seconds() - self.first_compiled)
        rate = f"{(self.tokens - 1) / decode_s:.2f} tokens/s" if self.tokens > 1 and decode_s > 0 else "n/a"
        ttft = self.first - self.start - (self.first_compiled - self.compiled)
        return (f"[prompt {prompt_tokens} tokens | time to first token {ttft:.2f} s | decode {rate} "
                f"({self.tokens} tokens) | compile {compile_s:.2f} s]")
