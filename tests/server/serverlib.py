"""Helpers for the server tests: a real `python -m zen5 serve` process per model, an in-process
server over a scripted session (no weights: exact event sequences, errors, overload and
cancellation in milliseconds), SSE parsing and /metrics scraping."""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import requests

from zen5.chat_types import (
    ChatError,
    Finish,
    SampledToken,
    TextDelta,
    ThinkingDelta,
    ThinkingDone,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolResultBlock,
    Usage,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 180.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no /health from {url} after {timeout} s")


class ServerProcess:
    """`python -m zen5 serve` on a free port, with its log and trace in `workdir`."""

    def __init__(self, model: str, workdir: Path, *args: str):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(workdir)
        self.trace_path = self.workdir / "trace.jsonl"
        self.log_path = self.workdir / "server.log"
        cmd = [sys.executable, "-m", "zen5", "serve", "--model", model, "--port", str(self.port),
               "--state-dir", str(self.workdir / "state"), "--trace", str(self.trace_path), *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"{e}; log:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        return parse_metrics(requests.get(self.url + "/metrics", timeout=10).text)

    def trace(self) -> list[dict]:
        if not self.trace_path.exists():
            return []
        return [json.loads(line) for line in self.trace_path.read_text().splitlines() if line.strip()]


def start_server(name: str, workdir: Path, *args: str) -> ServerProcess:
    """A server on the named model, or a skip saying why its weights are absent."""
    import pytest

    from zen5.registry import ModelNotFound, resolve_model

    try:
        resolve_model(name)
    except ModelNotFound as e:
        pytest.skip(str(e))
    return ServerProcess(name, workdir, *args)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sse_events(resp: requests.Response) -> list[tuple[str | None, object]]:
    """(event name, parsed data) for every event of a streamed response; comments dropped."""
    events, name, data = [], None, []
    for raw in resp.iter_lines(decode_unicode=True):
        if raw == "":
            if data:
                payload = "\n".join(data)
                events.append((name, payload if payload == "[DONE]" else json.loads(payload)))
            name, data = None, []
        elif raw.startswith(":"):
            events.append(("comment", raw))
        elif raw.startswith("event:"):
            name = raw[6:].strip()
        elif raw.startswith("data:"):
            data.append(raw[5:].strip())
    return events


# ---- a scripted session (no weights) -------------------------------------------------------
def _usage(reused=0, prefilled=10, completion=5, source="cold") -> Usage:
    return Usage(reused + prefilled, completion, reused, prefilled, source, 0.01, 0.01)


LINE_BREAKS = "a\u2028b\u2029c\x85d\x1ce"   # str.splitlines() breaks at each of them
# the tokens sampled before each event of the "tool" script (FakeSession), in order
TOOL_TOKENS = [["<think>", "Let me "], ["check."], ["</think>"], ["Check", "ing."], ["<tool_call>"],
               ['{"city": '], ['"Paris"}'], ["</tool_call>"]]


def _token(text: str) -> SampledToken:
    return SampledToken(text, text.encode(), -0.5, ((text, text.encode(), -0.5), ("x", b"x", -2.0)))


class FakeSigner:
    """Proves what FakeSession issues (signature "z5s1.sig", blob "z5e1.blob" for its thinking
    "Let me check."), so stored conversations keep exactly what a real session would."""

    @staticmethod
    def proven_text(block) -> str | None:
        ours = getattr(block, "signature", None) == "z5s1.sig" or getattr(block, "data", None) == "z5e1.blob"
        return "Let me check." if ours else None


class FakeSession:
    """Answers by the last user text: "tool" -> thinking, text and a get_weather call; "slow" ->
    200 slow text deltas; "wait" -> a pause before the first event; "breaks" -> text with
    Unicode line breaks; with logprobs asked, each event is preceded by the SampledToken events
    that made it (TOOL_TOKENS: text "Checking." is two tokens); "unknown-id" / "stale" ->
    ChatError 400 / 409; "crash" -> an internal error after the first event. A request whose
    last message holds tool results answers "Sunny." as a live continuation."""

    def __init__(self):
        # the engine surface the server uses: its context and the watch over evaluations (the
        # fake never evaluates; the worker still checks cancellation between events)
        self.engine = SimpleNamespace(n_ctx=4096, watch=lambda check: contextlib.nullcontext(),
                                      tokenizer=SimpleNamespace(max_token_bytes=16))
        self.signer = FakeSigner()
        self.requests = []
        self.cancelled = threading.Event()
        self.closed = False

    def close(self):
        self.closed = True

    def chat(self, request):
        self.requests.append(request)
        last = request.messages[-1]
        text = "".join(getattr(b, "text", "") for b in last.blocks)
        if any(isinstance(b, ToolResultBlock) for b in last.blocks):
            return self._events([TextDelta("Sunny.")], "stop", reused=50, source="live")
        if "unknown-id" in text:
            raise ChatError(400, "unknown tool_use_id toolu_x: replay the full history")
        if "stale" in text:
            raise ChatError(409, "the live state this request continues is gone; replay the full history")
        if "tool" in text:
            cid = request.id_prefix + "0123456789abcdef0123456789abcdef"
            events = [ThinkingDelta("Let me "), ThinkingDelta("check."),
                      ThinkingDone("Let me check.", "z5s1.sig", "z5e1.blob" if request.redact_thinking else None),
                      TextDelta("Checking."), ToolCallStart(cid, "get_weather", 0),
                      ToolCallDelta(cid, '{"city": ', 0), ToolCallDelta(cid, '"Paris"}', 0),
                      ToolCallDone(cid, "get_weather", '{"city": "Paris"}', 0)]
            if request.logprobs is not None:
                tokens = iter(TOOL_TOKENS)
                events = [x for ev in events for x in ([_token(t) for t in next(tokens)] + [ev])]
            return self._events(events, "tool_calls")
        if "slow" in text:
            return self._slow()
        if "wait" in text:
            return self._events([TextDelta("done")], "stop", delay=1.0)
        if "crash" in text:
            return self._crash()
        if "breaks" in text:
            return self._events([TextDelta(LINE_BREAKS)], "stop")
        return self._events([TextDelta("Hello"), TextDelta(" world")], "stop")

    def _events(self, events, reason, delay=0.0, reused=0, source="cold"):
        if delay:
            time.sleep(delay)
        yield from events
        yield Finish(reason, _usage(reused=reused, source=source))

    def _slow(self):
        try:
            for i in range(200):
                time.sleep(0.02)
                yield TextDelta(f"{i} ")
            yield Finish("length", _usage(completion=200))
        except GeneratorExit:
            self.cancelled.set()
            raise

    def _crash(self):
        yield TextDelta("a")
        raise RuntimeError("boom")


class InProcessServer:
    """The real app and uvicorn, in a thread, over any session object."""

    def __init__(self, session, **config):
        import uvicorn

        from zen5.server import ServerConfig, ZenServer
        from zen5.server.connections import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = ServerConfig(port=self.port, **config)
        self.zen = ZenServer(config, session, "fake")
        cfg = uvicorn_config(self.zen.app(), config, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.url, timeout=20)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(requests.get(self.url + "/metrics", timeout=10).text)
