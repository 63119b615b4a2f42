"""Counters for /metrics (Prometheus text format), written by the worker and the handlers."""
from __future__ import annotations

import threading

from zen5.chat_types import Usage


class Metrics:
    """Request, cache and speed counters; every method may be called from any thread."""

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
