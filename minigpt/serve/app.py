"""``minigpt serve``: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the continuous-batching
:class:`~minigpt.infer.engine.Engine`.

Endpoints (request and response shapes follow OpenAI's public API reference for the legacy Completions and the
Chat Completions endpoints):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON answers, or Server-Sent Events with
  ``"stream": true`` (one ``data: {chunk}`` per piece of text, ending with ``data: [DONE]``);
* ``GET /v1/models``; ``GET /health``; ``GET /metrics`` (Prometheus text format); ``GET /`` (the chat page);
  ``GET /openapi.json`` (:mod:`minigpt.serve.openapi`).

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with these statuses: 400 invalid
request (malformed JSON, wrong type or range, unknown or unsupported field, unknown model, prompt or ``max_tokens``
beyond the context), 401 missing or wrong API key, 404 unknown path, 405 wrong method, 413 body too large, 415 not
sent as JSON, 429 wait queue full, 500 a failure inside the generation, 503 shutting down, 504 the request timed
out. The fields each endpoint accepts and how they are checked: :mod:`minigpt.serve.schemas`.

Only reading the body happens on the event loop: parsing, validation and tokenization run in a small thread pool
(``minigpt-prepare-N`` threads), so a large request never holds up ``/health`` or the streams of others. A client
that disconnects cancels its generation at the engine's next step, streamed or not. On SIGTERM the engine drains
for ``shutdown_timeout`` seconds, then cancels what still runs: those streams end with an error event and
``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minigpt.checkpoint.adapter import load_merged
from minigpt.checkpoint.native import load_chat_template, load_tokenizer, resolve_checkpoint
from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine
from minigpt.infer.metrics import CONTENT_TYPE
from minigpt.infer.request import EngineClosed, Event, QueueFull
from minigpt.infer.sampling import InvalidRequest, SamplingParams
from minigpt.runtime import DTYPES, pick_device
from minigpt.serve.chat import encode_prompt, prompt_bos
from minigpt.serve.openapi import openapi_document
from minigpt.serve.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_BODY_BYTES,
    ApiError,
    Prepared,
    bad_request,
    check_content_type,
    check_fields,
    is_int,
    parse_json,
    parse_messages,
    parse_sampling,
    parse_stream_flags,
    read_body,
    to_json,
)
from minigpt.tokenizer.chat_template import ChatTemplate, TemplateRejected
from minigpt.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("minigpt.serve.app")

STATIC = Path(__file__).resolve().parent / "static"

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/", "/openapi.json")
PREPARE_THREADS = 2  # parse + tokenize in parallel with the loop; more would only queue behind the GIL
PREFIX_SLACK = 16  # tokens a cut through the last word may add to a prefix's count (see ServerState.refuse_long)


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
    """What the route handlers share: the engine, tokenizer, chat template, names and limits. ``add_bos``: string
    prompts of /v1/completions start with BOS (:func:`~minigpt.serve.chat.prompt_bos` of the model)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: Optional[str] = None,
                 chat_template: Optional[str] = None, request_timeout: Optional[float] = None,
                 add_bos: bool = False, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key or None
        self.chat = ChatTemplate.for_model(tokenizer, chat_template)
        self.add_bos = add_bos
        self.request_timeout = request_timeout
        self.max_body_bytes = max_body_bytes
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
            self.refuse_long(prompt, "prompt")
            # Special-token text becomes ids, as in `minigpt generate` and transformers' tokenizer(prompt).
            return encode_prompt(self.tokenizer, prompt, bos=self.add_bos)
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise bad_request("'prompt' holds several prompts; send one per request (n and batches are not supported)",
                              "prompt")
        raise bad_request("'prompt' must be a string or a non-empty list of token ids", "prompt")

    def refuse_long(self, text: str, param: str) -> None:
        """400 for a text with more tokens than the context, found without tokenizing all of it: growing prefixes
        (8 characters per token of context, then 4 times longer each time) are tokenized until one has more tokens
        than the context. The tokenizers hold the GIL, so tokenizing a 4 MB prompt in full would stall the event
        loop for seconds; this bounds the work by the context instead."""
        limit = self.engine.max_seq_len
        n = 8 * limit
        while n < len(text):
            if len(self.tokenizer.encode(text[:n])) > limit + PREFIX_SLACK:
                raise bad_request(f"'{param}' has more than {limit:,} tokens, this server's context", param)
            n *= 4

    # The prepare_* methods run in a worker thread: parsing, validation and tokenization of the raw body.
    def prepare_completion(self, raw: bytes) -> Prepared:
        body = parse_json(raw)
        check_fields(body, COMPLETION_FIELDS)
        self.check_model(body)
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        params, max_tokens = parse_sampling(body)
        stream, include_usage = parse_stream_flags(body)
        prompt = self.prompt_ids(body["prompt"])
        # OpenAI's default for the completions endpoint is 16 tokens.
        return self._checked(prompt, params, 16 if max_tokens is None else max_tokens, "prompt", stream,
                             include_usage)

    def prepare_chat(self, raw: bytes) -> Prepared:
        body = parse_json(raw)
        check_fields(body, CHAT_FIELDS)
        self.check_model(body)
        messages = parse_messages(body.get("messages"))
        self.refuse_long("\n".join(m["content"] for m in messages), "messages")
        params, max_tokens = parse_sampling(body, chat=True)
        if self.chat.stop:
            params = params.replace(stop=params.stop + self.chat.stop)
        stream, include_usage = parse_stream_flags(body)
        try:
            prompt = self.chat.prompt(messages)
        except TemplateRejected as e:
            raise bad_request(str(e), "messages") from None
        return self._checked(prompt, params, max_tokens, "messages", stream, include_usage)

    def _checked(self, prompt: list[int], params: SamplingParams, max_tokens: Optional[int], param: str,
                 stream: bool, include_usage: bool) -> Prepared:
        """The request, its size checked against the context and its token ids against the vocabulary."""
        try:
            max_tokens = self.engine.validate(len(prompt), max_tokens)
        except InvalidRequest as e:
            raise bad_request(str(e), param if e.param == "prompt" else e.param) from None
        vocab = self.engine.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param)
        return Prepared(prompt, params.replace(max_tokens=max_tokens), stream, include_usage)


def create_app(state: ServerState, drain_timeout: float = 0.0, start_worker: bool = True):
    """The FastAPI application around ``state``; its lifespan starts the engine's worker (unless ``start_worker``
    is False: the caller starts it, e.g. a test that fills the queue first) and closes the engine on shutdown,
    cancelling whatever still runs after ``drain_timeout`` seconds."""
    engine = state.engine
    pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="minigpt-prepare")

    @asynccontextmanager
    async def lifespan(app):
        if start_worker:
            engine.start()
        yield
        pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.close, drain_timeout)

    app = FastAPI(title="MiniGPT", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    document = openapi_document(state.model_name, engine.max_seq_len, state.api_key)
    app.openapi = lambda: document  # written by hand: the routes read raw bodies, FastAPI cannot describe them
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

    async def prepare(request: Request, parse) -> Prepared:
        """Read the body here (the only part on the event loop), then ``parse`` it in the pool."""
        state.check_auth(request)
        check_content_type(request)
        raw = await read_body(request, state.max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(pool, parse, raw)

    def submit(prompt: list[int], params: SamplingParams, param: str):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, event)

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

    async def cancel_on_disconnect(request: Request, req, gone: threading.Event) -> None:
        """Cancel ``req`` when its client disconnects. The body is read already, so the next ASGI message is the
        disconnect (uvicorn sends it as soon as the connection closes)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        engine.cancel(req)

    async def respond(request: Request, chat: bool, job: Prepared):
        stream, include_usage = job.stream, job.include_usage
        req, inbox = submit(job.prompt, job.params, "messages" if chat else "prompt")
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
        gone = threading.Event()
        watcher = asyncio.create_task(cancel_on_disconnect(request, req, gone))
        try:
            while True:
                ev = await next_event(inbox, request, req)
                if ev is None or gone.is_set():
                    engine.cancel(req)
                    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
                parts.append(ev.text)
                if ev.finished:
                    break
        finally:
            watcher.cancel()
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
        return await respond(request, False, await prepare(request, state.prepare_completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, True, await prepare(request, state.prepare_chat))

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
          log_level: str = "info", context: Optional[int] = None, max_body_bytes: int = MAX_BODY_BYTES,
          adapter: Optional[str] = None) -> int:
    """Load a model (with the PEFT LoRA folder ``adapter`` merged in, if given) and serve it until SIGTERM/SIGINT;
    returns the exit status (0 after a clean shutdown).

    ``context``: tokens per KV-cache slot (default: the model's context, capped to half the free memory; see
    :class:`Engine`). On SIGTERM the listening socket closes, running and queued requests get
    ``shutdown_timeout`` seconds to finish, then the rest are cancelled (streams end with an error event and
    ``data: [DONE]``) and the process exits.
    """
    import uvicorn

    ckpt = resolve_checkpoint(source)
    model = load_merged(ckpt, adapter, device=pick_device(device), dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(ckpt)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size} embeddings")
    name = model_name or (ckpt.stem if ckpt.is_file() else ckpt.name)
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                    max_queue=max_queue, max_prefill_tokens=max_prefill_tokens, context=context)
    state = ServerState(engine, tokenizer, name, api_key, load_chat_template(ckpt), request_timeout,
                        add_bos=prompt_bos(ckpt, tokenizer), max_body_bytes=max_body_bytes)
    app = create_app(state)

    class DrainingServer(uvicorn.Server):
        """Drains the engine while uvicorn waits for open connections: what still runs after ``shutdown_timeout``
        is cancelled by the engine, so its handler answers the error (a stream: an error event and [DONE]) well
        before uvicorn's own deadline, 5 s later, would cut the connection mid-stream."""

        async def shutdown(self, sockets=None):
            drain = asyncio.ensure_future(asyncio.to_thread(engine.close, shutdown_timeout))
            await super().shutdown(sockets)
            await drain

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + 5.0, lifespan="on")
    server = DrainingServer(config)
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
    capped = "" if engine.max_seq_len == engine.model_context or context else (
        f"; the model's {engine.model_context:,} tokens do not fit half the free memory: --context sets it")
    print(f"KV cache: {max_batch_size} slots x {engine.max_seq_len:,} tokens = {engine.kv_cache_bytes / 2**20:,.1f} "
          f"MiB (context {engine.max_seq_len:,}{capped})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
