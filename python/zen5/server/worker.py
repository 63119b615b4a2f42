"""The worker: the one thread that owns the model state, and the jobs handed to it.

HTTP handlers on the event loop parse, validate and enqueue a `Job`; the worker runs jobs one at
a time, in order, and feeds each job's events back to its handler. Between the threads:
  - a bounded `queue.Queue` of jobs (full: the protocol's overload error, with retry hints);
  - per job an `asyncio.Queue` the worker feeds with `call_soon_threadsafe`;
  - per job a cancel flag the handler sets when its client goes away. The worker watches the
    engine's evaluations (`Engine.watch`): before each one (each sampled token, each prefill
    chunk) a set flag stops the work, so the next request starts within one token.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import zen5
from zen5.api.errors import ApiError, bad_request, overloaded
from zen5.chat_types import ChatError, Finish, Usage
from zen5.engine import Engine
from zen5.server.metrics import Metrics
from zen5.server.tracing import Tracer

log = logging.getLogger("zen5.server")


class Cancelled(Exception):
    """The client of the running job went away (or the server stopped it)."""


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
    cut: bool = False         # cancelled by the server's shutdown, not by its client

    def put(self, item) -> None:
        """Called on the worker thread."""
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    async def get(self, timeout: float):
        """The next item, or None after `timeout` seconds without one."""
        try:
            return await asyncio.wait_for(self.items.get(), timeout)
        except asyncio.TimeoutError:
            return None


class Watch:
    """What the worker checks before each of the engine's evaluations for one job: its cancel
    flag, and for a long prefill a progress line in the server log every 2 s and a summary at
    the end."""
    PROGRESS_EVERY = 2.0

    def __init__(self, job: Job):
        self.job = job
        self.t0 = self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if done < total and self.job.cancel.is_set():   # before an evaluation: nothing half-done
            raise Cancelled()
        long = total > Engine.WATCH_CHUNK
        now = time.perf_counter()
        if done == 0:
            self.t0 = self.last = now
        elif long and done == total:
            took = now - self.t0
            log.info("%s: prefill %d tokens done in %.2f s (%.0f tok/s)", self.job.request_id, total, took,
                     total / took)
        elif long and now - self.last >= self.PROGRESS_EVERY:
            log.info("%s: prefill %d/%d tokens (%.0f tok/s)", self.job.request_id, done, total,
                     done / (now - self.t0))
            self.last = now


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
        with self.session.engine.watch(Watch(job)):
            events = self._open(job)
            if events is not None:
                self._relay(job, events)

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
        engine = self.session.engine
        if usage is not None:
            record["cache"] = {"source": usage.cache_source, "reused": usage.reused_tokens,
                               "prefilled": usage.prefilled_tokens, "prompt_tokens": usage.prompt_tokens,
                               "completion_tokens": usage.completion_tokens}
            record["prompt"] = engine.tokenizer.decode(list(engine.tokens[:usage.prompt_tokens]))
        finish = getattr(reply, "finish", None)
        record["finish"] = getattr(finish, "reason", None) or getattr(finish, "finish_reason", None)
        record["diagnostics"] = list(getattr(finish, "diagnostics", ()))
        record["output"] = reply.summary()
        self.tracer.write(record)


