"""The HTTP app: routes, handlers and the shutdown around one Worker (guards.py checks every
request before a handler sees it).

Handlers run on the event loop and only parse, validate, enqueue a job (worker.py) and relay its
events, as JSON or SSE. A bad request is a 400 in the protocol's own error shape, never a 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import zen5
from zen5.api import ApiContext, anthropic, new_id, openai_chat, openai_completions, openai_responses
from zen5.api.conversations import Reply
from zen5.api.errors import ApiError, error_response, style_for_path
from zen5.api.fields import parse_json_object
from zen5.api.openapi import openapi_spec
from zen5.chat_types import Finish, Usage
from zen5.server.config import ServerConfig
from zen5.server.guards import Guard
from zen5.server.metrics import Metrics
from zen5.server.tracing import Tracer
from zen5.server.worker import Accepted, Done, Job, Worker

log = logging.getLogger("zen5.server")
MAX_BODY = 64 << 20


# ---- token counting (Anthropic count_tokens) -------------------------------------------------
class _Count:
    """The reply of a count job: one number."""
    finish = None

    def __init__(self):
        self.value = 0

    def add(self, value) -> None:
        self.value = value

    def summary(self) -> dict:
        return {"input_tokens": self.value}


class ZenServer:
    """Routes, handlers and lifecycle around one Worker."""

    def __init__(self, config: ServerConfig, session, model_name: str):
        self.config = config
        self.session = session
        self.metrics = Metrics()
        self.tracer = Tracer(config.trace)
        self.worker = Worker(session, self.metrics, self.tracer, config.queue)
        self.api_ctx = ApiContext(model_name, session.engine.n_ctx, config.max_output,
                                  max_token_bytes=session.engine.tokenizer.max_token_bytes)
        self.created = int(time.time())
        self.stop_at: float | None = None   # set when shutdown begins: when running requests are cut

    def begin_shutdown(self) -> None:
        """The server was asked to stop (SIGINT/SIGTERM; uvicorn then stops accepting and waits
        up to --shutdown-timeout for open requests). A request still running shortly before
        that grace period ends is cut here, so it ends cleanly: its stream gets an error event
        in its protocol's shape (a plain request a 503) instead of a cancelled task, and the
        session keeps what was computed for the shutdown checkpoint."""
        if self.stop_at is None:
            grace = self.config.shutdown_timeout
            self.stop_at = time.monotonic() + grace - min(2.0, grace / 2)
            log.info("shutdown requested: running requests get %.1f s to finish", self.stop_at - time.monotonic())

    def _cut_if_stopping(self, job: Job) -> None:
        if self.stop_at is not None and time.monotonic() >= self.stop_at and not job.cancel.is_set():
            log.warning("%s: cut short by the shutdown", job.request_id)
            job.cut = True
            job.cancel.set()

    @staticmethod
    def _cut_error() -> ApiError:
        return ApiError(503, "the server is shutting down: this reply was cut short; send the request again "
                             "once it is back", kind="server", code="server_shutting_down")

    # ---- plumbing ---------------------------------------------------------------------------
    async def _json(self, request: Request) -> dict:
        """The body as a JSON object. Over MAX_BODY is a 413 before anything is buffered when
        Content-Length says so, and as soon as the limit is passed when it does not (chunked);
        a body that stops arriving for --read-timeout seconds is a 408."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY:
            raise ApiError(413, f"the request body is {int(length)} bytes, over the limit of {MAX_BODY}")
        chunks, size = [], 0
        body = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(body.__anext__(), self.config.read_timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body stopped arriving for {self.config.read_timeout:g} s "
                                    f"after {size} bytes") from None
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"the request body is over the limit of {MAX_BODY} bytes")
            chunks.append(chunk)
        return parse_json_object(b"".join(chunks))

    def _error(self, style: str, err: ApiError, rid: str, api: str) -> Response:
        self.metrics.request(api, err.status)
        return error_response(style, err, rid)

    def _submit(self, start, new_reply, rid: str, api: str, style: str) -> Job:
        job = Job(start, new_reply, asyncio.get_running_loop(), rid, api)
        self.worker.submit(job, style)
        return job

    async def _next(self, job: Job, request: Request, want) -> object | None:
        """Wait for the first item that is `want` (or an ApiError, raised); None if the client
        disconnects first (the job is then cancelled)."""
        checked = time.monotonic()
        while True:
            item = await job.get(0.5)
            self._cut_if_stopping(job)
            if time.monotonic() - checked >= 0.5:       # events may never pause: check by the clock
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel.set()
                    return None
            if isinstance(item, ApiError):
                raise item
            if item is not None and want(item):
                return item

    def _gone(self, api: str) -> Response:
        """The client left before its answer (nobody reads this; nginx's code for it)."""
        self.metrics.request(api, 499)
        return Response(status_code=499)

    @staticmethod
    def _headers(rid: str) -> dict:
        return {"request-id": rid, "x-request-id": rid}

    # ---- chat endpoints ---------------------------------------------------------------------
    async def _chat(self, request: Request, adapter, api: str) -> Response:
        rid, style = new_id("req_"), adapter.STYLE
        job = None
        try:
            turn = adapter.parse(await self._json(request), self.api_ctx)
            job = self._submit(turn.start, getattr(adapter, "new_reply", Reply), rid, api, style)
            accepted = await self._next(job, request, lambda i: isinstance(i, Accepted))
            if accepted is None:
                return self._gone(api)
            if turn.stream:
                self.metrics.request(api, 200)
                headers = {**self._headers(rid), "cache-control": "no-cache", "x-accel-buffering": "no"}
                return StreamingResponse(self._sse(job, turn, adapter, accepted.usage),
                                         media_type="text/event-stream", headers=headers)
            done = await self._next(job, request, lambda i: isinstance(i, Done))
        except ApiError as e:
            return self._error(style, e, rid, api)
        except asyncio.CancelledError:
            if job is not None:
                job.cancel.set()
            raise
        if done is not None and done.cancelled and job.cut:
            return self._error(style, self._cut_error(), rid, api)
        if done is None or done.cancelled:
            return self._gone(api)
        if done.reply.finish is None:
            return self._error(style, ApiError(500, "the generation ended without a result"), rid, api)
        adapter.remember(turn, done.reply, self.api_ctx)
        self.metrics.request(api, 200)
        return JSONResponse(adapter.body(turn, done.reply, self.api_ctx), headers=self._headers(rid))

    async def _sse(self, job: Job, turn, adapter, planned: Usage | None):
        stream = adapter.Stream(turn, self.api_ctx)
        try:
            head = stream.start(planned)
            if head:
                yield head
            while True:
                item = await job.get(self.config.keepalive if self.stop_at is None else 0.1)
                self._cut_if_stopping(job)
                if item is None:
                    yield stream.keepalive()
                elif isinstance(item, Done):
                    if item.cancelled and job.cut:
                        yield stream.error(self._cut_error())
                    return
                elif isinstance(item, ApiError):
                    yield stream.error(item)
                elif not isinstance(item, Accepted):
                    if isinstance(item, Finish):
                        # before the client sees the end: its next request may name this reply
                        adapter.remember(turn, job.reply, self.api_ctx)
                    frames = stream.event(item)
                    if frames:
                        yield frames
        finally:
            job.cancel.set()      # a no-op once the job is done; stops it if the client left

    async def messages(self, request: Request) -> Response:
        return await self._chat(request, anthropic, "anthropic")

    async def chat_completions(self, request: Request) -> Response:
        return await self._chat(request, openai_chat, "openai_chat")

    async def completions(self, request: Request) -> Response:
        return await self._chat(request, openai_completions, "openai_completions")

    async def responses(self, request: Request) -> Response:
        return await self._chat(request, openai_responses, "openai_responses")

    async def count_tokens(self, request: Request) -> Response:
        rid, api = new_id("req_"), "anthropic_count_tokens"
        try:
            turn = anthropic.parse(await self._json(request), self.api_ctx, count_only=True)
            job = self._submit(lambda s: iter([s.count_prompt_tokens(turn.request)]), _Count, rid, api,
                               "anthropic")
            done = await self._next(job, request, lambda i: isinstance(i, Done))
        except ApiError as e:
            return self._error("anthropic", e, rid, api)
        if done is None:
            return self._gone(api)
        self.metrics.request(api, 200)
        return JSONResponse(anthropic.count_body(done.reply.value), headers=self._headers(rid))

    # ---- other endpoints --------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        name = self.api_ctx.model
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        entry = {"id": name, "object": "model", "created": self.created, "owned_by": "zen5",
                 "type": "model", "display_name": name, "created_at": created,
                 "context_window": self.api_ctx.n_ctx}
        return JSONResponse({"object": "list", "data": [entry], "has_more": False,
                             "first_id": name, "last_id": name})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.api_ctx.model, "context": self.api_ctx.n_ctx,
                             "busy": self.worker.busy, "queue_depth": self.worker.depth,
                             "version": zen5.__version__})

    async def prometheus(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.worker.depth, self.worker.busy),
                                 media_type="text/plain; version=0.0.4")

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_spec(self.api_ctx.model))

    # ---- errors and lifecycle ---------------------------------------------------------------
    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(style_for_path(request.url.path), ApiError(exc.status_code, msg), new_id("req_"))

    async def _crash(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = ApiError(500, f"internal error: {type(exc).__name__}")
        return error_response(style_for_path(request.url.path), err, new_id("req_"))

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.worker.start()
        log.info("zen5 %s: serving %s (context %d tokens)", zen5.__version__, self.api_ctx.model, self.api_ctx.n_ctx)
        try:
            yield
        finally:
            await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Drain the queue, save the session (disk checkpoints), close the trace."""
        log.info("shutting down: finishing %d queued request(s)", self.worker.depth)
        self.worker.stop()
        log.info("session: %s", self.session.close())
        self.tracer.close()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]
        middleware = [Middleware(Guard, config=self.config, metrics=self.metrics)]
        if self.config.cors:
            middleware.insert(0, Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                                            allow_headers=["*"], expose_headers=["request-id", "x-request-id"]))
        return Starlette(routes=routes, middleware=middleware, lifespan=self._lifespan,
                         exception_handlers={HTTPException: self._http_error, Exception: self._crash})


