"""Server-Sent Events: the one writer behind every streaming route.

A route hands `stream_response` the events of its protocol (an async generator of JSON-able payloads,
built from the request's outputs) and the outputs themselves; the writer frames each payload as an
event, and owns the stream's tail:

    payload ... payload  ─ the protocol's events, each `data: <compact JSON>` (plus `event: <type>` when named)
    [error]              ─ a failure after the 200 was sent (an ApiError from the engine, or an exception:
                           logged as a 500 naming the request) becomes one last error event
    (close)              ─ the outputs are closed whatever happened, which aborts the request if it still
                           runs (a client that disconnects cancels the response task: the same close)
    [DONE]               ─ `data: [DONE]`, for the protocols that end streams so

A stream that fails before its first token never gets here: the first output is awaited before the
route answers (tracking.submit), so that failure is an ordinary error status.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Optional

from fastapi.responses import StreamingResponse

from kvsplice.server.errors import ApiError, internal_error

MEDIA_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class StreamFormat:
    """How a protocol frames its stream. `named`: each event also carries `event: <its payload's "type">`
    (streams whose clients dispatch on event names); `error`: the payload of the event that reports a
    failure; `done`: end with `data: [DONE]`."""

    named: bool = False
    error: Callable[[ApiError], Any] = ApiError.body
    done: bool = True


# OpenAI's chat and completions streams (and SGLang's /generate): plain data events, the error body, [DONE].
OPENAI_STREAM = StreamFormat()


def event(payload: Any, name: Optional[str] = None) -> str:
    """One event: `event: <name>` when named, then `data: <payload as compact JSON>` and the blank line."""
    head = f"event: {name}\n" if name is not None else ""
    return f"{head}data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def stream_response(rid: str, events: AsyncGenerator[Any, None], outputs: AsyncIterator,
                    fmt: StreamFormat = OPENAI_STREAM) -> StreamingResponse:
    """The 200 event-stream answer of request `rid`: `events` framed by `fmt`, then the stream's tail
    (see the module docstring). `outputs`: the iterator `events` reads the request's outputs from, closed
    when the stream ends."""
    return StreamingResponse(_write(rid, events, outputs, fmt), media_type=MEDIA_TYPE)


async def _write(rid: str, events: AsyncGenerator[Any, None], outputs: AsyncIterator,
                 fmt: StreamFormat) -> AsyncIterator[str]:
    try:
        async for payload in events:
            yield _framed(payload, fmt)
    except Exception as exc:  # ApiError from the engine, or a failure: an error event, then the end
        error = exc if isinstance(exc, ApiError) else internal_error(rid, exc)
        yield _framed(fmt.error(error), fmt)
    finally:
        await events.aclose()
        await outputs.aclose()
    if fmt.done:
        yield DONE


def _framed(payload: Any, fmt: StreamFormat) -> str:
    return event(payload, payload["type"] if fmt.named else None)
