"""Tool calls and structured output on the chat endpoint: the ``tools`` / ``tool_choice`` / ``response_format``
fields (OpenAI's Chat Completions shapes), tool messages, the grammar that forces a call, and parsing calls back.

* **Definitions** (:func:`parse_tools`): ``tools`` is a list of ``{"type": "function", "function": {"name",
  "description", "parameters", "strict"}}`` (name: 1-64 of ``a-zA-Z0-9_-``; parameters: a JSON-schema object);
  ``tool_choice`` is ``"none"``, ``"auto"`` (default with tools), ``"required"`` or ``{"type": "function",
  "function": {"name"}}``. They reach the chat template as ``tools`` (the list of definitions as sent), the
  convention of ``transformers``' ``apply_chat_template(messages, tools=...)``, so a model whose template has a tools
  section (Qwen2.5, Hermes, Llama 3.1) sees them as it was trained to.
* **Messages** (:func:`parse_messages`): assistant messages may carry ``tool_calls`` (then ``content`` may be null)
  and ``tool`` messages answer one by ``tool_call_id``; for the template the calls' ``arguments`` (a JSON string in
  OpenAI's API) become objects, as vLLM does, since templates write them with ``tojson``.
* **Parsing** (:func:`parse_tool_calls`): the answer's Hermes / Qwen2.5 blocks ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` (text before the first block stays the content), or a Llama 3.x JSON answer
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, several joined by ``;``), become
  OpenAI ``tool_calls`` ``[{"id", "type": "function", "function": {"name", "arguments": JSON string}}]`` with
  ``finish_reason "tool_calls"``. Only calls of a defined tool count; anything else stays text. ``"none"`` parses
  nothing.
* **Forcing** (:func:`tool_call_grammar`): with ``"required"`` or a named tool, decoding is constrained
  (:mod:`minigpt.infer.constrain`) to calls in the template's own format -- Hermes blocks when the template
  mentions ``<tool_call>``, else Llama's JSON -- whose arguments match each tool's ``parameters`` schema. vLLM
  forces these choices by guided decoding too (there over a JSON array of ``{name, parameters}``); writing them
  in the model's format keeps one parser for forced and free calls.
* **Structured output** (:func:`parse_response_format`): ``{"type": "text"}``, ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}``, decoded
  under the grammar of the schema; without the grammar library such a request is a 400 naming
  ``response_format``.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from minigpt.errors import json_loads
from minigpt.infer import constrain
from minigpt.infer.request import Event
from minigpt.infer.sampling import InvalidRequest
from minigpt.serve.responses import Shaper
from minigpt.serve.schemas import bad_request, to_json
from minigpt.serve.schemas import parse_messages as parse_plain_messages
from minigpt.tokenizer.tool_messages import BadToolPart, template_tool_calls

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# The forced calls' JSON is written compactly, with the separators models print: a small or undertrained model
# left free to choose whitespace can loop on it.
_TOOL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolSpec:
    """The tools of a chat request: ``tools`` as sent (for the template), ``choice`` (``"none"``, ``"auto"``,
    ``"required"`` or a tool's name) and whether several calls may be made at once."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        return bool(self.tools) and self.choice not in ("none", "auto")

    @property
    def parses(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def _schema_object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be a JSON schema object, got {to_json(value)}", where)
    if "type" in value and value["type"] not in ("object", ["object"]):
        raise bad_request(f"'{where}' must describe an object (type 'object'), got type {to_json(value['type'])}",
                          where)
    return value


def parse_tools(body: dict) -> ToolSpec:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request; raises a 400 naming the field
    (``tools[i].function.name`` ...) for an invalid definition, a choice naming no defined tool, or a choice without
    tools."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"'parallel_tool_calls' must be a boolean, got {to_json(parallel)}", "parallel_tool_calls")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {type: 'function', function: {...}} objects", "tools")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"'{where}.function' must be an object with a 'name'", f"{where}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"'{where}.function' has unsupported field(s) {sorted(unknown)}",
                              f"{where}.function.{sorted(unknown)[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', got "
                              f"{to_json(name)}", f"{where}.function.name")
        if name in seen:
            raise bad_request(f"'{where}.function.name' {to_json(name)} is defined twice", f"{where}.function.name")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", f"{where}.function.description")
        if fn.get("parameters") is not None:
            _schema_object(fn["parameters"], f"{where}.function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"'{where}.function.strict' must be a boolean", f"{where}.function.strict")
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                              "'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in seen:
            raise bad_request(f"'tool_choice' names the tool {to_json(fn['name'])}, which 'tools' does not define",
                              "tool_choice")
        choice = fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {to_json(choice)}", "tool_choice")
    elif choice != "none" and not tools:
        raise bad_request(f"'tool_choice' {to_json(choice)} needs 'tools'", "tool_choice")
    return ToolSpec(tools, choice, parallel is not False)


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """The chat messages for the template: :func:`minigpt.serve.schemas.parse_messages` plus assistant
    ``tool_calls`` and ``tool`` messages (``tool_call_id``); raises a 400 naming ``messages[i]...``."""
    if not isinstance(messages, list):
        return parse_plain_messages(messages)  # its error
    plain, extras = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            plain.append(m)
            extras.append({})
            continue
        m, extra = dict(m), {}
        where = f"messages[{i}]"
        if m.get("role") == "tool":
            call_id = m.pop("tool_call_id", None)
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.tool_call_id must be the string id of the call it answers",
                                  f"{where}.tool_call_id")
            m["role"] = "user"  # checked as one, answered as a tool message
            extra = {"role": "tool", "tool_call_id": call_id}
        elif m.get("role") == "assistant" and "tool_calls" in m:
            calls = m.pop("tool_calls")
            if calls is not None:
                extra = {"tool_calls": _message_calls(calls, f"{where}.tool_calls")}
                if m.get("content") is None:
                    m["content"] = ""
        plain.append(m)
        extras.append(extra)
    out = parse_plain_messages(plain)
    for message, extra in zip(out, extras):
        message.update(extra)
    return out


def _message_calls(calls: Any, where: str) -> list[dict]:
    try:
        return template_tool_calls(calls, where)
    except BadToolPart as e:
        raise bad_request(str(e), e.where) from None


def parse_response_format(value: Any) -> Optional[str]:
    """The llguidance grammar ``response_format`` asks for, or None for plain text; raises a 400 naming
    ``response_format`` for a malformed value or, when the grammar library is missing, for any structured one."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    try:
        if kind == "json_object" and set(value) == {"type"}:
            return constrain.json_grammar(None)
        if kind == "json_schema" and set(value) == {"type", "json_schema"}:
            spec = value["json_schema"]
            if not isinstance(spec, dict) or set(spec) - {"name", "schema", "description", "strict"}:
                raise bad_request("'response_format.json_schema' must be {name, schema, description, strict}",
                                  "response_format")
            if not isinstance(spec.get("name"), str) or not TOOL_NAME.match(spec["name"]):
                raise bad_request("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
                                  "response_format")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise bad_request("'response_format.json_schema.strict' must be a boolean", "response_format")
            schema = spec.get("schema", {})
            if not isinstance(schema, dict):
                raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                                  "response_format")
            return constrain.json_grammar(schema)
    except InvalidRequest as e:
        raise bad_request(str(e), "response_format") from None
    raise bad_request("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                      "'json_schema', 'json_schema': {'name', 'schema', 'strict'}}", "response_format")


def tool_format(template_source: str) -> str:
    """``"hermes"`` when the chat template writes ``<tool_call>`` blocks (Qwen2.5, Hermes), else ``"llama3_json"``."""
    return "hermes" if HERMES_OPEN in template_source else "llama3_json"


def _rebase_refs(schema: Any, where: str) -> Any:
    """``schema`` with its local ``$ref`` pointers (``#/$defs/...``) moved under ``where``, the place the schema
    takes inside a larger one."""
    if isinstance(schema, list):
        return [_rebase_refs(x, where) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: (where + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, where))
            for k, v in schema.items()}


def tool_call_grammar(spec: ToolSpec, fmt: str) -> str:
    """The llguidance grammar of the calls a forced ``tool_choice`` allows, in format ``fmt``
    (:func:`tool_format`): one call (or, for ``"required"`` with ``parallel_tool_calls``, one or more Hermes
    blocks) of the chosen tool(s), whose arguments match their ``parameters``."""
    names = spec.names if spec.choice == "required" else [spec.choice]
    key = "arguments" if fmt == "hermes" else "parameters"
    options = []
    for tool in spec.tools:
        fn = tool["function"]
        if fn["name"] in names:
            where = f"#/anyOf/{len(options)}/properties/{key}"  # local $refs now resolve from here
            options.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                            "properties": {"name": {"const": fn["name"]},
                                           key: _rebase_refs(fn.get("parameters") or {"type": "object"}, where)}})
    schema = {"anyOf": options, "x-guidance": _TOOL_JSON}
    call = json.dumps(schema)
    if fmt == "hermes":
        more = ' ("\\n" block)*' if spec.choice == "required" and spec.parallel else ""
        text = (f"start: block{more}\n"
                f'block: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\n'
                f"call: %json {call}")
    else:
        text = f"start: call\ncall: %json {call}"
    try:
        return constrain.lark_grammar(text, param="tool_choice")
    except InvalidRequest as e:
        raise bad_request(str(e), "tool_choice") from None


def _call(name: Any, args: Any, names: list[str]) -> Optional[dict]:
    if name not in names or not isinstance(args, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _hermes(text: str, names: list[str]) -> Optional[tuple[Optional[str], list[dict]]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    calls, pos = [], start
    while pos < len(text):
        if not text.startswith(HERMES_OPEN, pos):
            if text[pos:].strip():
                return None  # text after a block: not a clean call
            break
        end = text.find(HERMES_CLOSE, pos)
        inner = text[pos + len(HERMES_OPEN):end if end >= 0 else len(text)]  # an unclosed last block still counts
        try:
            obj = json_loads(inner)
        except ValueError:
            return None
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters")), names) \
            if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)
        if end < 0:
            break
        pos = end + len(HERMES_CLOSE)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    content = text[:start].strip()
    return (content or None), calls


def _llama_json(text: str, names: list[str]) -> Optional[list[dict]]:
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    if not text.startswith("{"):
        return None
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # RecursionError: a model's output nested thousands deep
            return None
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")), names) \
            if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)
        rest = text[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        pos = len(text) - len(rest[1:].lstrip())
    return calls


def parse_tool_calls(text: str, names: list[str]) -> tuple[Optional[str], list[dict]]:
    """``(content, tool_calls)`` of an assistant answer (module docstring: Hermes blocks, else Llama 3.x JSON);
    no call found: ``(text, [])``. ``names``: the defined tools; a call of another name leaves the text as it is."""
    hermes = _hermes(text, names)
    if hermes is not None:
        return hermes
    calls = _llama_json(text, names)
    if calls:
        return None, calls
    return text, []


def stream_delta(calls: list[dict]) -> dict:
    """The ``delta`` of a streamed chunk that carries whole ``calls`` (each with its ``index``, as OpenAI's stream
    does for its first chunk of a call)."""
    return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


# ---------------------------------------------------------------------------------------------------- requests
@dataclass
class Structured:
    """A request's grammar and tools, prepared with its body (:func:`prepare_structured`): the definitions the chat
    template gets, the tools whose calls the answer parses, and each choice's grammar constraint."""

    tools: Optional[ToolSpec] = None
    grammar: Optional[str] = None
    param: str = "response_format"
    tokenizer: Any = None
    vocab_size: int = 0
    end_ids: tuple[int, ...] = ()

    @property
    def template_tools(self) -> Optional[list[dict]]:
        """``tools`` for the chat template: the definitions, or None without tools."""
        return self.tools.tools if self.tools and self.tools.tools else None

    def processors(self) -> list:
        """Fresh logits processors for one choice (a grammar matcher has state, so each choice gets its own)."""
        if self.grammar is None:
            return []
        return [constrain.GrammarConstraint(self.grammar, self.tokenizer, self.vocab_size, self.end_ids, self.param)]

    def shaper(self, shaper_class):
        """``shaper_class`` (:class:`~minigpt.serve.responses.Shaper`), or one that answers with parsed tool calls."""
        if self.tools is None or not self.tools.parses:
            return shaper_class
        names = self.tools.names
        return lambda *args, **kwargs: ToolShaper(names, *args, **kwargs)


def prepare_structured(body: dict, state, chat: bool) -> Optional[Structured]:
    """The structured output (``response_format``) and, for chat, the tools of a request body, checked (400s name
    the field) and compiled against the model's tokenizer; None when it asks for neither. ``state``: the server's
    :class:`~minigpt.serve.app.ServerState` (tokenizer, engine, chat template)."""
    spec = parse_tools(body) if chat else None
    grammar, param = parse_response_format(body.get("response_format")), "response_format"
    if spec is not None and spec.forced:
        if grammar is not None:
            raise bad_request("'response_format' cannot be combined with a 'tool_choice' that forces a call",
                              "response_format")
        grammar, param = tool_call_grammar(spec, tool_format(state.chat.source)), "tool_choice"
    if grammar is None and (spec is None or not spec.tools):
        return None
    ends = set(state.engine.stop_ids)
    if chat and state.chat.end_of_turn_id is not None:
        ends.add(state.chat.end_of_turn_id)
    out = Structured(spec, grammar, param, state.tokenizer, state.engine.model.config.vocab_size, tuple(sorted(ends)))
    try:
        out.processors()  # compiles once here, so a grammar that cannot work is a 400 before anything runs
    except InvalidRequest as e:
        raise bad_request(str(e), param) from None
    return out


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may still turn out to be (the start of) a tool call: all of it
    when the answer so far is blank or begins like a Llama 3.x JSON call, else from a ``<tool_call>`` (or a tail
    that could begin one) on."""
    stripped = text.lstrip()
    if not stripped or stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped):
        return len(text)
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return len(text) - at
    for n in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolShaper(Shaper):
    """A chat :class:`~minigpt.serve.responses.Shaper` whose choices carry the tool calls parsed from their text
    (:func:`parse_tool_calls`): ``message.tool_calls``, ``content`` the text before them (or null) and
    ``finish_reason "tool_calls"``. Streamed, text is sent as it comes except what may still become a call
    (:func:`_held_back`); the calls follow whole, in one chunk (``delta.tool_calls`` with their ``index``)."""

    def __init__(self, names: list[str], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.names = names
        self._text: dict[int, str] = {}  # streamed: each choice's text so far
        self._sent: dict[int, int] = {}  # ... and how much of it went out

    def _choice(self, c) -> dict:
        out = super()._choice(c)
        message = out["message"]
        content, calls = parse_tool_calls(message["content"], self.names)
        if calls and out["finish_reason"] == "stop":
            out["message"] = {**message, "content": content, "tool_calls": calls}
            out["finish_reason"] = "tool_calls"
        return out

    def chunks(self, index: int, ev: Event) -> list[str]:
        text = self._text[index] = self._text.get(index, "") + ev.text
        sent = self._sent.get(index, 0)
        if not ev.finished:
            upto = len(text) - _held_back(text)
            self._sent[index] = max(sent, upto)
            return super().chunks(index, dataclasses.replace(ev, text=text[sent:upto]))
        content, calls = parse_tool_calls(text, self.names)
        if not calls or ev.finish_reason != "stop":
            return super().chunks(index, dataclasses.replace(ev, text=text[sent:]))
        before = text[sent:text.find(HERMES_OPEN)] if HERMES_OPEN in text and content else ""
        out = super().chunks(index, dataclasses.replace(ev, text=before, finish_reason=None))
        for delta, finish in ((stream_delta(calls), None), ({}, "tool_calls")):
            out.append(self._sse({**self.head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                            "finish_reason": finish}]}))
        return out
