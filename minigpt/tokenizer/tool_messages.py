"""The tool parts of a conversation in the form chat templates read them, for the server and for training data alike.

OpenAI's Chat Completions API sends an assistant's calls as ``tool_calls: [{"id", "type": "function", "function":
{"name", "arguments": JSON string}}]``. Chat templates (Qwen2.5's, Llama 3.1's, Hermes') write the arguments with
``tojson``, so they expect an object there: a JSON string would be written quoted, as a string. The arguments are
decoded here, as vLLM does before it renders a prompt; :func:`template_tool_calls` does it for both the server's
requests and SFT/DPO rows, so that a model is trained on the text it is later prompted with.

``tools`` (function definitions, OpenAI's ``[{"type": "function", "function": {"name", "description",
"parameters"}}]``) reach the template as they are given; a dataset column may hold them as a JSON string, which
TRL's trainers decode (:func:`tools_column`).
"""
from __future__ import annotations

from typing import Any, Optional

from minigpt.errors import json_loads


class BadToolPart(ValueError):
    """A malformed ``tool_calls`` or ``tools`` value; ``where`` names the field (``messages[2].tool_calls[0]``)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def template_tool_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI ``tool_calls`` -> ``[{"id", "type": "function", "function": {"name", "arguments": object}}]``, the
    arguments decoded from their JSON string (an object stays as it is; absent: ``{}``). ``where`` names the value
    in errors. Raises :class:`BadToolPart` for a value that is not a list of such calls, a name that is not a
    string, arguments that are not valid JSON, or an ``id`` that is not a string."""
    if not isinstance(calls, list):
        raise BadToolPart(f"{where} must be a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") != "function":
            raise BadToolPart(f"{w} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", w)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json_loads(args)
            except ValueError:
                raise BadToolPart(f"{w}.function.arguments must be a JSON string of the call's arguments",
                                  f"{w}.function.arguments") from None
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise BadToolPart(f"{w}.id must be a string", f"{w}.id")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def tools_column(value: Any, where: str = "tools") -> Optional[list[dict]]:
    """A row's ``tools``: a list of function definitions (objects), or a JSON string of one, as TRL's SFT and DPO
    trainers accept it (they ``json.loads`` a string). None or an empty list: None, since TRL passes ``tools or
    None`` (an empty list would make some templates write their tools preamble). Raises :class:`BadToolPart`."""
    if isinstance(value, str):
        try:
            value = json_loads(value)
        except ValueError:
            raise BadToolPart(f"{where} is a string that is not JSON; give a list of function definitions",
                              where) from None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadToolPart(f"{where} must be a list of function definitions (objects)", where)
    return value


def tool_names(tools: Optional[list[dict]]) -> list[str]:
    """The names of the defined functions: ``function.name`` (OpenAI's layout) or a top-level ``name``."""
    names = []
    for t in tools or []:
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names
