"""The HTTP API (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics, over one Engine.

Every error is OpenAI's error body with a 4xx/5xx status, never a traceback: bad JSON or fields 400
(naming the field), a full queue 429 with Retry-After, a timeout 504, shutting down 503, a bug 500
(the traceback goes to the server log). A client that disconnects cancels its request: a stream
watches the connection while it waits (a long prefill sends nothing for seconds), a non-streamed
request likewise.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Job, PromptTooLarge, QueueFull, ShuttingDown
from .metrics import ServerMetrics
from .page import add_page
from .protocol import BadRequest, GenerationRequest, ResponseShape, error_body, parse

log = logging.getLogger("triforce.serve")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/")


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
          504: "timeout_error"}


class _CountRequests:
    """ASGI middleware: triforce:requests{endpoint, status}, for every response (streams included)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()


class _EventStream(StreamingResponse):
    """Server-sent events that also watch the connection: when the client leaves, the stream is
    cancelled and `on_close` runs (at once, not at the next event). Starlette's own watch is off under
    ASGI 2.4 servers, where a disconnect shows only when a write fails."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _disconnected(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
            await self.body_iterator.aclose()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# A prompt longer than the model's context is refused anyway, and no prompt of more than this many bytes per token of
# context fits it (English text takes about 4 bytes a token): such a body is refused unread (413), not read and
# tokenized for seconds first (a 50 MB file dropped on the page).
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20


def max_body_bytes(max_context: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, or BadRequest (413) as soon as it is known to pass `limit` bytes."""
    def too_large(n: int, more: str = "") -> BadRequest:
        return BadRequest(f"the request body is {more}{n / 2 ** 20:.1f} MB: no prompt that long fits this model's context "
                          f"({limit // BODY_BYTES_PER_TOKEN} tokens), so the server reads at most {limit / 2 ** 20:.1f} MB; "
                          f"shorten the prompt", code="request_too_large", status=413)

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(int(length))
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large(len(raw), "over ")
    return bytes(raw)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, tokenizer, *, model_id: str, max_context: int, default_max_tokens: int,
               metrics: ServerMetrics, shutdown_timeout: float = 30.0, choose_stack=None,
               page: dict | None = None) -> FastAPI:
    """The app; its lifespan starts the engine and stops it at shutdown (queued requests get 503). `choose_stack`
    (stacks.StackChooser) lets a request name its own stack; `page`: what the web page at / shows of the server
    (page.py; None: no page)."""
    state = {"closing": False}
    max_body = max_body_bytes(max_context)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        state["closing"] = True
        await asyncio.to_thread(engine.stop, shutdown_timeout)

    app = FastAPI(title="triforce", description="OpenAI-compatible, lossless speculative decoding on CPUs",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, message, _TYPES.get(exc.status_code, "invalid_request_error"),
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        log.exception("error while answering %s %s", request.method, request.url.path)
        return _error(500, "internal server error (see the server log)", "server_error")

    async def generation(request: Request, kind: str):
        try:
            raw = await _body(request, max_body)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from None
            req = await asyncio.to_thread(parse, kind, body, tokenizer, default_max_tokens, max_context, choose_stack)
        except BadRequest as e:
            return _error(e.status, e.message, param=e.param, code=e.code)
        return await _run(request, req)

    async def _run(request: Request, req: GenerationRequest):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: dict) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody listens any more
                job.cancelled.set()

        job = Job(req.prompt, req.max_tokens, req.params, req.seed, req.stop, deliver,
                  stack=req.stack.spec if req.stack else None, stack_name=req.stack.name if req.stack else None)
        try:
            engine.submit(job)
        except QueueFull as e:
            return _error(429, f"the server is busy: {engine.s.max_queue} requests are waiting; retry after "
                               f"{e.retry_after} s", "rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(e.retry_after)})
        except PromptTooLarge as e:
            return _error(400, str(e), param="max_tokens", code="kv_budget_exceeded")
        except ShuttingDown:
            return _error(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        shape = ResponseShape(req.kind, model_id)
        if req.stream:
            return _EventStream(_stream(job, events, req, shape), on_close=lambda: engine.cancel(job))
        return await _collect(request, job, events, shape)

    async def _collect(request: Request, job: Job, events: asyncio.Queue, shape: ResponseShape):
        async def outcome():
            parts, rounds = [], []
            while True:
                ev = await events.get()
                if ev["type"] == "delta":
                    parts.append(ev["text"])
                    if ev["triforce"] is not None:
                        rounds.append(ev["triforce"])
                else:
                    if ev["type"] == "done":  # the whole answer's provenance: the stream's, in one list
                        ev["triforce"] = {**ev["triforce"], "rounds": rounds}
                    return ev, "".join(parts)

        waiter = asyncio.ensure_future(outcome())
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():  # the client left (or the server is stopping): free the engine
                engine.cancel(job)
                waiter.cancel()
            watcher.cancel()
        if waiter not in done:
            return Response(status_code=499)  # nobody reads it
        ev, text = waiter.result()
        if ev["type"] == "error":
            return _error(ev["status"], ev["message"], _TYPES.get(ev["status"], "server_error"), code=ev["code"])
        return JSONResponse(shape.full(text, ev["finish_reason"], ev["usage"], ev["triforce"]))

    async def _stream(job: Job, events: asyncio.Queue, req: GenerationRequest, shape: ResponseShape):
        if req.kind == "chat":
            yield _sse(shape.chunk(role=True))
        while True:
            ev = await events.get()
            if ev["type"] == "delta":
                extra = ev.get("triforce")  # the round's provenance: sent even when its text is held back
                if "opening" in ev:  # the page's panel shows how the prompt was read as soon as the first round
                    extra = {**extra, **ev["opening"]}
                if ev["text"] or extra:
                    yield _sse(shape.chunk(ev["text"], extra=extra))
            elif ev["type"] == "done":
                yield _sse(shape.chunk(finish=ev["finish_reason"], extra=ev["triforce"]))
                if req.include_usage:
                    yield _sse(shape.chunk(usage=ev["usage"]))
                break
            else:  # an error after the 200 went out: OpenAI-style error event, then the end
                yield _sse(error_body(ev["message"], _TYPES.get(ev["status"], "server_error"), code=ev["code"]))
                break
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, "chat")

    if page is not None:
        add_page(app, {**page, "model": model_id, "max_context": max_context, "default_max_tokens": default_max_tokens,
                       "max_body_bytes": max_body, "stack_choice": choose_stack is not None})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(started),
                                            "owned_by": "triforce", "max_model_len": max_context}]}

    @app.get("/health")
    async def health():
        waiting, running = engine.depth()
        body = {"status": "shutting_down" if state["closing"] else "ok", "waiting": waiting, "running": running}
        return JSONResponse(body, status_code=503 if state["closing"] else 200)

    @app.get("/metrics")
    async def metrics_endpoint():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    started = time.time()
    return app
