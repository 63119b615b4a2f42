"""Bounds on connections, so slow or idle clients cannot hold the server forever: at most
--max-connections at once (uvicorn answers more with 503), a client that opens a connection
must send a request's headers within --read-timeout, and a body must keep arriving (app.py
reads it with the same timeout). A response in progress is never cut: streams and long
prefills are the work, and their keep-alives show the client is still there."""
from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from zen5.server.config import ServerConfig


class _Connection(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that sits without a request in progress
    (headers never finished: slowloris) for longer than the read timeout. (uvicorn itself only
    times out the idle gap after a response, and only once bytes stop arriving.)"""
    read_timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        waiting_for = self.cycle
        self.loop.call_later(self.read_timeout, self._drop_if_no_request, waiting_for)

    def _drop_if_no_request(self, waiting_for) -> None:
        if self.cycle is waiting_for and not self.transport.is_closing():   # no new request began
            self.transport.close()


def uvicorn_config(app, config: ServerConfig, **overrides) -> uvicorn.Config:
    """The one place uvicorn's settings come from (serve() and the in-process test server)."""
    protocol = type("Connection", (_Connection,), {"read_timeout": config.read_timeout})
    settings = dict(host=config.host, port=config.port, log_level="info", access_log=False,
                    timeout_graceful_shutdown=config.shutdown_timeout, limit_concurrency=config.max_connections,
                    http=protocol)
    return uvicorn.Config(app, **{**settings, **overrides})
