"""Every `python -m zen5 serve` setting, defaults defined once (the CLI derives its flags)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 8080
    threads: int | None = None
    n_ctx: int | None = None
    matmul: str | None = None    # "int8" | "f32" (Engine.load), None: the engine's default
    kv_type: str | None = None   # "f16" | "f32" | "q8_0" (Engine.load), None: the matmul's default
    lookup: int | None = None    # guesses per decode step (Engine.load), None: the engine's default
    qat: bool | None = None      # DeepSeek V4 QAT simulations (Engine.load), None: on (or ZEN5_QAT_SIM)
    weight_cache: str | None = None  # packed-weight cache directory or "off" (Engine.load), None: the default
    api_key: str | None = None   # required on every path but /health (and HEAD probes)
    cors: bool = False           # allow browsers (any Origin); off: a request with a foreign Origin is a 403
    allowed_hosts: str | None = None  # extra names for the Host check, comma-separated; "*": any
    trace: str | None = None
    queue: int = 16              # requests that may wait while one runs
    state_dir: str | None = None
    max_output: int | None = None
    keepalive: float = 5.0       # seconds between SSE keep-alives while nothing else is sent
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on shutdown
    max_connections: int = 64    # open connections at once; more are answered 503
    read_timeout: float = 30.0   # seconds a client may take to send its headers, or between body bytes
