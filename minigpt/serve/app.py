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
failure inside the generation, 503 shutting down, 504 the request timed out. The fields each endpoint accepts and
how they are checked: :mod:`minigpt.serve.schemas`.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine
from minigpt.infer.metrics import CONTENT_TYPE
from minigpt.infer.request import EngineClosed, Event, QueueFull
from minigpt.infer.sampling import InvalidRequest, SamplingParams
from minigpt.runtime import DTYPES, pick_device
from minigpt.serve.chat import ChatFormatter, TemplateRejected
from minigpt.serve.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ApiError,
    bad_request,
    check_fields,
    is_int,
    parse_messages,
    parse_sampling,
    parse_stream_flags,
    read_json,
    to_json,
)
from minigpt.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("minigpt.serve.app")

STATIC = Path(__file__).resolve().parent / "static"

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/")


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
            raise bad_request("'model' must be a string", "model")
        if model != self.model_name:
            raise bad_request(f"the model '{model}' does not exist; this server serves '{self.model_name}'", "model",
                              "model_not_found")

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids and self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id]  # as `minigpt generate` does for an empty prompt
            return ids
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise bad_request("'prompt' holds several prompts; send one per request (n and batches are not supported)",
                              "prompt")
        raise bad_request("'prompt' must be a string or a non-empty list of token ids", "prompt")


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
        return JSONResponse(bad_request(f"invalid request: {exc.errors()}").body(), status_code=400)

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
            raise bad_request(str(e), param if e.param == "prompt" else e.param) from None
        params = params.replace(max_tokens=max_tokens)
        try:
            req = engine.submit(prompt, params, deliver, timeout=state.request_timeout)
        except InvalidRequest as e:
            raise bad_request(str(e), param if e.param == "prompt" else e.param) from None
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
            return f"data: {to_json({**head, 'choices': [choice]})}\n\n"

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
                        yield f"data: {to_json(error_for(ev).body())}\n\n"
                        break
                    if ev.text:
                        yield chunk(ev.text, None)
                    if ev.finished:
                        yield chunk(None if chat else "", ev.finish_reason)
                        if include_usage:
                            yield f"data: {to_json({**head, 'choices': [], 'usage': usage(ev)})}\n\n"
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
        body = await read_json(request)
        check_fields(body, COMPLETION_FIELDS)
        state.check_model(body)
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        params, max_tokens = parse_sampling(body)
        stream, include_usage = parse_stream_flags(body)
        prompt = state.prompt_ids(body["prompt"])
        # OpenAI's default for the completions endpoint is 16 tokens.
        return await respond(request, False, prompt, params, 16 if max_tokens is None else max_tokens, stream,
                             include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_auth(request)
        body = await read_json(request)
        check_fields(body, CHAT_FIELDS)
        state.check_model(body)
        messages = parse_messages(body.get("messages"))
        params, max_tokens = parse_sampling(body, chat=True)
        if state.chat.stop:
            params = params.replace(stop=params.stop + state.chat.stop)
        stream, include_usage = parse_stream_flags(body)
        try:
            prompt = state.chat.encode(messages)
        except TemplateRejected as e:
            raise bad_request(str(e), "messages") from None
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
    import uvicorn

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
