"""The HTTP server: OpenAI and Anthropic APIs over one ChatSession (`python -m zen5 serve`).

Ownership is the design. The model state (engine, KV cache, session, tool memory) belongs to ONE
worker thread (worker.py); HTTP handlers on the event loop (app.py) only parse, validate and
enqueue a job, then relay its events. A request is answered in order, one at a time, so the live
state a tool loop relies on is never disturbed half-way, and there are no locks around the model.
Long prefills run in chunks (bit-identical to one batch): progress is logged and SSE streams
send keep-alives meanwhile. Clean shutdown (SIGINT/SIGTERM) stops accepting, drains the queue,
then calls `session.close()` (disk checkpoints are saved there).

    config.py   ServerConfig: every setting, defined once
    app.py      routes, handlers, guards (auth, body limit)
    worker.py   the thread that owns the session; jobs, cancellation
    guards.py   Host/Origin checks, the HEAD probe, the API key
    connections.py  uvicorn settings; connection cap and read timeouts
    metrics.py  /metrics counters          tracing.py  --trace FILE
"""
from __future__ import annotations

import logging
import signal
from pathlib import Path

import uvicorn

from zen5.checkpoints import CheckpointStore
from zen5.engine import Engine
from zen5.server.app import ZenServer
from zen5.server.config import ServerConfig
from zen5.server.connections import uvicorn_config
from zen5.session import ChatSession

__all__ = ["ServerConfig", "ZenServer", "model_name", "serve"]
log = logging.getLogger("zen5.server")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown begins (it has no hook of its own)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


def model_name(model: str) -> str:
    """The name /v1/models reports: a registry name as is, a path by its file or folder name."""
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name or model


def _checkpoint_store(config: ServerConfig, engine: Engine) -> CheckpointStore:
    """Disk checkpoints under STATE_DIR/checkpoints/<Engine.cache_id> (one directory per model
    and cache layout: a store removes files it cannot restore)."""
    base = Path(config.state_dir) if config.state_dir else Path.home() / ".cache" / "zen5"
    return CheckpointStore(base / "checkpoints" / engine.cache_id)


def serve(config: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine.load(config.model, threads=config.threads, n_ctx=config.n_ctx, matmul=config.matmul,
                         kv_type=config.kv_type, lookup=config.lookup, qat=config.qat,
                         weight_cache=config.weight_cache)
    session = ChatSession(engine, state_dir=config.state_dir)
    if session.keeps_state:   # else it said in one line that it runs without disk state
        session.use_checkpoints(_checkpoint_store(config, engine))
    server = ZenServer(config, session, model_name(config.model))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal under the
    # handlers it found: make those no-ops so a clean shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Uvicorn(uvicorn_config(server.app(), config), server.begin_shutdown).run()
    log.info("stopped")
    return 0

