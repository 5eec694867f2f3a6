"""``minigpt serve``: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the continuous-batching
:class:`~minigpt.infer.engine.Engine`.

Endpoints (request and response shapes follow OpenAI's public API reference for the legacy Completions and the
Chat Completions endpoints):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON answers, or Server-Sent Events with
  ``"stream": true`` (one ``data: {chunk}`` per piece of text, ending with ``data: [DONE]``);
* ``GET /v1/models``; ``GET /health``; ``GET /metrics`` (Prometheus text format); ``GET /`` (the chat page).

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with these statuses: 400 invalid
request (malformed JSON, wrong type or range, unknown or unsupported field, unknown model, prompt or ``max_tokens``
beyond the context), 401 missing or wrong API key, 404 unknown path, 405 wrong method, 429 wait queue full, 500 a
failure inside the generation, 503 shutting down, 504 the request timed out. Parameters accepted: ``model``,
``prompt`` / ``messages``, ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``,
``top_k`` (extension), ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user`` (ignored). The
fields ``n``, ``best_of``, ``logprobs``, ``top_logprobs``, ``echo``, ``suffix``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``tools``, ``tool_choice``, ``functions``, ``function_call``,
``response_format`` and ``parallel_tool_calls`` are accepted only with their neutral value (``n: 1``,
``logprobs: null``/``false``, penalties ``0``, the others ``null``); any other value is a 400 naming the field.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import socket
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine, EngineClosed, Event, InvalidRequest, QueueFull, SamplingParams
from minigpt.infer.metrics import CONTENT_TYPE
from minigpt.runtime import DTYPES, pick_device
from minigpt.serve.chat import ChatFormatter, TemplateRejected
from minigpt.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("minigpt.serve.app")

STATIC = Path(__file__).resolve().parent / "static"

NEUTRAL_FIELDS: dict[str, tuple] = {
    # field: values that ask for nothing we do not do
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True, False),
}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
                 "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"} | set(NEUTRAL_FIELDS)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"} | set(NEUTRAL_FIELDS)
MAX_STOP_STRINGS = 16
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/")


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# ---------------------------------------------------------------------------------------------------- validation
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


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


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise _bad(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")
    for key, neutral in NEUTRAL_FIELDS.items():
        if key in body and not _is_neutral(body[key], neutral):
            raise _bad(f"'{key}' = {_json(body[key])} is not supported by this server (only "
                       f"{_json(neutral[-1])} is accepted)", key, "unsupported_parameter")


def _sampling(body: dict, chat: bool = False) -> tuple[SamplingParams, Optional[int]]:
    """Sampling parameters of a request body and its ``max_tokens`` (None: not given); the length limits are
    checked against the prompt later (:meth:`Engine.validate`)."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is not None and not _is_int(max_tokens):
        raise _bad(f"'{key}' must be an integer, got {_json(max_tokens)}", key)
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"'{key}' must be at least 1, got {max_tokens}", key)
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    elif not _is_number(temperature) or not 0 <= temperature <= 2:
        raise _bad(f"'temperature' must be a number between 0 and 2, got {_json(temperature)}", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise _bad(f"'top_p' must be a number in (0, 1], got {_json(top_p)}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise _bad(f"'top_k' must be a non-negative integer (0 or -1: off), got {_json(top_k)}", "top_k")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise _bad(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad(f"'seed' must be an integer, got {_json(seed)}", "seed")
    if seed is not None:
        seed %= 2**63  # torch.Generator takes a 64-bit seed; negative seeds are valid in OpenAI's API
    # max_tokens is filled in once the prompt length is known.
    params = SamplingParams(max_tokens=0, temperature=float(temperature),
                            top_k=top_k if top_k and top_k > 0 else None,
                            top_p=float(top_p) if top_p is not None and top_p < 1 else None, stop=stops, seed=seed)
    return params, max_tokens


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"'stream' must be a boolean, got {_json(stream)}", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise _bad("'stream_options' must be an object with at most 'include_usage'", "stream_options")
        include_usage = opts.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return bool(stream), include_usage


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}} (no images or audio)",
                           where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where} must be a string or a list of text parts", where)


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` with string contents; raises :class:`ApiError` naming ``messages[i]...``."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            raise _bad(f"{where} has unsupported field(s) {sorted(unknown)}", f"{where}.{sorted(unknown)[0]}")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"{where}.role must be one of system, developer, user, assistant; got {_json(role)}",
                       f"{where}.role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _message_text(m.get("content"), f"{where}.content")})
    return out


# ---------------------------------------------------------------------------------------------------- app
class _CountRequests:
    """ASGI middleware counting responses by endpoint and status (``minigpt_http_requests_total``)."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.inc(endpoint=path if path in ENDPOINTS else "other", status=str(status[0]))


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ServerState:
    """What the route handlers share: the engine, tokenizer, chat formatter, names and limits."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: Optional[str] = None,
                 chat_template: Optional[str] = None, request_timeout: Optional[float] = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key or None
        self.chat = ChatFormatter(tokenizer, chat_template)
        self.request_timeout = request_timeout
        self.created = int(time.time())

    def check_auth(self, request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key")

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise _bad("'model' must be a string", "model")
        if model != self.model_name:
            raise _bad(f"the model '{model}' does not exist; this server serves '{self.model_name}'", "model",
                       "model_not_found")

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids and self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id]  # as `minigpt generate` does for an empty prompt
            return ids
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise _bad("'prompt' holds several prompts; send one per request (n and batches are not supported)",
                       "prompt")
        raise _bad("'prompt' must be a string or a non-empty list of token ids", "prompt")


async def _read_json(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    return body


def create_app(state: ServerState, drain_timeout: float = 0.0, start_worker: bool = True):
    """The FastAPI application around ``state``; its lifespan starts the engine's worker (unless ``start_worker``
    is False: the caller starts it, e.g. a test that fills the queue first) and closes the engine on shutdown,
    cancelling whatever still runs after ``drain_timeout`` seconds."""
    engine = state.engine

    @asynccontextmanager
    async def lifespan(app):
        if start_worker:
            engine.start()
        yield
        await asyncio.to_thread(engine.close, drain_timeout)

    app = FastAPI(title="MiniGPT", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_CountRequests, metrics=engine.metrics)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return JSONResponse(_bad(f"invalid request: {exc.errors()}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request, exc):
        log.error("unhandled error", exc_info=exc)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}", "server_error").body(),
                            status_code=500)

    class EngineStream(StreamingResponse):
        """SSE response that cancels its generation however the response ends (client gone, shutdown)."""

        def __init__(self, content, req) -> None:
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.req = req

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                engine.cancel(self.req)

    def submit(prompt: list[int], params: SamplingParams, max_tokens: Optional[int], param: str):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, event)

        try:
            max_tokens = engine.validate(len(prompt), max_tokens)
        except InvalidRequest as e:
            raise _bad(str(e), param if e.param == "prompt" else e.param) from None
        params = SamplingParams(max_tokens, params.temperature, params.top_k, params.top_p, params.stop, params.seed)
        try:
            req = engine.submit(prompt, params, deliver, timeout=state.request_timeout)
        except InvalidRequest as e:
            raise _bad(str(e), param if e.param == "prompt" else e.param) from None
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", None, "queue_full") from None
        except EngineClosed as e:
            raise ApiError(503, str(e), "server_error", None, "shutting_down") from None
        return req, inbox

    async def next_event(inbox: asyncio.Queue, request: Request, req) -> Optional[Event]:
        """The request's next event; None if the client went away. Backstops the engine's own timeout."""
        limit = state.request_timeout
        deadline = req.arrival + limit + 5.0 if limit is not None else None
        while True:
            try:
                return await asyncio.wait_for(inbox.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                if deadline is not None and time.monotonic() > deadline:
                    return Event(finish_reason="timeout", error="the request timed out")

    def error_for(event: Event) -> ApiError:
        if event.finish_reason == "timeout":
            return ApiError(504, event.error or "the request timed out", "timeout_error", None, "timeout")
        if event.finish_reason == "cancelled":
            return ApiError(503, event.error or "the request was cancelled", "server_error", None, "cancelled")
        return ApiError(500, f"generation failed: {event.error}", "server_error", None, "generation_error")

    async def respond(request: Request, chat: bool, prompt: list[int], params: SamplingParams,
                      max_tokens: Optional[int], stream: bool, include_usage: bool):
        req, inbox = submit(prompt, params, max_tokens, "messages" if chat else "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": state.model_name}

        def usage(ev: Event) -> dict:
            return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                    "total_tokens": ev.prompt_tokens + ev.completion_tokens}

        def chunk(text: Optional[str], finish: Optional[str], role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {_json({**head, 'choices': [choice]})}\n\n"

        if stream:
            async def events() -> AsyncIterator[str]:
                if chat:
                    yield chunk("", None, role=True)
                while True:
                    ev = await next_event(inbox, request, req)
                    if ev is None:
                        engine.cancel(req)
                        return
                    if ev.finish_reason in ("error", "timeout", "cancelled"):
                        yield f"data: {_json(error_for(ev).body())}\n\n"
                        break
                    if ev.text:
                        yield chunk(ev.text, None)
                    if ev.finished:
                        yield chunk(None if chat else "", ev.finish_reason)
                        if include_usage:
                            yield f"data: {_json({**head, 'choices': [], 'usage': usage(ev)})}\n\n"
                        break
                yield "data: [DONE]\n\n"

            return EngineStream(events(), req)

        parts: list[str] = []
        try:
            while True:
                ev = await next_event(inbox, request, req)
                if ev is None:
                    engine.cancel(req)
                    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
                parts.append(ev.text)
                if ev.finished:
                    break
        finally:
            engine.cancel(req)  # no-op once finished; frees the slot if this handler was cancelled
        if ev.finish_reason in ("error", "timeout", "cancelled"):
            raise error_for(ev)
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": ev.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": state.model_name, "choices": [choice],
                             "usage": usage(ev)})

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_auth(request)
        body = await _read_json(request)
        _check_fields(body, COMPLETION_FIELDS)
        state.check_model(body)
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        params, max_tokens = _sampling(body)
        stream, include_usage = _stream_flags(body)
        prompt = state.prompt_ids(body["prompt"])
        # OpenAI's default for the completions endpoint is 16 tokens.
        return await respond(request, False, prompt, params, 16 if max_tokens is None else max_tokens, stream,
                             include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_auth(request)
        body = await _read_json(request)
        _check_fields(body, CHAT_FIELDS)
        state.check_model(body)
        messages = parse_messages(body.get("messages"))
        params, max_tokens = _sampling(body, chat=True)
        if state.chat.stop:
            params = SamplingParams(params.max_tokens, params.temperature, params.top_k, params.top_p,
                                    params.stop + state.chat.stop, params.seed)
        stream, include_usage = _stream_flags(body)
        try:
            prompt = state.chat.encode(messages)
        except TemplateRejected as e:
            raise _bad(str(e), "messages") from None
        return await respond(request, True, prompt, params, max_tokens, stream, include_usage)

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "minigpt"}]}

    @app.get("/health")
    async def health():
        if engine.closed or (start_worker and not engine.alive):
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    page = (STATIC / "chat.html").read_text(encoding="utf-8")

    @app.get("/")
    async def chat_page():
        return HTMLResponse(page)

    return app


def serve(source: str, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          model_name: Optional[str] = None, max_batch_size: int = 16, max_batch_tokens: Optional[int] = None,
          max_queue: int = 256, max_prefill_tokens: Optional[int] = None, request_timeout: Optional[float] = 600.0,
          shutdown_timeout: float = 30.0, device: str = "auto", dtype: str = "float32",
          log_level: str = "info") -> int:
    """Load a model and serve it until SIGTERM/SIGINT; returns the exit status (0 after a clean shutdown).

    On SIGTERM the listening socket closes, running and queued requests get ``shutdown_timeout`` seconds to
    finish, then the rest are cancelled (streams end with an error event) and the process exits.
    """
    import torch
    import uvicorn

    from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint

    ckpt = resolve_checkpoint(source)
    model = load_model(ckpt, device=pick_device(device), dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(ckpt)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size} embeddings")
    name = model_name or (ckpt.stem if ckpt.is_file() else ckpt.name)
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                    max_queue=max_queue, max_prefill_tokens=max_prefill_tokens)
    state = ServerState(engine, tokenizer, name, api_key, load_chat_template(ckpt), request_timeout)
    app = create_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught once it has shut down; with the default handlers that would end the
    # process with -SIGTERM (or a KeyboardInterrupt traceback) after a clean shutdown.
    # Bound here, not by uvicorn, so a busy port is one clear error line before anything starts.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MiniGPTError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"serving {ckpt} as '{name}' on http://{host}:{sock.getsockname()[1]} (max batch {max_batch_size}, "
          f"{torch.get_num_threads()} threads)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
