"""One request's life on the server, whatever its protocol: what goes to the engine with it (tenancy,
session, message offsets), submitting it (bad input and a full queue are refused before any response is
sent), following its outputs, and accounting for it once when it ends (one `kvsplice.request` log line
and the request metrics), aborted or not.

Tenancy: with API keys, each key is a tenant; its `owner` goes to the engine with every request, and
the engine's cache namespace is (owner, cache_salt).

A client that disconnects aborts its request: for streams, the response task is cancelled, which closes
`AsyncEngine.generate` (its `finally` aborts the request and frees its slots); for plain requests a
watcher polls `request.is_disconnected()` and cancels the collecting task (`collect`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from kvsplice.cache.checkpoint_policy import check_message_offsets
from kvsplice.engine.async_engine import EngineDeadError
from kvsplice.engine.engine import QueueFullError, RequestFailedError
from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams
from kvsplice.server.auth import request_owner
from kvsplice.server.choices import Choice, start_choices
from kvsplice.server.errors import ApiError, bad_request, error_body, internal_error
from kvsplice.server.metrics import RequestObservation
from kvsplice.server.replica import request_session_id
from kvsplice.server.request_log import request_record
from kvsplice.server.state import ServerState

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25
ROUTING_KEY_PARAM = "X-SMG-Routing-Key"  # the header a router passes the session id in (replica.py)


@dataclass
class RequestTracker:
    """Accumulates one request's outputs for the final answer, the log line and metrics."""

    rid: str
    endpoint: str
    session_id: Optional[str]
    start_s: float = field(default_factory=time.perf_counter)
    outputs: list[RequestOutput] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)   # when each output with tokens arrived
    logged: bool = False

    @property
    def last(self) -> Optional[RequestOutput]:
        return self.outputs[-1] if self.outputs else None

    def add(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if out.new_token_ids:
            self.token_times_s.append(time.perf_counter())

    def observation(self, finish_reason: Optional[str], e2e_s: float) -> RequestObservation:
        """What metrics record of this request (see metrics.RequestObservation)."""
        last = self.last
        ttft = next((o.ttft_s for o in self.outputs if o.ttft_s is not None), None)
        queue = next((o.queue_s for o in self.outputs if o.queue_s is not None), None)
        return RequestObservation(
            self.endpoint, finish_reason, e2e_s, ttft_s=ttft, queue_s=queue,
            token_times_s=tuple(self.token_times_s), prompt_tokens=last.prompt_tokens if last else 0,
            generation_tokens=last.completion_tokens if last else 0, fallback=last.reuse.fallback if last else None)


# ----- what goes to the engine with a request ----------------------------------------------------------


def engine_extras(body, session_id: Optional[str], request: Request) -> dict[str, Any]:
    """kvsplice's per-request fields for AsyncEngine.generate; `owner` is the API key's tenant."""
    return {"cache_salt": body.cache_salt, "session_id": session_id, "scr": body.scr,
            "owner": request_owner(request)}


def session_id(state: ServerState, body, request: Request) -> Optional[str]:
    """The body's session_id, else the router's X-SMG-Routing-Key header (sglang-router drops body extras
    but passes that header), within the id length limit."""
    session = request_session_id(body.session_id, request.headers)
    if session is not None and len(session) > state.limits.max_id_chars:
        raise ApiError(400, f"{ROUTING_KEY_PARAM}: may have at most {state.limits.max_id_chars} characters, "
                            f"got {len(session)}", param=ROUTING_KEY_PARAM)
    return session


def message_offsets(offsets: Optional[list[int]], prompt_len: int) -> Optional[tuple[int, ...]]:
    """A client's `message_offsets`, checked against the prompt (400 naming the field)."""
    try:
        return check_message_offsets(offsets, prompt_len) if offsets is not None else None
    except ValueError as exc:
        raise ApiError(400, str(exc), param="message_offsets") from exc


# ----- running it --------------------------------------------------------------------------------------


def finish(state: ServerState, tracker: RequestTracker, finish_reason: Optional[str] = None) -> None:
    """Write the request's log line and metrics once (finish_reason overrides, e.g. 'abort')."""
    if tracker.logged:
        return
    tracker.logged = True
    last = tracker.last
    e2e = time.perf_counter() - tracker.start_s
    reason = finish_reason or (last.finish_reason if last else None)
    reuse = last.reuse.as_dict() if last else None
    observation = tracker.observation(reason, e2e)
    state.metrics.observe_request(observation)
    state.log.request(request_record(
        tracker.rid, last.prompt_tokens if last else 0, last.completion_tokens if last else 0, reuse,
        observation.ttft_s, e2e,
        reason, tracker.session_id, state.settings.replica_name, tracker.endpoint))


async def submit(state: ServerState, tracker: RequestTracker, prompt_ids: list[int], params: SamplingParams,
                 extras: dict[str, Any]) -> AsyncIterator[RequestOutput]:
    """Submit the request and return its output iterator, with the first output already fetched (so bad
    input and a full queue raise here, before any response is sent). Closing the iterator (or reaching
    its end) accounts for the request (`finish`)."""
    if not state.async_engine.alive:
        raise ApiError(503, "the engine is not running", error_type="ServiceUnavailableError")
    gen = state.async_engine.generate(prompt_ids, params, tracker.rid, **extras)
    try:
        first = await gen.__anext__()
    except QueueFullError as exc:
        raise ApiError(503, str(exc), error_type="ServiceUnavailableError", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
    except ValueError as exc:
        raise bad_request(exc) from exc
    except RuntimeError as exc:  # RequestFailedError, EngineDeadError, or anything else the engine raised
        raise engine_failure(state, tracker, exc) from exc
    tracker.add(first)

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            if first.finished:
                return
            async for out in gen:
                tracker.add(out)
                yield out
        except RuntimeError as exc:
            raise engine_failure(state, tracker, exc) from exc
        finally:
            await gen.aclose()
            finish(state, tracker, None if tracker.last and tracker.last.finished else "abort")

    return rest()


async def submit_choices(state: ServerState, request: Request, body, endpoint: str, rid: str,
                         prompt_ids: list[int], params: SamplingParams, n: int,
                         offsets: Optional[Sequence[int]]) -> tuple[list[Choice], Optional[RequestTracker]]:
    """Submit the request's `n` choices (choices.py: n > 1 prefills the prompt once, then shares it);
    returns them and the prefill request's tracker (None for n == 1). `endpoint` names the route in the
    log line and metrics; `offsets` are the prompt's message offsets (None: none)."""
    session = session_id(state, body, request)
    extras = {**engine_extras(body, session, request), "message_offsets": offsets}

    async def start(suffix: str, choice_params: SamplingParams):
        tracker = RequestTracker(rid + suffix, endpoint, session)
        return tracker, await submit(state, tracker, prompt_ids, choice_params, extras)

    return await start_choices(start, lambda outputs: collect(request, outputs), params, n)


def engine_failure(state: ServerState, tracker: RequestTracker, exc: RuntimeError) -> ApiError:
    """The answer to a request the engine could not serve: a 500 `request_failed` when it failed inside
    the engine (which logged the traceback; the request's log line says finish reason 'error'), a 503
    when the engine thread has stopped, else a 500 naming the request (logged here with the traceback)."""
    if isinstance(exc, RequestFailedError):
        finish(state, tracker, "error")
        return ApiError(500, str(exc), error_type="server_error", code="request_failed")
    if isinstance(exc, EngineDeadError) or not state.async_engine.alive:
        return ApiError(503, str(exc) if isinstance(exc, EngineDeadError) else "the engine is not running",
                        error_type="ServiceUnavailableError", code="engine_stopped")
    return internal_error(tracker.rid, exc)


async def collect(request: Request, outputs: AsyncIterator[RequestOutput]) -> None:
    """Drain `outputs`; if the client disconnects first, cancel (which aborts the request)."""

    async def drain() -> None:
        async for _ in outputs:
            pass

    task = asyncio.create_task(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


def engine_unavailable() -> JSONResponse:
    """The 503 of a route that needs the engine thread while it is not running."""
    return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
