"""The one SSE writer: framing, the error event that ends a failed stream, closing the outputs, [DONE]."""

from __future__ import annotations

import asyncio

from kvsplice.server.errors import ApiError
from kvsplice.server.sse import OPENAI_STREAM, StreamFormat, event, stream_response


class Outputs:
    """An output iterator that records whether it was closed."""

    def __init__(self, items):
        self.items, self.closed = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    async def aclose(self):
        self.closed = True


def body(response) -> str:
    async def read():
        return "".join([chunk async for chunk in response.body_iterator])
    return asyncio.run(read())


async def payloads(outputs, fail: Exception | None = None):
    async for item in outputs:
        yield {"type": "delta", "n": item}
    if fail is not None:
        raise fail


def test_openai_stream_frames_data_events_and_ends_with_done():
    outputs = Outputs([1, 2])
    response = stream_response("r1", payloads(outputs), outputs)
    assert response.media_type == "text/event-stream"
    assert body(response) == ('data: {"type":"delta","n":1}\n\ndata: {"type":"delta","n":2}\n\n'
                              "data: [DONE]\n\n")
    assert outputs.closed


def test_a_failure_after_the_first_event_is_one_error_event_then_done():
    outputs = Outputs([1])
    text = body(stream_response("r2", payloads(outputs, ApiError(503, "stopped", code="engine_stopped")), outputs))
    assert text == ('data: {"type":"delta","n":1}\n\n'
                    + event(ApiError(503, "stopped", code="engine_stopped").body()) + "data: [DONE]\n\n")
    assert outputs.closed
    unexpected = body(stream_response("r3", payloads(Outputs([]), KeyError("x")), Outputs([])))
    assert '"code":"internal_error"' in unexpected and "request r3 failed" in unexpected


def test_named_events_use_the_payload_type_and_the_protocol_error_without_done():
    fmt = StreamFormat(named=True, error=lambda error: {"type": "error", "message": error.message}, done=False)
    outputs = Outputs([1])
    text = body(stream_response("r4", payloads(outputs, ApiError(500, "boom")), outputs, fmt))
    assert text == ('event: delta\ndata: {"type":"delta","n":1}\n\n'
                    'event: error\ndata: {"type":"error","message":"boom"}\n\n')
    assert outputs.closed and OPENAI_STREAM.done
