"""The one error format of the HTTP API: OpenAI's `{"error": {"message", "type", "param", "code"}}`.

Every 4xx and 5xx answer carries it, whichever layer refuses the request (authentication, body
limits, validation, the engine, an unexpected exception). `ERROR_STATUSES` lists what a route may
answer besides 200, for the OpenAPI document.

Every 4xx answer, whichever layer sent it, is logged once (`RejectionLogMiddleware`: a
`kvsplice.rejected` line with the status, route, the error's param and message and the request id).

An exception no handler expected becomes a 500 whose message names the request id (the id the
handler bound with `bind_request_id`, or a fresh one), logged with its traceback under that id
(`InternalErrorMiddleware`), never Starlette's plain-text "Internal Server Error".
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvsplice.server.protocol import ErrorInfo, ErrorResponse
from kvsplice.server.request_log import rejected_record

LOG = logging.getLogger("kvsplice.server")
REQUEST_ID_STATE_KEY = "kvsplice_request_id"
# kvsplice's ValueErrors name the field first: "temperature: must be a finite number >= 0, got -1".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")

# Why each status is sent (the OpenAPI document's descriptions).
ERROR_STATUSES: Mapping[int, str] = {
    400: "bad request: malformed JSON, a wrong type, a value out of range, a field that is not supported",
    401: "missing or wrong API key (`Authorization: Bearer <key>`)",
    403: "refused: admin routes do not take requests from a web page (a request with an Origin header)",
    404: "unknown model or route",
    405: "method not allowed (admin routes are POST only)",
    413: "the request body is larger than the server's limit",
    500: "the request failed inside the server (the message names the request id; the log has the traceback)",
    503: "the engine is not running, or its queue is full (then with Retry-After)",
}


class ApiError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 error_type: str = "invalid_request_error", headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.headers = error_type, headers

    def body(self) -> dict[str, Any]:
        """The OpenAI error body of this error."""
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str | int] = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code)).model_dump()


def param_in_message(message: str) -> Optional[str]:
    """The field a "field: what is wrong" message names, or None."""
    match = _FIELD_PREFIX.match(message)
    return match.group(1) if match else None


def bad_request(exc: ValueError, prefix: str = "") -> ApiError:
    """A 400 for a ValueError from kvsplice's own checks, naming the field the error carries (`param`,
    as the SCR settings' SettingError does) or its message starts with; `prefix` (e.g.
    "sampling_params.") places that field inside the request body."""
    message = str(exc)
    param = getattr(exc, "param", None) or param_in_message(message)
    if param is not None and prefix:
        message, param = prefix + message, prefix + param
    return ApiError(400, message, param=param)


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def validation_message(errors: Iterable[Mapping[str, Any]]) -> tuple[str, Optional[str]]:
    """A readable message and the offending parameter (dotted path) from pydantic's
    `ValidationError.errors()` (FastAPI's RequestValidationError has the same shape).

    The parameter is the first failing field; when a value matched none of a union's types, pydantic
    reports one error per type, its location ending in the type's name (`scr.str`, `scr.dict[str,any]`):
    the parameter is then the part those errors share (`scr`)."""
    parts, locations = [], []
    for err in errors:
        loc = tuple(str(item) for item in err.get("loc", ()) if item != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field, not supported by this server (docs/COMPATIBILITY.md lists the fields)"
        if err.get("type") in _BOUND_ERRORS:    # vLLM's messages carry pydantic's type; clients match on it
            msg = f"{msg} ({err['type']})"
        if not loc and param_in_message(msg):  # a model-level check that names its field itself
            loc = tuple(param_in_message(msg).split("."))
            msg = msg[_FIELD_PREFIX.match(msg).end():]
        where = ".".join(loc)
        locations.append(loc)
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", _shared_param(locations)


def _shared_param(locations: list[tuple[str, ...]]) -> Optional[str]:
    """The dotted common prefix of the locations that start like the first one."""
    if not locations or not locations[0]:
        return None
    first = locations[0]
    prefix = first
    for loc in locations[1:]:
        if loc[:1] != first[:1]:
            continue
        shared = 0
        while shared < min(len(prefix), len(loc)) and prefix[shared] == loc[shared]:
            shared += 1
        prefix = prefix[:shared]
    return ".".join(prefix)


def bind_request_id(request: Request, rid: str) -> str:
    """Record `rid` as the id of `request` (named in a 500 should the request fail); returns it."""
    request.scope.setdefault("state", {})[REQUEST_ID_STATE_KEY] = rid
    return rid


def internal_error(rid: str, exc: BaseException) -> ApiError:
    """Log `exc` with its traceback under `rid`; the 500 ApiError that tells the client about it."""
    LOG.error("request %s failed: %r", rid, exc, exc_info=exc)
    return ApiError(500, f"request {rid} failed inside the server ({type(exc).__name__}); the server log has "
                         f"the details", error_type="server_error", code="internal_error")


class InternalErrorMiddleware:
    """ASGI middleware: an exception escaping the app becomes a logged OpenAI-style 500 (when no
    response has started; otherwise the connection is closed, as it would be anyway).
    `on_error(status)` is called for each (metrics)."""

    def __init__(self, app: ASGIApp, on_error: Callable[[int], None] = lambda status: None):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            rid = scope.get("state", {}).get(REQUEST_ID_STATE_KEY) or f"req-{uuid.uuid4().hex}"
            error = internal_error(rid, exc)
            if started:
                return
            self.on_error(500)
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)


class RejectionLogMiddleware:
    """ASGI middleware: one `kvsplice.rejected` line (request_log.rejected_record) for every 4xx answer
    but 499 (the client went away), read from the error body the client got (OpenAI's or Anthropic's:
    both keep `message`, and `param` where there is one). `log(record)` writes it."""

    def __init__(self, app: ASGIApp, log: Callable[[dict[str, Any]], None]):
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: Optional[int] = None
        body = bytearray()

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start" and 400 <= message["status"] < 499:
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None:
                body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    self._log(scope, status, bytes(body))
                    status = None
            await send(message)

        await self.app(scope, receive, watching_send)

    def _log(self, scope: Scope, status: int, body: bytes) -> None:
        try:
            error = json.loads(body).get("error") or {}
        except (ValueError, AttributeError):
            error = {}
        error = error if isinstance(error, dict) else {}
        rid = scope.get("state", {}).get(REQUEST_ID_STATE_KEY)
        self.log(rejected_record(status, scope.get("path", ""), error.get("param"), str(error.get("message", "")),
                                 rid))
