"""Request schemas of the OpenAI-compatible API (:mod:`minigpt.serve.app`): which fields each endpoint takes, how
they are checked, and the error every check raises.

Shapes and ranges follow OpenAI's public API reference for the legacy Completions and the Chat Completions
endpoints. Parameters accepted: ``model``, ``prompt`` / ``messages``, ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature`` (0 to 2), ``top_p`` ((0, 1]), ``top_k`` (an extension; 0 or -1: off),
``stop`` (a string or up to 16 non-empty strings of 1,024 characters in all), ``seed``, ``stream``,
``stream_options.include_usage``, ``user`` (a string, ignored); ``n`` (1 to :data:`MAX_N` choices),
``presence_penalty`` and ``frequency_penalty`` ([-2, 2]), ``logit_bias`` (token id strings to [-100, 100]),
``repetition_penalty`` (> 0), ``min_p`` ([0, 1]) and ``stop_token_ids`` (the last three vLLM's extensions; the
definitions are in :func:`minigpt.infer.sampling.process_logits`); log-probabilities: completions' ``logprobs``
(0 to 20 alternatives) and ``echo`` (``max_tokens`` 0 with echo only scores the prompt), chat's ``logprobs``
(boolean) and ``top_logprobs`` (0 to 20); ``response_format`` and chat's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` (checked in :mod:`minigpt.serve.tools`). The fields in :data:`NEUTRAL_FIELDS`
(``best_of``, ``suffix``, ...) are accepted only with their neutral value; any other value, and any unknown field,
is a 400 naming the field.

Before any of that, the body itself (:func:`check_content_type`, :func:`read_body`, :func:`parse_json`): JSON sent
as ``Content-Type: application/json`` (else 415: the form and text bodies a web page may post cross-site without
a CORS preflight never reach the model), at most ``--max-body-bytes`` bytes, counted while reading, also when
chunked (else 413), strict UTF-8 with no lone surrogate (``"\\ud800"``) in any string, nested at most
:data:`MAX_JSON_DEPTH` deep, numbers of at most :data:`MAX_NUMBER_CHARS` characters and no ``NaN`` / ``Infinity``
(else 400).

Every check raises :class:`ApiError`, which the app answers as ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from minigpt.infer.sampling import MAX_LOGPROBS, InvalidRequest, SamplingParams

NEUTRAL_FIELDS: dict[str, tuple] = {
    # field: values that ask for nothing we do not do
    "best_of": (None, 1), "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
}
# Structured output (both endpoints) and tool calls (chat): checked by minigpt.serve.tools.
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
                 "user"} | {"n", "logprobs", "top_logprobs", "echo", "presence_penalty", "frequency_penalty",
                            "repetition_penalty", "logit_bias", "min_p", "stop_token_ids"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "response_format"} | set(NEUTRAL_FIELDS)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "response_format"} | TOOL_FIELDS | set(NEUTRAL_FIELDS)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # all stop strings together: each generated token is checked against every one of them
MAX_BODY_BYTES = 4 * 2**20  # default of `minigpt serve --max-body-bytes`
MAX_JSON_DEPTH = 32  # objects and arrays; a valid request needs 5 (a message's content part)
MAX_NUMBER_CHARS = 64  # an int64 seed has 20; Python refuses to parse integers of more than 4,300 digits
MAX_N = 16  # choices per request (n): each is one engine request, so n is bounded like the queue
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Prepared:
    """A request ready for the engine: prompt ids, sampling (``max_tokens`` filled in) and how to answer."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices, each one engine request (choice i samples with seed + i)
    echo: Optional[str] = None  # completions' echo: the prompt text the answer starts with
    score_only: bool = False  # max_tokens 0 with echo: the prompt and its logprobs, nothing generated
    structured: Any = None  # minigpt.serve.tools.Structured: the grammar and tools (None: neither)
    adapter: Optional[str] = None  # the LoRA adapter the request's model names (None: the base model)


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        # A lone surrogate quoted from the request (a field name, a value) could not be encoded as UTF-8.
        message, param = _printable(message), None if param is None else _printable(param)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, message, "invalid_request_error", param, code)


def to_json(obj: Any) -> str:
    """Compact JSON, non-ASCII kept: the form of SSE chunks and of values quoted in error messages."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def is_int(x: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _is_neutral(value: Any, allowed: tuple) -> bool:
    for v in allowed:
        if v is None or isinstance(v, bool):
            if value is v:
                return True
        elif isinstance(v, (int, float)):
            if _is_number(value) and value == v:
                return True
        elif type(value) is type(v) and value == v:
            return True
    return False


def check_content_type(request) -> None:
    """415 ``unsupported_media_type`` unless the body is declared JSON (``application/json`` or ``*/*+json``, UTF-8)."""
    given = request.headers.get("content-type", "")
    media, _, params = given.partition(";")
    media = media.strip().lower()
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params.split(";"))
                    if k.strip().lower() == "charset"), "utf-8")
    if (media != "application/json" and not (media.startswith("application/") and media.endswith("+json"))) or \
            charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
                       f"{to_json(given) if given else 'no Content-Type'}", "invalid_request_error", None,
                       "unsupported_media_type")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes (--max-body-bytes)",
                    "invalid_request_error", None, "request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: a larger ``Content-Length`` is refused before reading and a
    chunked body once its bytes pass ``limit`` (413 ``request_too_large``)."""
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _BadNumber(ValueError):
    pass


def _number(kind):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise _BadNumber(f"a number in the request body has {len(text):,} characters; at most "
                             f"{MAX_NUMBER_CHARS} are accepted")
        return kind(text)
    return parse


def _no_constant(name: str):
    raise _BadNumber(f"{name} is not a JSON number")


_JSON = json.JSONDecoder(parse_int=_number(int), parse_float=_number(float), parse_constant=_no_constant)


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (see the module docstring for what is refused: 400 ``invalid_json``).

    Runs in a worker thread: parsing and walking a body of several MB takes a while."""
    try:
        text = raw.decode("utf-8")
        body = _JSON.decode(text)
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e}", None, "invalid_json") from None
    except _BadNumber as e:
        raise bad_request(str(e), None, "invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body nests more than {MAX_JSON_DEPTH} objects or arrays deep", None,
                          "invalid_json") from None
    except ValueError as e:  # json.JSONDecodeError and int()'s own digit limit
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    _check_tree(body)
    return body


def _path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _check_text(text: str, where: str) -> None:
    if not text.isascii() and _SURROGATE.search(text):
        raise bad_request(f"'{where}' is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff "
                          "escape)", where or None, "invalid_json")


def _check_tree(body: dict) -> None:
    """Depth and lone surrogates of a parsed body, walked without recursion; errors name the field."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests more than {MAX_JSON_DEPTH} objects or arrays deep", None,
                              "invalid_json")
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(key, str):
                _check_text(key, _path(where, key))
            if isinstance(value, str):
                _check_text(value, _path(where, key))
            elif isinstance(value, (dict, list)):
                stack.append((value, _path(where, key), depth + 1))


def check_fields(body: dict, allowed: set[str]) -> None:
    """Reject fields outside ``allowed`` (``unknown_parameter``) and non-neutral values of :data:`NEUTRAL_FIELDS`
    (``unsupported_parameter``)."""
    for key in body:
        if key not in allowed:
            raise bad_request(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")
    for key, neutral in NEUTRAL_FIELDS.items():
        if key in body and not _is_neutral(body[key], neutral):
            raise bad_request(f"'{key}' = {to_json(body[key])} is not supported by this server (only "
                              f"{to_json(neutral[-1])} is accepted)", key, "unsupported_parameter")
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad_request(f"'{key}' must be a string, got {to_json(body[key])}", key)


def parse_sampling(body: dict, chat: bool = False) -> tuple[SamplingParams, Optional[int]]:
    """Sampling parameters of a request body and its ``max_tokens`` (None: not given); the length limits are
    checked against the prompt later (:meth:`Engine.validate`)."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is not None and not is_int(max_tokens):
        raise bad_request(f"'{key}' must be an integer, got {to_json(max_tokens)}", key)
    # max_tokens 0 only scores the prompt (echo + logprobs), as lm-evaluation-harness asks for log-likelihoods.
    if max_tokens is not None and max_tokens < (0 if not chat and body.get("echo") is True else 1):
        raise bad_request(f"'{key}' must be at least 1 (0 only with echo), got {max_tokens}", key)
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    elif not _is_number(temperature) or not 0 <= temperature <= 2:
        raise bad_request(f"'temperature' must be a number between 0 and 2, got {to_json(temperature)}",
                          "temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise bad_request(f"'top_p' must be a number in (0, 1], got {to_json(top_p)}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < -1):
        raise bad_request(f"'top_k' must be a non-negative integer (0 or -1: off), got {to_json(top_k)}", "top_k")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    if sum(len(s) for s in stops) > MAX_STOP_CHARS:
        raise bad_request(f"the 'stop' strings have {sum(len(s) for s in stops):,} characters in all; at most "
                          f"{MAX_STOP_CHARS:,} are accepted", "stop")
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise bad_request(f"'seed' must be an integer, got {to_json(seed)}", "seed")
    if seed is not None:
        seed %= 2**63  # torch.Generator takes a 64-bit seed; negative seeds are valid in OpenAI's API
    # max_tokens is filled in once the prompt length is known.
    try:
        params = SamplingParams(max_tokens=0, temperature=float(temperature),
                                top_k=top_k if top_k and top_k > 0 else None,
                                top_p=float(top_p) if top_p is not None and top_p < 1 else None, stop=stops,
                                seed=seed, **_extensions(body, chat))
    except InvalidRequest as e:
        raise bad_request(str(e), e.param) from None
    return params, max_tokens


def _extensions(body: dict, chat: bool) -> dict[str, Any]:
    """The penalties, ``logit_bias``, ``min_p``, ``stop_token_ids`` and log-probability fields of a body as
    :class:`SamplingParams` arguments; their ranges are checked there (:class:`InvalidRequest` names the field).
    Completions: ``logprobs`` is the number of alternatives (0 to 20) and ``echo`` adds the prompt's;
    chat: ``logprobs`` is a boolean and ``top_logprobs`` the number of alternatives (needs ``logprobs``)."""
    out: dict[str, Any] = {}
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        value = body.get(key)
        if value is not None:
            if not _is_number(value):
                raise bad_request(f"'{key}' must be a number, got {to_json(value)}", key)
            out[key] = float(value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 12) or not _is_number(v) or not -100 <= v <= 100:
                raise bad_request(f"'logit_bias' maps token ids (strings of digits) to numbers in [-100, 100], got "
                                  f"{to_json(k)}: {to_json(v)}", "logit_bias")
        out["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > MAX_LOGIT_BIAS or not all(is_int(i) and i >= 0 for i in ids):
            raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        out["stop_token_ids"] = tuple(ids)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad_request(f"'logprobs' must be a boolean, got {to_json(logprobs)}", "logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
            raise bad_request(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {to_json(top)}",
                              "top_logprobs")
        if top and not logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if body.get("echo") not in (None, False):
            raise bad_request("'echo' is not supported on chat completions", "echo", "unsupported_parameter")
        if logprobs:
            out["logprobs"] = top or 0
        return out
    if top not in (None, 0) or isinstance(top, bool):
        raise bad_request("'top_logprobs' is a chat completions field; completions take 'logprobs': <int>",
                          "top_logprobs", "unsupported_parameter")
    if logprobs is False:  # what the chat form's "off" means here too
        logprobs = None
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad_request(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {to_json(logprobs)}",
                          "logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request(f"'echo' must be a boolean, got {to_json(echo)}", "echo")
    if logprobs is not None:
        out["logprobs"] = logprobs
        if echo:
            out["prompt_logprobs"] = logprobs
    return out


def parse_prompts(prompt: Any) -> list:
    """The prompts of a completions body's ``prompt``: a string or a token-id list is one; a list of them
    (OpenAI's batch form) is several. 400 for anything else."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    raise bad_request("'prompt' must be a string, a non-empty list of token ids, or a list of those", "prompt")


def parse_n(body: dict) -> int:
    """``n``: how many choices (1 to :data:`MAX_N`)."""
    n = body.get("n")
    if n is None:
        return 1
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be an integer in [1, {MAX_N}], got {to_json(n)}", "n")
    return n


def parse_stream_flags(body: dict) -> tuple[bool, bool]:
    """``(stream, stream_options.include_usage)`` of a request body, both False when absent. Raises the 400 of
    :func:`bad_request` for a field of the wrong type, and for ``stream_options`` without ``"stream": true``."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {to_json(stream)}", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None and not stream:  # as OpenAI's API answers it (and vLLM's)
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad_request("'stream_options' must be an object with at most 'include_usage'", "stream_options")
        include_usage = opts.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return bool(stream), include_usage


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}} (no images or "
                                  f"audio)", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` with string contents; raises :class:`ApiError` naming ``messages[i]...``."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            raise bad_request(f"{where} has unsupported field(s) {sorted(unknown)}", f"{where}.{sorted(unknown)[0]}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"{where}.role must be one of system, developer, user, assistant; got {to_json(role)}",
                              f"{where}.role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _message_text(m.get("content"), f"{where}.content")})
    return out
