"""One request body -> a validated protocol model, each limit enforced before the work it bounds.

    Content-Type not JSON?                 400
    Content-Length > max_body_bytes?       413 at once, nothing read
    read chunks, counting                  413 as soon as the count passes the limit (the rest is
                                           discarded, never stored)
  ── in a worker thread (this grows with the body) ──
    strict UTF-8                           400 (invalid bytes, surrogates encoded as bytes)
    json.loads                             400 (malformed; NaN, Infinity and floats that overflow to
                                           infinity are not JSON numbers)
    walk every node                        400 past max_json_depth, or for a lone UTF-16 surrogate
                                           (a "\\ud800" escape) in any key or string: such a string
                                           cannot be encoded, tokenized or logged
    Model.model_validate(obj, context={"limits": limits})   400 naming the field

Every refusal is an ApiError with OpenAI's body.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from kvsplice.server.errors import ApiError, validation_message
from kvsplice.server.limits import RequestLimits
from kvsplice.server.workers import WorkerPool

M = TypeVar("M", bound=BaseModel)
# A UTF-16 surrogate code point left in a decoded str: json.loads joins escaped pairs into one
# character, so any surrogate that remains had no partner.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Bytes of an over-limit body read and dropped before answering 413, so that a client still sending
# it reads the answer instead of a reset connection; past this the connection is simply closed.
_DISCARD_BYTES = 64 << 20


def _check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(400, f"the body must be JSON (Content-Type: application/json), got {media!r}",
                       code="unsupported_media_type")


def _too_large(limit: int) -> ApiError:
    # "Payload Too Large" first: what SGLang answers past its --max-payload-size, and its clients look for
    return ApiError(413, f"Payload Too Large: the request body exceeds this server's limit of {limit} bytes "
                         f"(kvsplice serve --max-body-bytes)", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, at most `max_bytes` of it; ApiError 413 past that (decided from Content-Length when
    the client sends one), 400 for a non-JSON Content-Type or a malformed Content-Length."""
    _check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, f"malformed Content-Length header {declared!r}")
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    chunks, size = [], 0
    body = request.stream()
    async for chunk in body:
        size += len(chunk)
        if size > max_bytes:
            await _discard(body, size)
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def _discard(body: AsyncIterator[bytes], read_so_far: int) -> None:
    """Read and drop the rest of an over-limit body from `body` (the iterator that read the first
    part: a second `request.stream()` raises once the last chunk has arrived), up to
    _DISCARD_BYTES in all."""
    async for chunk in body:
        read_so_far += len(chunk)
        if read_so_far > _DISCARD_BYTES:
            return


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} overflows a double")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The JSON value of `raw`; ApiError 400 for invalid UTF-8, malformed JSON, non-finite numbers,
    nesting deeper than `max_depth` or a lone surrogate in a string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 (byte offset {exc.start})", code="invalid_utf8") from exc
    if not text.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        obj = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError as exc:
        raise ApiError(400, f"the JSON body is nested deeper than {max_depth} levels", code="json_too_deep") from exc
    except ValueError as exc:  # json.JSONDecodeError is a ValueError; so are the hooks' refusals
        raise ApiError(400, f"malformed JSON body: {exc}", code="json_invalid") from exc
    check_tree(obj, max_depth)
    return obj


def _param(path: tuple) -> str:
    return ".".join(str(part) for part in path) or "body"


def check_tree(obj: Any, max_depth: int) -> None:
    """ApiError 400 when `obj` (parsed JSON) nests arrays/objects deeper than `max_depth` (the top-level
    value is depth 1) or holds a lone surrogate in a key or string. Iterative: no recursion limit."""
    stack: list[tuple[Any, int, tuple]] = [(obj, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if _LONE_SURROGATE.search(node):
                raise ApiError(400, f"{_param(path)}: a string holds a lone UTF-16 surrogate (an unpaired "
                                    f"\\ud800-\\udfff escape), which is not text", param=_param(path),
                               code="invalid_unicode")
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise ApiError(400, f"the JSON body is nested deeper than {max_depth} levels (at {_param(path)})",
                           param=_param(path), code="json_too_deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and _LONE_SURROGATE.search(key):
                raise ApiError(400, f"{_param(path)}: a key holds a lone UTF-16 surrogate", param=_param(path),
                               code="invalid_unicode")
            stack.append((value, depth + 1, path + (key,)))


def validate_body(model: type[M], obj: Any, limits: RequestLimits) -> M:
    """`model` validated from `obj` with `limits` in the validation context; ApiError 400 naming the
    first offending field."""
    try:
        return model.model_validate(obj, context={"limits": limits})
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(400, message, param=param) from exc


def _parse(model: type[M], raw: bytes, limits: RequestLimits) -> M:
    return validate_body(model, parse_json(raw, limits.max_json_depth), limits)


async def parse_request(request: Request, model: type[M], limits: RequestLimits, workers: WorkerPool) -> M:
    """The request's body as a `model`: read on the loop (bounded), parsed and validated in `workers`."""
    raw = await read_body(request, limits.max_body_bytes)
    return await workers.run(_parse, model, raw, limits)
