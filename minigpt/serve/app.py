"""``minigpt serve``: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the continuous-batching
:class:`~minigpt.infer.engine.Engine`.

Endpoints (shapes of OpenAI's public API reference for the legacy Completions and Chat Completions endpoints):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON answers, or Server-Sent Events with
  ``"stream": true`` (one ``data: {chunk}`` per piece of text, ending with ``data: [DONE]``);
* ``GET /v1/models``, ``/v1/models/{model}``, ``/health``, ``/metrics`` (Prometheus text format), ``/`` (the chat
  page), ``/openapi.json`` (:mod:`minigpt.serve.openapi`).

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with these statuses: 400 invalid
request (malformed JSON, wrong type or range, unknown or unsupported field, unknown model, prompt or ``max_tokens``
beyond the context, a text the model's tokenizer gives up on), 401 missing or wrong API key, 404 unknown path, 405
wrong method, 413 body too large, 415 not JSON, 429 wait queue full, 500 a failure inside the generation, 503
shutting down, 504 the request timed out. Each endpoint's fields and their checks: :mod:`minigpt.serve.schemas`.

Only reading the body happens on the event loop; parsing, validation and tokenization run in a small thread pool
(``minigpt-prepare-N``), so a large request never holds up ``/health`` or other streams. A client that disconnects
cancels its generation at the engine's next step. On SIGTERM the engine drains for ``shutdown_timeout`` seconds, then
cancels what still runs: those streams end with an error event and ``data: [DONE]``.
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

from minigpt.checkpoint.adapter import tokenizer_source
from minigpt.checkpoint.native import load_chat_template, load_tokenizer, resolve_checkpoint
from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine
from minigpt.infer.metrics import CONTENT_TYPE
from minigpt.infer.request import EngineClosed, Event, QueueFull
from minigpt.infer.sampling import InvalidRequest, SamplingParams
from minigpt.serve.chat import encode_prompt, prompt_bos
from minigpt.serve.models import describe_engine, load_engine, model_card, model_list, resolve_model
from minigpt.serve.openapi import openapi_document
from minigpt.serve.responses import Choice, Shaper, TokenText, combined_usage, error_for
from minigpt.serve.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_BODY_BYTES,
    MAX_N,
    ApiError,
    Prepared,
    bad_request,
    check_content_type,
    check_fields,
    is_int,
    parse_json,
    parse_n,
    parse_prompts,
    parse_sampling,
    parse_stream_flags,
    read_body,
    to_json,
)
from minigpt.serve.tools import parse_messages, prepare_structured
from minigpt.tokenizer.chat_template import ChatTemplate, TemplateRejected
from minigpt.tokenizer.tokenizer import InvalidText, Tokenizer

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
        self.text_of = TokenText(tokenizer)
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

    def check_model(self, body: dict) -> Optional[str]:
        """The LoRA adapter the request's ``model`` names (None: the base model); 400 for an unknown one."""
        return resolve_model(body.get("model"), self.model_name, self.engine.adapter_names)

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            self.refuse_long(prompt, "prompt")
            # Special-token text becomes ids, as in `minigpt generate` and transformers' tokenizer(prompt).
            return encode_prompt(self.tokenizer, prompt, bos=self.add_bos)
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            return list(prompt)
        raise bad_request("each prompt must be a string or a non-empty list of token ids", "prompt")

    def refuse_long(self, text: str, param: str) -> None:
        """400 for a text with more tokens than the context, found without tokenizing all of it: growing prefixes
        (8 characters per token of context, then 4 times longer each time) until one has more tokens than the
        context. The tokenizers hold the GIL: a 4 MB prompt in full stalled the event loop for seconds."""
        limit = self.engine.max_seq_len
        n = 8 * limit
        while n < len(text):
            if len(self.tokenizer.encode(text[:n])) > limit + PREFIX_SLACK:
                raise bad_request(f"'{param}' has more than {limit:,} tokens, this server's context", param)
            n *= 4

    # The prepare_* methods run in a worker thread: parsing, validation and tokenization of the raw body.
    def prepare_completion(self, raw: bytes) -> list[Prepared]:
        """One :class:`Prepared` per prompt of the body (a list of prompts is answered as OpenAI does: choice
        ``k * n + j`` is the ``j``-th of prompt ``k``), all sharing the body's sampling; at most :data:`MAX_N`
        choices in all."""
        body = parse_json(raw)
        check_fields(body, COMPLETION_FIELDS)
        adapter = self.check_model(body)
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        params, max_tokens = parse_sampling(body)
        stream, include_usage = parse_stream_flags(body)
        texts, n = parse_prompts(body["prompt"]), parse_n(body)
        if len(texts) * n > MAX_N:
            raise bad_request(f"{len(texts)} prompts x n={n} make {len(texts) * n} choices; at most {MAX_N} a "
                              "request", "prompt")
        jobs, structured = [], prepare_structured(body, self, False)  # one grammar for every prompt
        for text in texts:
            prompt = self.prompt_ids(text)
            # OpenAI's default for the completions endpoint is 16 tokens; 0 (echo only) generates one, not shown.
            job = self._checked(prompt, params, 16 if max_tokens is None else max(max_tokens, 1), "prompt", stream,
                                include_usage)
            job.n, job.score_only = n, max_tokens == 0
            job.structured, job.adapter = structured, adapter
            if body.get("echo"):
                job.echo = text if isinstance(text, str) else self.tokenizer.decode(prompt)
            jobs.append(job)
        return jobs

    def prepare_chat(self, raw: bytes) -> Prepared:
        body = parse_json(raw)
        check_fields(body, CHAT_FIELDS)
        adapter = self.check_model(body)
        messages = parse_messages(body.get("messages"))
        self.refuse_long("\n".join(m["content"] for m in messages), "messages")
        params, max_tokens = parse_sampling(body, chat=True)
        if self.chat.stop:
            params = params.replace(stop=params.stop + self.chat.stop)
        stream, include_usage = parse_stream_flags(body)
        structured = prepare_structured(body, self, True)  # tools for the template, a grammar for the answer
        try:
            prompt = self.chat.prompt(messages, structured and structured.template_tools)
        except TemplateRejected as e:
            raise bad_request(str(e), "messages") from None
        job = self._checked(prompt, params, max_tokens, "messages", stream, include_usage)
        job.n, job.structured, job.adapter = parse_n(body), structured, adapter
        return job

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
        for field, ids in (("logit_bias", [k for k, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise bad_request(f"'{field}' token ids must be in [0, {vocab})", field)
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

        def __init__(self, content, reqs) -> None:
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.reqs = reqs

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                cancel(self.reqs)

    async def prepare(request: Request, parse) -> Prepared:
        """Read the body here (the only part on the event loop), then ``parse`` it in the pool."""
        state.check_auth(request)
        check_content_type(request)
        raw = await read_body(request, state.max_body_bytes)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, parse, raw)
        except InvalidText as e:  # only the model's tokenizer giving up on a text: the body's text is checked
            raise bad_request(str(e)) from None

    def submit(jobs: list[Prepared], param: str):
        """Submit the ``n`` requests of each job (choice ``j`` of job ``k`` seeded ``seed + j``, as that prompt
        alone would be), their events tagged with the choice's index ``k * n + j`` into one queue; all or none are
        queued."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def deliver_to(index: int):
            return lambda event: loop.call_soon_threadsafe(inbox.put_nowait, (index, event))

        reqs = []
        try:
            for k, job in enumerate(jobs):
                for j in range(job.n):
                    params = job.params if j == 0 or job.params.seed is None else job.params.replace(
                        seed=(job.params.seed + j) % 2**63)
                    reqs.append(engine.submit(
                        job.prompt, params, deliver_to(k * job.n + j), timeout=state.request_timeout,
                        logits_processors=job.structured.processors() if job.structured else (),
                        adapter=job.adapter))
        except (InvalidRequest, QueueFull, EngineClosed) as e:
            for req in reqs:
                engine.cancel(req)
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), "rate_limit_error", None, "queue_full") from None
            if isinstance(e, EngineClosed):
                raise ApiError(503, str(e), "server_error", None, "shutting_down") from None
            raise bad_request(str(e), param if e.param == "prompt" else e.param) from None
        return reqs, inbox

    async def next_event(inbox: asyncio.Queue, request: Request, req) -> Optional[tuple[int, Event]]:
        """The next ``(choice index, event)``; None if the client went away. Backstops the engine's own timeout."""
        limit = state.request_timeout
        deadline = req.arrival + limit + 5.0 if limit is not None else None
        while True:
            try:
                return await asyncio.wait_for(inbox.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                if deadline is not None and time.monotonic() > deadline:
                    return 0, Event(finish_reason="timeout", error="the request timed out")

    def cancel(reqs) -> None:
        for req in reqs:
            engine.cancel(req)

    async def cancel_on_disconnect(request: Request, reqs, gone: threading.Event) -> None:
        """Cancel ``reqs`` when its client disconnects. The body is read already, so the next ASGI message is the
        disconnect (uvicorn sends it as soon as the connection closes)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        cancel(reqs)

    async def respond(request: Request, chat: bool, jobs: list[Prepared]):
        """Answer ``jobs`` (one per prompt: several only for a completions batch) as one response."""
        reqs, inbox = submit(jobs, "messages" if chat else "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created, job, n = int(time.time()), jobs[0], jobs[0].n
        shapers = [(j.structured.shaper(Shaper) if j.structured else Shaper)(
            state.text_of, chat, rid, created, j.adapter or state.model_name, j.prompt, j.echo,
            j.params.logprobs is not None, j.score_only) for j in jobs]
        shaper = shapers[0]
        choices = [Choice(i) for i in range(len(jobs) * n)]

        if job.stream:
            async def events() -> AsyncIterator[str]:
                for piece in shaper.role_chunks(n):
                    yield piece
                left = len(choices)
                while left:
                    got = await next_event(inbox, request, reqs[0])
                    if got is None:
                        cancel(reqs)
                        return
                    i, ev = got
                    if ev.finish_reason in ("error", "timeout", "cancelled"):
                        yield f"data: {to_json(error_for(ev).body())}\n\n"
                        break
                    for piece in shapers[i // n].chunks(i, ev):
                        yield piece
                    if ev.finished:
                        choices[i].last = ev
                        left -= 1
                if not left and job.include_usage:
                    yield shaper.usage_chunk(combined_usage(shapers, choices, n))
                yield "data: [DONE]\n\n"

            return EngineStream(events(), reqs)

        gone = threading.Event()
        watcher = asyncio.create_task(cancel_on_disconnect(request, reqs, gone))
        left = len(choices)
        try:
            while left:
                got = await next_event(inbox, request, reqs[0])
                if got is None or gone.is_set():
                    cancel(reqs)
                    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
                i, ev = got
                if ev.finish_reason in ("error", "timeout", "cancelled"):
                    raise error_for(ev)
                choices[i].add(ev)
                left -= ev.finished
        finally:
            watcher.cancel()
            cancel(reqs)  # no-op once finished; frees the slots if this handler was cancelled or failed
        answer = shaper.answer(choices[:n])
        for k in range(1, len(jobs)):
            answer["choices"] += shapers[k].answer(choices[k * n:(k + 1) * n])["choices"]
        answer["usage"] = combined_usage(shapers, choices, n)
        return JSONResponse(answer)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, False, await prepare(request, state.prepare_completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, True, [await prepare(request, state.prepare_chat)])

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")  # :path: a name may hold "/" (org/model)
    async def models(request: Request):
        state.check_auth(request)
        model_id, served = request.path_params.get("model_id"), (state.model_name, engine.adapter_names, state.created)
        return model_list(*served) if model_id is None else model_card(model_id, *served)

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
          adapter: Optional[str] = None, adapters: Optional[dict[str, str]] = None,
          prefix_cache_bytes: Optional[int] = None, compile: int = 0) -> int:
    """Load a model (with the PEFT LoRA folder ``adapter`` merged in, or the folders ``adapters`` served by name:
    :mod:`minigpt.serve.models`) and serve it until SIGTERM/SIGINT; returns the exit status (0 after a clean
    shutdown). ``prefix_cache_bytes``: the prefix cache's budget (0: off; None: the engine's default). ``compile``: up
    to that many running requests decode through the compiled step (0: none; :func:`~minigpt.serve.models.load_engine`).

    ``context``: tokens per KV-cache slot (default: the model's context, capped to half the free memory; see
    :class:`Engine`). On SIGTERM the listening socket closes, running and queued requests get
    ``shutdown_timeout`` seconds to finish, then the rest are cancelled (streams end with an error event and
    ``data: [DONE]``) and the process exits.
    """
    import uvicorn

    ckpt = resolve_checkpoint(source)
    words = tokenizer_source(ckpt, adapter)  # a merged adapter's own tokenizer and template, with tokens it added
    tokenizer = load_tokenizer(words)
    name = model_name or (ckpt.stem if ckpt.is_file() else ckpt.name)
    engine = load_engine(ckpt, tokenizer, adapter, adapters, device, dtype, name, max_batch_size=max_batch_size,
                         max_batch_tokens=max_batch_tokens, max_queue=max_queue,
                         max_prefill_tokens=max_prefill_tokens, context=context, prefix_cache_bytes=prefix_cache_bytes,
                         compile=compile)
    state = ServerState(engine, tokenizer, name, api_key, load_chat_template(words), request_timeout,
                        add_bos=prompt_bos(words, tokenizer), max_body_bytes=max_body_bytes)
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
    print(describe_engine(engine, context_given=context is not None), flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
