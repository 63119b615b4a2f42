"""What every request passes before a handler sees it: the Host and Origin checks, the HEAD
probe and the API key. Each refusal comes in the path's protocol error shape.

Why a Host and an Origin check: a web page open in the user's browser can POST to a server on
localhost (as `text/plain`, a "simple" request that needs no CORS preflight), and drive
generation; with DNS rebinding (a hostile name that resolves to 127.0.0.1) it can also read the
answers. Browsers always send `Origin` on such requests and the rebound name in `Host`; the SDKs,
Claude Code, Codex and curl send no `Origin` and the address they dialled as `Host`.
"""
from __future__ import annotations

import ipaddress
import secrets
from urllib.parse import urlsplit

from zen5.api import new_id
from zen5.api.errors import ApiError, error_response, style_for_path
from zen5.server.config import ServerConfig
from zen5.server.metrics import Metrics

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """The names a request's Host may carry (port stripped), or None for any. Bound to a
    loopback address: the loopback names and the bound address. Bound to every interface
    (0.0.0.0 or ::): any name, as the machine's names cannot be known here; --api-key is then
    the guard. --allowed-hosts adds names (a reverse proxy's, say) or `*` for any."""
    extra = {h.strip().lower() for h in (config.allowed_hosts or "").split(",") if h.strip()}
    if "*" in extra:
        return None
    bound = config.host.strip("[]").lower()
    try:
        address = ipaddress.ip_address(bound)
        if address.is_unspecified:
            return None
        loopback = address.is_loopback
    except ValueError:           # a host name
        loopback = bound == "localhost"
    return frozenset({bound, *extra, *(_LOOPBACK_NAMES if loopback else ())})


def _hostname(url: str) -> str:
    """The host of a URL (`Origin`) or of `//` + a Host header: lower case, without port or
    IPv6 brackets; "" when it does not parse."""
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


def _headers(scope) -> dict[str, str]:
    # latin-1 keeps the client's bytes one to one (the API key comparison relies on it)
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _refuse(scope, receive, send, status: int, message: str, metrics: Metrics) -> None:
    metrics.request("guard", status)
    err = ApiError(status, message)
    await error_response(style_for_path(scope["path"]), err, new_id("req_"))(scope, receive, send)


class Guard:
    """ASGI middleware: Host, Origin, HEAD probe, API key, in that order."""

    def __init__(self, app, config: ServerConfig, metrics: Metrics):
        self.app, self.config, self.metrics = app, config, metrics
        self.hosts = allowed_hosts(config)
        self.key = config.api_key.encode("utf-8") if config.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        if self.hosts is not None and _hostname("//" + headers.get("host", "")) not in self.hosts:
            return await _refuse(scope, receive, send, 403,
                                 f"Host {headers.get('host', '')!r} is not this server's address; a client "
                                 "that reaches it by another name needs --allowed-hosts NAME", self.metrics)
        origin = headers.get("origin")
        if origin is not None and not self.config.cors and not self._same_origin(origin):
            return await _refuse(scope, receive, send, 403,
                                 f"cross-origin request from {origin!r} refused: browsers may call this "
                                 "server only when it runs with --cors", self.metrics)
        if scope["method"] == "HEAD":
            # Claude Code probes `HEAD /` or `HEAD /api/hello` before its first request, maybe
            # without its key: 200 with no body says only what a TCP connect says already.
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if self.key is not None and scope["path"] != "/health" and not self._key_matches(headers):
            return await _refuse(scope, receive, send, 401, "invalid or missing API key: send it as "
                                 "`x-api-key` or `Authorization: Bearer`", self.metrics)
        await self.app(scope, receive, send)

    def _same_origin(self, origin: str) -> bool:
        """A page served from this server's own address (none is today; the rule is the web's)."""
        return self.hosts is not None and _hostname(origin) in self.hosts

    def _key_matches(self, headers: dict[str, str]) -> bool:
        """`x-api-key: K` or `Authorization: Bearer K` (clients send either). Compared as bytes:
        a UTF-8 client sends a non-ASCII key as UTF-8, and latin-1 restores its bytes."""
        auth = headers.get("authorization", "")
        given = headers.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else "")
        return secrets.compare_digest(given.strip().encode("latin-1"), self.key)
