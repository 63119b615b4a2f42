"""One error type for every front door, answered in each protocol's own shape.

Clients decide what to do from the shape, not the text: the Anthropic SDK retries on 429/529/5xx
and on `x-should-retry: true`, Claude Code backs off on `overloaded_error`, the OpenAI SDK maps the
status to an exception class. So an error carries a neutral `kind` and the HTTP status, and the
renderers below spell it the way each client expects. Messages say what to fix; a bad request is
never a 500.
"""
from __future__ import annotations

from starlette.responses import JSONResponse

# neutral kind -> (Anthropic error.type, OpenAI error.type)
_TYPES = {
    "invalid_request": ("invalid_request_error", "invalid_request_error"),
    "authentication": ("authentication_error", "authentication_error"),
    "permission": ("permission_error", "permission_error"),
    "not_found": ("not_found_error", "invalid_request_error"),
    "too_large": ("request_too_large", "invalid_request_error"),
    "overloaded": ("overloaded_error", "rate_limit_error"),
    "server": ("api_error", "server_error"),
}
_KIND_BY_STATUS = {400: "invalid_request", 401: "authentication", 403: "permission", 404: "not_found",
                   405: "not_found", 408: "invalid_request", 409: "invalid_request", 413: "too_large",
                   422: "invalid_request", 429: "overloaded", 503: "server", 529: "overloaded"}


class ApiError(Exception):
    """An answer that is not a completion. `param` names the offending field (OpenAI's `param`);
    `details` is extra machine-readable context (Anthropic threads read `details.error_code`)."""

    def __init__(self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
                 code: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _KIND_BY_STATUS.get(status, "server" if status >= 500 else "invalid_request")
        self.param = param
        self.code = code
        self.details = details


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def overloaded(style: str) -> ApiError:
    """The queue is full: Anthropic clients expect 529 overloaded_error, OpenAI clients 429."""
    status = 529 if style == "anthropic" else 429
    return ApiError(status, "the server is busy: its request queue is full; retry shortly",
                    kind="overloaded", code="server_overloaded")


def anthropic_body(err: ApiError, request_id: str) -> dict:
    error = {"type": _TYPES[err.kind][0], "message": err.message}
    if err.details:
        error["details"] = err.details
    return {"type": "error", "error": error, "request_id": request_id}


def openai_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": _TYPES[err.kind][1], "param": err.param,
                      "code": err.code}}


def error_body(style: str, err: ApiError, request_id: str) -> dict:
    return anthropic_body(err, request_id) if style == "anthropic" else openai_body(err)


def retry_headers(err: ApiError) -> dict[str, str]:
    """Tell SDKs whether a retry can help: only overload and server faults are transient (a 409
    for vanished live state will not go away by repeating the same request)."""
    transient = err.kind in ("overloaded", "server")
    headers = {"x-should-retry": "true" if transient else "false"}
    if err.kind == "overloaded":
        headers["retry-after-ms"] = "500"
        headers["retry-after"] = "1"
    return headers


def error_response(style: str, err: ApiError, request_id: str) -> JSONResponse:
    headers = {"request-id": request_id, "x-request-id": request_id, **retry_headers(err)}
    return JSONResponse(error_body(style, err, request_id), status_code=err.status, headers=headers)


def style_for_path(path: str) -> str:
    """Which error shape a path's clients understand (used before any adapter has run)."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"
