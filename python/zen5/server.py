"""The HTTP server: OpenAI and Anthropic APIs over one ChatSession (`python -m zen5 serve`).

Ownership is the design. The model state (engine, KV cache, session, tool memory) belongs to ONE
worker thread; HTTP handlers on the event loop only parse, validate and enqueue a job, then relay
its events. A request is answered in order, one at a time, so the live state a tool loop relies
on is never disturbed half-way, and there are no locks around the model. Between the threads:
  - a bounded `queue.Queue` of jobs (full: the protocol's overload error, Anthropic 529 /
    OpenAI 429, with retry hints);
  - per job an `asyncio.Queue` the worker feeds with `call_soon_threadsafe`;
  - per job a cancel flag the handler sets when its client goes away. The worker's engine checks
    it before every evaluation (each sampled token, each prefill chunk), so a disconnect stops the
    work within one token and the next request starts at once.
Long prefills run in chunks (bit-identical to one batch): progress is logged and SSE streams
send keep-alives meanwhile. Clean shutdown (SIGINT/SIGTERM) stops accepting, drains the queue,
then calls `session.close()` where the session has one (disk checkpoints are saved there).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

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
from zen5.api.errors import ApiError, bad_request, error_response, overloaded, style_for_path
from zen5.api.fields import parse_json_object
from zen5.api.openapi import openapi_spec
from zen5.chat_types import ChatError, Finish, Usage
from zen5.engine import Engine

log = logging.getLogger("zen5.server")
MAX_BODY = 64 << 20


@dataclass
class ServerConfig:
    """Every serve setting, defaults defined once (the CLI derives its flags from these)."""
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 8080
    threads: int | None = None
    ctx: int | None = None
    matmul: str | None = None    # "int8" | "f32" (Engine.load), None: the engine's default
    kv_type: str | None = None   # "f16" | "f32" | "q8_0" (Engine.load), None: the matmul's default
    lookup: int | None = None    # guesses per decode step (Engine.load), None: the engine's default
    api_key: str | None = None
    cors: bool = False
    trace: str | None = None
    queue: int = 16              # requests that may wait while one runs
    state_dir: str | None = None
    max_output: int | None = None
    keepalive: float = 5.0       # seconds between SSE keep-alives while nothing else is sent
    shutdown_timeout: int = 30   # seconds open streams get to finish on shutdown


# ---- the worker's engine: cancellable, chunked prefill ---------------------------------------
class Cancelled(Exception):
    """The client of the running job went away."""


class ServingEngine(Engine):
    """An Engine whose evaluations check the running job's cancel flag, and whose long prefills
    run in chunks (the KV cache makes chunked prefill bit-identical to one batch) with a
    progress line in the server log every 2 s and a summary line at the end."""
    PREFILL_CHUNK = 256
    job: "Job | None" = None

    def append(self, tokens: list[int], all_logits: bool = False):
        job = self.job
        if job is not None and job.cancel.is_set():
            raise Cancelled()
        if job is None or all_logits or len(tokens) <= self.PREFILL_CHUNK:
            return super().append(tokens, all_logits)
        t0 = last = time.perf_counter()
        for i in range(0, len(tokens), self.PREFILL_CHUNK):
            if job.cancel.is_set():
                raise Cancelled()
            super().append(tokens[i:i + self.PREFILL_CHUNK])
            now = time.perf_counter()
            if now - last >= 2.0:
                done = min(i + self.PREFILL_CHUNK, len(tokens))
                log.info("%s: prefill %d/%d tokens (%.0f tok/s)", job.request_id, done, len(tokens),
                         done / (now - t0))
                last = now
        took = time.perf_counter() - t0
        log.info("%s: prefill %d tokens done in %.2f s (%.0f tok/s)", job.request_id, len(tokens), took,
                 len(tokens) / took)


# ---- metrics ---------------------------------------------------------------------------------
class Metrics:
    """Counters for /metrics (Prometheus text). Written by the worker and the handlers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.cache_source: dict[str, int] = {}
        self.reused = self.prefilled = self.generated = 0
        self.prefill_s = self.decode_s = 0.0
        self.last_prefill_tps = self.last_decode_tps = 0.0
        self.rejected = self.cancelled = self.degraded = 0
        self.guessed = self.guesses_kept = 0

    def request(self, api: str, status: int) -> None:
        with self.lock:
            self.requests[(api, status)] = self.requests.get((api, status), 0) + 1

    def usage(self, u: Usage, n_diagnostics: int) -> None:
        with self.lock:
            self.cache_source[u.cache_source] = self.cache_source.get(u.cache_source, 0) + 1
            self.reused += u.reused_tokens
            self.prefilled += u.prefilled_tokens
            self.generated += u.completion_tokens
            self.guessed += u.guessed_tokens
            self.guesses_kept += u.kept_tokens
            self.prefill_s += u.prefill_seconds
            self.decode_s += u.decode_seconds
            if u.prefilled_tokens and u.prefill_seconds > 0:
                self.last_prefill_tps = u.prefilled_tokens / u.prefill_seconds
            if u.completion_tokens and u.decode_seconds > 0:
                self.last_decode_tps = u.completion_tokens / u.decode_seconds
            self.degraded += n_diagnostics

    def render(self, queue_depth: int, busy: bool) -> str:
        with self.lock:
            lines = []

            def metric(name, kind, help_, samples):
                lines.extend([f"# HELP zen5_{name} {help_}", f"# TYPE zen5_{name} {kind}"])
                for labels, value in samples:
                    lines.append(f"zen5_{name}{labels} {value:g}" if isinstance(value, float)
                                 else f"zen5_{name}{labels} {value}")

            metric("requests_total", "counter", "Requests answered, by API and HTTP status.",
                   [(f'{{api="{a}",status="{s}"}}', n) for (a, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_reused_total", "counter", "Prompt tokens served from the KV cache.",
                   [("", self.reused)])
            metric("prompt_tokens_prefilled_total", "counter", "Prompt tokens computed (prefilled).",
                   [("", self.prefilled)])
            metric("completion_tokens_total", "counter", "Tokens generated.", [("", self.generated)])
            metric("lookup_guessed_tokens_total", "counter",
                   "Tokens guessed by prompt lookup and evaluated alongside a decoded token.", [("", self.guessed)])
            metric("lookup_kept_tokens_total", "counter",
                   "Guessed tokens the sampler then picked (generated without an evaluation of their own).",
                   [("", self.guesses_kept)])
            metric("cache_source_total", "counter", "Requests by the cache rung that served them.",
                   [(f'{{source="{k}"}}', v) for k, v in sorted(self.cache_source.items())])
            metric("prefill_seconds_total", "counter", "Time spent prefilling.", [("", self.prefill_s)])
            metric("decode_seconds_total", "counter", "Time spent decoding.", [("", self.decode_s)])
            metric("prefill_tokens_per_second", "gauge", "Prefill speed of the last request that prefilled.",
                   [("", self.last_prefill_tps)])
            metric("decode_tokens_per_second", "gauge", "Decode speed of the last request that decoded.",
                   [("", self.last_decode_tps)])
            metric("queue_depth", "gauge", "Requests waiting for the worker.", [("", queue_depth)])
            metric("busy", "gauge", "1 while the worker runs a request.", [("", int(busy))])
            metric("requests_rejected_total", "counter", "Requests refused because the queue was full.",
                   [("", self.rejected)])
            metric("requests_cancelled_total", "counter", "Requests stopped because the client went away.",
                   [("", self.cancelled)])
            metric("degraded_replays_total", "counter", "History replays rendered canonically (diagnostics).",
                   [("", self.degraded)])
            return "\n".join(lines) + "\n"


# ---- jobs and the worker ---------------------------------------------------------------------
@dataclass
class Accepted:
    """The request passed the session's checks; its events follow. `usage`: the counts its plan
    predicts, before any prefill (None for jobs that are not chats)."""
    usage: Usage | None = None


@dataclass
class Done:
    reply: object             # the assembled reply (api.conversations.Reply or the adapter's own)
    cancelled: bool = False


@dataclass
class Job:
    """One request on its way through the worker. `start(session)` returns the event iterator
    and raises ChatError (before any event) for requests the session refuses."""
    start: Callable
    new_reply: Callable
    loop: asyncio.AbstractEventLoop
    request_id: str
    api: str
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    reply: object = None      # set by the worker; complete once the Finish event is queued

    def put(self, item) -> None:
        """Called on the worker thread."""
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    async def get(self, timeout: float):
        """The next item, or None after `timeout` seconds without one."""
        try:
            return await asyncio.wait_for(self.items.get(), timeout)
        except asyncio.TimeoutError:
            return None


class Tracer:
    """--trace FILE: one JSON line per request with the rendered prompt, the cache decision and
    the parsed output. Written on the worker thread."""

    def __init__(self, path: str | None):
        self.file = open(path, "a", encoding="utf-8") if path else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Worker:
    def __init__(self, session, metrics: Metrics, tracer: Tracer, queue_size: int):
        self.session = session
        self.metrics, self.tracer = metrics, tracer
        self.jobs: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.busy = False
        self.thread = threading.Thread(target=self._loop, name="zen5-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job, style: str) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            with self.metrics.lock:
                self.metrics.rejected += 1
            raise overloaded(style) from None

    @property
    def depth(self) -> int:
        return self.jobs.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, then end the thread."""
        self.jobs.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.busy = True
            try:
                self._run(job)
            except Exception:  # never let one request take the worker down
                log.exception("%s: worker error", job.request_id)
                job.put(Done(job.new_reply()))
            finally:
                self.busy = False

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():          # its client left while it waited
            self._count_cancel()
            job.put(Done(job.new_reply(), cancelled=True))
            return
        engine = getattr(self.session, "engine", None)
        if isinstance(engine, ServingEngine):
            engine.job = job
        try:
            events = self._open(job)
            if events is not None:
                self._relay(job, events)
        finally:
            if isinstance(engine, ServingEngine):
                engine.job = None

    def _open(self, job: Job) -> Iterator | None:
        try:
            events = job.start(self.session)
        except ChatError as e:
            job.put(ApiError(e.status, e.message))
        except (ValueError, zen5.ContextOverflow) as e:
            job.put(bad_request(str(e)))
        except Exception as e:
            log.exception("%s: could not start", job.request_id)
            job.put(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        else:
            job.put(Accepted(getattr(events, "usage", None)))
            return events
        job.put(Done(job.new_reply()))
        return None

    def _relay(self, job: Job, events: Iterator) -> None:
        reply, cancelled, usage, final = job.new_reply(), False, None, None
        job.reply = reply
        try:
            for ev in events:
                if job.cancel.is_set():
                    raise Cancelled()
                reply.add(ev)
                recorded = self._record(ev)
                if recorded is None:
                    job.put(ev)
                else:
                    # The event that carries usage ends the client's stream: hold it until the
                    # metrics and the trace are written, so a client that reads /metrics right
                    # after its reply sees this request counted.
                    usage, final = recorded, ev
        except Cancelled:
            cancelled = True
            self._count_cancel()
            close = getattr(events, "close", None)
            if close is not None:
                close()
        except ChatError as e:
            job.put(ApiError(e.status, e.message))
        except Exception as e:
            log.exception("%s: generation failed", job.request_id)
            job.put(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        self._trace(job, reply, usage, cancelled)
        if final is not None and not cancelled:
            job.put(final)
        job.put(Done(reply, cancelled))

    def _record(self, ev) -> Usage | None:
        """Metrics from a request's final event (chat Finish, or a completion's last piece)."""
        if isinstance(ev, Finish):
            self.metrics.usage(ev.usage, len(ev.diagnostics))
            return ev.usage
        u = getattr(ev, "usage", None)
        if u is None:
            return None
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.reused_tokens,
                      u.prompt_tokens - u.reused_tokens, "token_prefix" if u.reused_tokens else "cold",
                      u.prefill_seconds, u.decode_seconds, u.guessed_tokens, u.kept_tokens)
        self.metrics.usage(usage, 0)
        return usage

    def _count_cancel(self) -> None:
        with self.metrics.lock:
            self.metrics.cancelled += 1

    def _trace(self, job: Job, reply, usage: Usage | None, cancelled: bool) -> None:
        if self.tracer.file is None:
            return
        record = {"time": time.time(), "request_id": job.request_id, "api": job.api, "cancelled": cancelled}
        engine = getattr(self.session, "engine", None)
        if usage is not None:
            record["cache"] = {"source": usage.cache_source, "reused": usage.reused_tokens,
                               "prefilled": usage.prefilled_tokens, "prompt_tokens": usage.prompt_tokens,
                               "completion_tokens": usage.completion_tokens}
            if engine is not None:
                record["prompt"] = engine.tokenizer.decode(list(engine.tokens[:usage.prompt_tokens]))
        finish = getattr(reply, "finish", None)
        record["finish"] = getattr(finish, "reason", None) or getattr(finish, "finish_reason", None)
        record["diagnostics"] = list(getattr(finish, "diagnostics", ()))
        record["output"] = reply.summary()
        self.tracer.write(record)


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


def count_prompt_tokens(session, request) -> int:
    """Prompt tokens of a request as the session renders it (one rendering path: a split
    assistant turn counts as the bundled turn it renders as)."""
    return session.count_prompt_tokens(request)


# ---- HTTP --------------------------------------------------------------------------------------
class HeadProbe:
    """Answer `HEAD` on any path with 200 and no body: Claude Code probes `HEAD /` or
    `HEAD /api/hello` before its first request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


class ZenServer:
    """Routes, handlers and lifecycle around one Worker."""

    def __init__(self, config: ServerConfig, session, model_name: str):
        self.config = config
        self.session = session
        self.metrics = Metrics()
        self.tracer = Tracer(config.trace)
        self.worker = Worker(session, self.metrics, self.tracer, config.queue)
        self.ctx = ApiContext(model_name, session.engine.n_ctx, config.max_output)
        self.created = int(time.time())

    # ---- plumbing ---------------------------------------------------------------------------
    @staticmethod
    async def _json(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request body is {len(raw)} bytes, over the limit of {MAX_BODY}")
        return parse_json_object(raw)

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
            turn = adapter.parse(await self._json(request), self.ctx)
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
        if done is None or done.cancelled:
            return self._gone(api)
        if done.reply.finish is None:
            return self._error(style, ApiError(500, "the generation ended without a result"), rid, api)
        adapter.remember(turn, done.reply, self.ctx)
        self.metrics.request(api, 200)
        return JSONResponse(adapter.body(turn, done.reply, self.ctx), headers=self._headers(rid))

    async def _sse(self, job: Job, turn, adapter, planned: Usage | None):
        stream = adapter.Stream(turn, self.ctx)
        try:
            head = stream.start(planned)
            if head:
                yield head
            while True:
                item = await job.get(self.config.keepalive)
                if item is None:
                    yield stream.keepalive()
                elif isinstance(item, Done):
                    return
                elif isinstance(item, ApiError):
                    yield stream.error(item)
                elif not isinstance(item, Accepted):
                    if isinstance(item, Finish):
                        # before the client sees the end: its next request may name this reply
                        adapter.remember(turn, job.reply, self.ctx)
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
            turn = anthropic.parse(await self._json(request), self.ctx, count_only=True)
            job = self._submit(lambda s: iter([count_prompt_tokens(s, turn.request)]), _Count, rid, api,
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
        name = self.ctx.model
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        entry = {"id": name, "object": "model", "created": self.created, "owned_by": "zen5",
                 "type": "model", "display_name": name, "created_at": created,
                 "context_window": self.ctx.n_ctx}
        return JSONResponse({"object": "list", "data": [entry], "has_more": False,
                             "first_id": name, "last_id": name})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.ctx.model, "context": self.ctx.n_ctx,
                             "busy": self.worker.busy, "queue_depth": self.worker.depth,
                             "version": zen5.__version__})

    async def prometheus(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.worker.depth, self.worker.busy),
                                 media_type="text/plain; version=0.0.4")

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_spec(self.ctx.model))

    # ---- cross-cutting ----------------------------------------------------------------------
    def _auth(self, app):
        """--api-key: every /v1/ path needs `x-api-key: K` or `Authorization: Bearer K` (clients
        send either); a 401 comes in the path's protocol shape."""
        key = self.config.api_key

        async def check(scope, receive, send):
            if scope["type"] == "http" and key and scope["path"].startswith("/v1/"):
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
                auth = headers.get("authorization", "")
                given = headers.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else "")
                # compared as bytes: a header holds the client's bytes (decoded latin-1 above, so
                # .encode("latin-1") restores them) and a UTF-8 client sends a non-ASCII key as UTF-8
                if not secrets.compare_digest(given.strip().encode("latin-1"), key.encode("utf-8")):
                    err = ApiError(401, "invalid or missing API key: send it as `x-api-key` or "
                                        "`Authorization: Bearer`")
                    self.metrics.request("auth", 401)
                    await error_response(style_for_path(scope["path"]), err, new_id("req_"))(scope, receive, send)
                    return
            await app(scope, receive, send)
        return check

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
        log.info("zen5 %s: serving %s (context %d tokens)", zen5.__version__, self.ctx.model, self.ctx.n_ctx)
        try:
            yield
        finally:
            await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Drain the queue, save the session (disk checkpoints), close the trace."""
        log.info("shutting down: finishing %d queued request(s)", self.worker.depth)
        self.worker.stop()
        close = getattr(self.session, "close", None)
        if callable(close):
            close()
            log.info("session state saved")
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
        middleware = [Middleware(HeadProbe), Middleware(lambda app: self._auth(app))]
        if self.config.cors:
            middleware.insert(0, Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                                            allow_headers=["*"], expose_headers=["request-id", "x-request-id"]))
        return Starlette(routes=routes, middleware=middleware, lifespan=self._lifespan,
                         exception_handlers={HTTPException: self._http_error, Exception: self._crash})


def model_name(model: str) -> str:
    """The name /v1/models reports: a registry name as is, a path by its file or folder name."""
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name or model


def _checkpoint_store(config: ServerConfig, engine: Engine) -> dict:
    """Disk checkpoints under STATE_DIR/checkpoints/<Engine.cache_id> (one directory per model
    and cache layout: a store removes files it cannot restore), where the module is available."""
    try:
        from zen5.checkpoints import CheckpointStore
    except ImportError:
        return {}
    base = Path(config.state_dir) if config.state_dir else Path.home() / ".cache" / "zen5"
    return {"checkpoints": CheckpointStore(base / "checkpoints" / engine.cache_id)}


def serve(config: ServerConfig) -> int:
    import uvicorn

    from zen5.session import ChatSession

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = ServingEngine.load(config.model, threads=config.threads, ctx=config.ctx, matmul=config.matmul,
                                 kv_type=config.kv_type, lookup=config.lookup)
    session = ChatSession(engine, state_dir=config.state_dir, **_checkpoint_store(config, engine))
    server = ZenServer(config, session, model_name(config.model))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal under the
    # handlers it found: make those no-ops so a clean shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(server.app(), host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=config.shutdown_timeout, access_log=False)
    log.info("stopped")
    return 0
