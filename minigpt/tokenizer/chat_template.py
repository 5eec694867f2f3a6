"""Chat templates: messages -> text -> token ids, with the span of every assistant turn, the Hugging Face way.

A chat template is a Jinja string rendered with ``messages`` (a list of ``{"role", "content"}``, plus ``tool_calls``
/ ``tool_call_id`` in tool conversations), ``tools`` (function definitions, or None), ``add_generation_prompt`` and
the tokenizer's special-token strings (``bos_token``, ``eos_token``...), in a sandbox
with ``trim_blocks`` / ``lstrip_blocks``, ``raise_exception(msg)`` and a ``tojson`` that does not escape HTML: the
conventions of ``transformers``' ``apply_chat_template``. The rendered text is then tokenized with the tokenizer's
added tokens (``<|im_start|>``...) recognised as single ids, also as ``transformers`` does (so a message containing
the literal text ``<|im_end|>`` gets that token, exactly as there).

Assistant spans, for loss masking, come from ``{% generation %} ... {% endgeneration %}`` blocks when the template
has them (``transformers``' ``return_assistant_tokens_mask`` convention, used by TRL's training templates); a
template without them is rendered once per assistant turn, and the turn's span is what rendering it appends after
the generation prompt of the turns before it (the template must then be prefix-stable, which ChatML is).

:data:`CHATML_TEMPLATE` is ChatML (OpenAI's Chat Markup Language, used by Qwen): ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``
per message; given ``tools``, or messages with ``tool_calls`` or the ``tool`` role, it writes them in the Hermes
format that Qwen2.5 uses too (definitions in ``<tools>``, calls in ``<tool_call>`` blocks, results in
``<tool_response>``). :data:`CHATML_TRAINING_TEMPLATE` renders the same text with generation blocks around each
assistant turn's ``CONTENT<|im_end|>``; models are saved with the plain one, which every Jinja consumer understands.
:data:`PLAIN_TEMPLATE` is the fallback for a model that ships no template (``Role: content`` lines, then
``Assistant:``), with the stop string :data:`PLAIN_STOP`.

At inference (``minigpt chat``, ``minigpt generate --chat``, the server's chat endpoint) a
:meth:`ChatTemplate.for_model` renders the conversation with ``add_generation_prompt=True``; generation ends on the
tokenizer's stop ids plus the template's end-of-turn token (:attr:`ChatTemplate.end_of_turn_id`, e.g.
``<|im_end|>`` or ``<|eot_id|>``) and on the strings of :attr:`ChatTemplate.stop`.
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from minigpt.errors import MiniGPTError, one_line, shown_json
from minigpt.tokenizer.interop import build_tokenizer, vocab_from_file
from minigpt.tokenizer.roles import TokenRoles
from minigpt.tokenizer.template_sandbox import CLOSE_MARK, OPEN_MARK, environment, render_bounds
from minigpt.tokenizer.text import backend_errors
from minigpt.tokenizer.tokenizer import InvalidText, Tokenizer, check_text

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)

# Tools in the Hermes function-calling format (NousResearch's Hermes 2 Pro; Qwen2.5 writes the same tags): the
# definitions as JSON lines within <tools></tools> in a system turn, each call as a block
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> in the assistant's turn, each result as a user turn
# holding <tool_response>\n...\n</tool_response>. The server parses and forces calls in this format
# (minigpt.serve.tools). A conversation without tools renders as plain ChatML, one line per message.
_TOOLS_SYSTEM = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ 'You may call the functions below, given as JSON schemas, one per line:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\nTo call one, answer with a block like this for each call:\n<tool_call>\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
)
# An assistant turn's text: its content, then each of its calls.
_ANSWER = (
    "{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": \"'"
    " + call['function']['name'] + '\", \"arguments\": ' + (call['function']['arguments'] | tojson)"
    " + '}\n</tool_call>' }}"
    "{% endfor %}"
)
_OTHER_TURNS = (
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_FIRST_SYSTEM_IN_TOOLS = "{% if tools and loop.first and message['role'] == 'system' %}"  # written with the tools
CHATML_TEMPLATE = (
    _TOOLS_SYSTEM + "{% for message in messages %}" + _FIRST_SYSTEM_IN_TOOLS
    + "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}" + _ANSWER + "{{ '<|im_end|>\n' }}"
    + _OTHER_TURNS
)
CHATML_TRAINING_TEMPLATE = (
    _TOOLS_SYSTEM + "{% for message in messages %}" + _FIRST_SYSTEM_IN_TOOLS
    + "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    + "{% generation %}" + _ANSWER + "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    + _OTHER_TURNS
)

# Used when the model ships no chat template: one "Role: content" line per message, then "Assistant:". A base model
# trained on plain text would go on writing the user's next line, so its turn ends at the stop string PLAIN_STOP.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
PLAIN_STOP = "\nUser:"

# Private-use characters that mark generation blocks in the rendered text; removed before tokenizing.
_OPEN, _CLOSE = OPEN_MARK, CLOSE_MARK
# An assistant reply whose rendering shows what the template writes right after a turn (its end-of-turn token).
_PROBE = "minigptEndOfTurnProbe"


class TemplateRejected(MiniGPTError):
    """The chat template refused these messages (its ``raise_exception``, e.g. roles that do not alternate), or a
    message holds the characters that mark generation blocks or is not valid UTF-8: the caller's input, not the
    model, is at fault."""


class TemplateFailed(TemplateRejected):
    """Rendering the model's chat template raised something other than a Jinja error (``{{ 1/0 }}``: a
    ZeroDivisionError; a ``range`` beyond the sandbox's limit: an OverflowError). The template is at fault, but for
    these messages only: it is a :class:`TemplateRejected`, so that those who answer a rejection (the server: 400;
    ``minigpt chat``: the turn is refused, the conversation kept) answer this one the same way."""


class TemplateText(str):
    """A chat template's Jinja text as a model's files hold it (``load_chat_template``): a ``str`` that also says
    where it was read (``origin``, named in error messages) and holds the other templates of Hugging Face's
    multi-template layout by name (``named``, e.g. ``{"tool_use": ...}``); the text itself is the ``default``
    one. Anything that takes a template string takes it."""

    origin: str
    named: dict[str, str]

    def __new__(cls, text: str, origin: str = "", named: Optional[dict[str, str]] = None) -> "TemplateText":
        self = super().__new__(cls, text)
        self.origin, self.named = origin, dict(named or {})
        return self

    def __reduce__(self):
        return TemplateText, (str(self), self.origin, self.named)


def template_text(text: str, origin: str) -> Optional[TemplateText]:
    """``text`` read from ``origin`` as a :class:`TemplateText`; None, with a ``RuntimeWarning`` naming ``origin``,
    when it is empty or only white space. Such a file renders nothing for any conversation: the model is taken to
    have no template (the plain fallback at inference, the trainer's own template in fine-tuning), and says so."""
    if not text.strip():
        warnings.warn(f"the chat template in {origin} is empty; it is ignored, as if the model had none (write a "
                      "template there, or delete it)", RuntimeWarning, stacklevel=3)
        return None
    return TemplateText(text, origin)


def template_from_config(value: Any, origin: str) -> Optional[TemplateText]:
    """The chat template of a ``chat_template`` value read from ``origin`` (a file, for messages): None, a string,
    or Hugging Face's multi-template layout, a list of ``{"name", "template"}`` objects (or a ``{name: template}``
    object), as ``transformers`` saves a tokenizer with several templates. Of those, the one named ``default`` is
    the template for chat; ``tool_use`` is kept in :attr:`TemplateText.named` for prompts with tools (the choice of
    ``transformers``' ``get_chat_template``).

    Raises :class:`MiniGPTError` (naming ``origin``) for any other value, an entry that is not a pair of strings,
    and a layout without a ``default`` template.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return template_text(value, origin)
    layout = "a list of {\"name\": ..., \"template\": ...} objects"
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise MiniGPTError(f"'chat_template' in {origin} must be a string or {layout}, not {shown_json(value)}")
        value = {t["name"]: t["template"] for t in value}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise MiniGPTError(f"'chat_template' in {origin} must be a string or {layout}, not {shown_json(value)}")
    if "default" not in value:
        raise MiniGPTError(f"'chat_template' in {origin} has templates named {sorted(value)} but none named "
                           "'default', the one for chat; name one of them 'default'")
    return TemplateText(value["default"], origin, {k: v for k, v in value.items() if k != "default"})


def tokenizers_backend(tokenizer: Tokenizer):
    """A private ``tokenizers.Tokenizer`` copy of ``tokenizer`` that recognises its added tokens in text.

    A SentencePiece tokenizer is rebuilt as an equivalent ``tokenizers`` one (:mod:`minigpt.tokenizer.interop`).
    """
    from tokenizers import Tokenizer as HFTokenizer

    if tokenizer.backend == "sentencepiece":
        with tempfile.TemporaryDirectory() as tmp:
            hf = build_tokenizer(vocab_from_file(tokenizer.save(Path(tmp))))
    else:
        hf = HFTokenizer.from_str(tokenizer._hf.to_str())
    hf.encode_special_tokens = False
    return hf


def add_special_tokens(tokenizer: Tokenizer, tokens=CHAT_TOKENS) -> tuple[Tokenizer, list[int]]:
    """A copy of ``tokenizer`` with ``tokens`` added as special tokens where missing, and the ids of the added ones
    (appended after the existing ids; empty when all were present). The input tokenizer is unchanged.

    A SentencePiece tokenizer comes back as an equivalent ``tokenizers`` one, since a ``tokenizer.model`` cannot
    grow, still adding BOS to prompts when it did (``add_bos``, and a ``<s> $A`` post-processor that a saved
    ``tokenizer.json`` keeps). Special tokens are never split or normalised and are recognised in rendered chat text.
    """
    from tokenizers import AddedToken

    missing = [t for t in tokens if tokenizer.token_to_id(t) is None]
    if not missing:
        return tokenizer, []
    hf = tokenizers_backend(tokenizer)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    add_bos = tokenizer.add_bos
    if tokenizer.backend == "sentencepiece" and tokenizer.bos_id is not None and add_bos is not False:
        # A SentencePiece tokenizer whose files do not say prepends BOS (Llama's convention, as
        # checkpoint.tokenizer_bos reads it); a `tokenizers` one does so by its post-processor, which is what
        # its tokenizer.json keeps: Llama's template, as LlamaTokenizerFast.update_post_processor writes it.
        from tokenizers.processors import TemplateProcessing

        bos, add_bos = tokenizer.id_to_token(tokenizer.bos_id), True
        hf.post_processor = TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                               special_tokens=[(bos, tokenizer.bos_id)])
    out = Tokenizer(hf=hf, roles=TokenRoles(add_bos=add_bos))
    return out, [out.token_to_id(t) for t in missing]


class ChatTemplate:
    """A compiled chat template bound to a tokenizer: :meth:`render`, :meth:`encode` and :meth:`encode_with_mask`.

    ``template``: the Jinja source (None: ChatML, the post-training default; :meth:`for_model` picks a model's own
    template or the plain fallback). ``stop``: strings that end an assistant turn besides its end-of-turn token.
    ``end_of_turn_id``: the special token the template closes an assistant turn with, or None.

    A :class:`TemplateText` (a model's own, ``load_chat_template``) is named by its origin in error messages, and
    its ``tool_use`` template, if any, renders the prompts given ``tools`` (as ``transformers`` picks it).

    Raises :class:`MiniGPTError` for a template that is not a string or does not compile, :class:`TemplateRejected`
    when it rejects the messages (its ``raise_exception``, a Jinja error) or they are not valid UTF-8,
    :class:`TemplateFailed` (a :class:`TemplateRejected`) when rendering raises anything else (``{{ 1/0 }}``), and
    :class:`MiniGPTError` when (without generation blocks) it is not prefix-stable. A template that loops for long
    or grows a value without end is stopped (a :class:`TemplateFailed`) at the bounds of a render
    (:mod:`minigpt.tokenizer.template_sandbox`).
    """

    def __init__(self, tokenizer: Tokenizer, template: Optional[str] = None, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        origin = getattr(template, "origin", "")
        self._of = f" of {origin}" if origin else ""
        if template is not None and not isinstance(template, str):
            raise MiniGPTError(f"the chat template{self._of} must be a string, not {shown_json(template)}")
        self.source = template or CHATML_TEMPLATE
        self._template = self._compile(self.source, "")
        tool_use = getattr(template, "named", {}).get("tool_use")
        self._tool_template = self._compile(tool_use, "tool_use") if tool_use is not None else None
        self._hf = tokenizers_backend(tokenizer)
        self._variables = {f"{name}_token": self._token_text(getattr(tokenizer, f"{name}_id"))
                           for name in ("bos", "eos", "pad", "unk")}
        self._stop = tuple(stop)
        # Found once here, so that threads sharing the template (the server's) only ever read it.
        self.end_of_turn_id: Optional[int] = self._find_end_of_turn()

    def _compile(self, source: str, name: str):
        """The compiled Jinja template of ``source`` (``name``: which of a model's templates, for messages)."""
        from jinja2 import TemplateSyntaxError

        which = f" '{name}'" if name else ""
        try:
            return environment().from_string(source)
        except TemplateSyntaxError as e:
            raise MiniGPTError(f"the chat template{which}{self._of} does not compile: {one_line(e)} "
                               f"(line {e.lineno})") from None
        except Exception as e:  # a RecursionError for deep nesting, a TypeError for a non-string
            raise MiniGPTError(f"the chat template{which}{self._of} does not compile: {type(e).__name__}: "
                               f"{one_line(e)}") from None

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, template: Optional[str]) -> "ChatTemplate":
        """The template to chat with a model: its own ``template`` (``load_chat_template``), or for a model without
        one :data:`PLAIN_TEMPLATE` with the stop string :data:`PLAIN_STOP`."""
        return cls(tokenizer, template) if template else cls(tokenizer, PLAIN_TEMPLATE, stop=(PLAIN_STOP,))

    def _find_end_of_turn(self) -> Optional[int]:
        """:attr:`end_of_turn_id`: the special token the template writes right after an assistant's reply
        (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``</s>`` for Mistral), or None when it writes none
        (the plain template) or rejects a plain user/assistant exchange. Found by rendering such an exchange, so it holds for any template;
        only the tokenizer's special tokens (added tokens marked special) count."""
        try:
            text = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}])
        except Exception:  # a template that cannot render this exchange just has no known end-of-turn token
            return None
        at = text.rfind(_PROBE)
        if at < 0:
            return None
        after = text[at + len(_PROBE):]
        specials = self.tokenizer.special_tokens
        for spelling in sorted(specials, key=len, reverse=True):  # longest first: "<|im_end|>" before "<|im"
            if spelling and after.startswith(spelling):
                return specials[spelling]
        return None

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings of an assistant turn: the ``stop`` given (the plain template's ``"\\nUser:"``) and the
        spelling of :attr:`end_of_turn_id`, so that a consumer that can only stop on text (the server, whose
        stop ids are shared by all requests) still ends the turn there."""
        eot = self.end_of_turn_id
        return self._stop + ((self.tokenizer.id_to_token(eot),) if eot is not None else ())

    def prompt(self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids that ask the model for the next assistant turn: ``encode(messages, add_generation_prompt=True)``
        (the template writes any BOS itself, as ``apply_chat_template`` relies on); ``tools`` as in :meth:`render`.
        Raises :class:`TemplateFailed` when the template renders no token at all for ``messages``."""
        ids = self.encode(messages, add_generation_prompt=True, tools=tools)
        if not ids:  # else reported downstream as an empty prompt, or a message of 0 tokens: the user's fault
            raise TemplateFailed(f"the chat template{self._of} renders nothing for these messages, so there is no "
                                 "prompt to answer; fix the template")
        return ids

    def _token_text(self, i: Optional[int]) -> str:
        return self.tokenizer.decode([i]) if i is not None else ""

    def _render_raw(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: Optional[list[dict]] = None) -> str:
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        for i, m in enumerate(messages):
            if any(c in str(m.get("content", "")) for c in (_OPEN, _CLOSE)):
                raise TemplateRejected("a message contains the private-use characters U+F8F0/U+F8F1, which mark "
                                   "generation blocks")
            if isinstance(m.get("content"), str):
                try:
                    check_text(m["content"])
                except InvalidText as e:
                    raise TemplateRejected(f"message {i + 1} ({m.get('role')}): {e}") from None
        # transformers' get_chat_template: the tool_use template when tools are given and the model has one.
        use_tools = tools is not None and self._tool_template is not None
        template, which = (self._tool_template, " 'tool_use'") if use_tools else (self._template, "")
        try:
            # tools and documents are always defined (None when absent), as apply_chat_template renders them.
            with render_bounds(messages, tools, self._variables):
                return template.render(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, **self._variables)
        except SecurityError as e:  # the sandbox's bounds: the template is at fault
            raise TemplateFailed(f"the chat template{which}{self._of} was stopped: {one_line(e)}") from None
        except TemplateError as e:
            raise TemplateRejected(f"the chat template{which}{self._of} rejected the messages: {one_line(e)}") from None
        except Exception as e:  # whatever the model's template raises is reported, never a crash
            raise TemplateFailed(f"the chat template{which}{self._of} failed while rendering: {type(e).__name__}: "
                                 f"{one_line(e)}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: Optional[list[dict]] = None) -> str:
        """The template's text for ``messages`` (``add_generation_prompt``: end with the assistant header).

        ``tools``: function definitions as JSON schemas (OpenAI's ``{"type": "function", "function": {"name",
        "description", "parameters"}}``), given to the template as ``tools``, the variable ``transformers``'
        ``apply_chat_template(messages, tools=...)`` sets; a template without a tools section ignores them."""
        return self._render_raw(messages, add_generation_prompt, tools).replace(_OPEN, "").replace(_CLOSE, "")

    def render_with_spans(self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None
                          ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation (``tools`` as in :meth:`render`) and the ``[start, end)``
        character ranges of its assistant turns (generation blocks, or the prefix difference described in the
        module docstring)."""
        raw = self._render_raw(messages, False, tools)
        if _OPEN in raw:
            chars, spans, start, pos = [], [], 0, 0
            for ch in raw:
                if ch == _OPEN:
                    start = pos
                elif ch == _CLOSE:
                    spans.append((start, pos))
                else:
                    chars.append(ch)
                    pos += 1
            return "".join(chars), spans
        text, spans = raw, []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            upto = self.render(messages[: i + 1], tools=tools)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise MiniGPTError("the chat template is not prefix-stable (rendering fewer messages does not give a "
                                   "prefix of the whole); add {% generation %} blocks around assistant turns")
            spans.append((len(before), len(upto)))
        return text, spans

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of the rendered ``messages`` (no BOS/EOS beyond what the template writes), as
        ``AutoTokenizer.apply_chat_template(messages, tools=tools, tokenize=True)``. Raises :class:`InvalidText`
        when the rendered text is not valid UTF-8 (the tools, say), besides what :meth:`render` raises."""
        return self._encode(self.render(messages, add_generation_prompt, tools)).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain ``text`` with the added tokens recognised, as ``transformers``'
        ``tokenizer(text, add_special_tokens=False)`` (TRL tokenizes non-conversational prompts this way). Raises
        :class:`InvalidText` when ``text`` is not valid UTF-8."""
        return self._encode(text).ids

    def _encode(self, text: str):
        """The back end's encoding of ``text``; :class:`InvalidText` for text that is not UTF-8 or that the back
        end gives up on (:class:`~minigpt.tokenizer.text.TokenizerFailed`)."""
        check_text(text)
        with backend_errors():
            return self._hf.encode(text, add_special_tokens=False)

    def encode_with_mask(self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None
                         ) -> tuple[list[int], list[bool]]:
        """``(ids, assistant_mask)``: the ids of the whole conversation (``tools`` as in :meth:`render`) and, per
        token, whether it belongs to an assistant turn. A token counts when its characters overlap a span
        (``transformers`` maps a span's first and last characters to tokens the same way, ``char_to_token``)."""
        text, spans = self.render_with_spans(messages, tools)
        encoding = self._encode(text)
        mask = [any(s < end and e > start for start, end in spans) for s, e in encoding.offsets]
        return encoding.ids, mask
