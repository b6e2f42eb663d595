"""What a kvsplice replica answers to a router in front of several replicas (sglang-router's plain HTTP mode).

sglang-router 0.3.2 asks a worker for (checked against the router binary, see docs/SCALE_OUT.md):
- registration: GET /server_info (falls back to /get_server_info), /model_info: answered by sglang_native.py;
- health: GET /health every --health-check-interval-secs (or --health-check-endpoint, e.g. /readiness);
- load: GET /get_load, only while a `power_of_two` policy is in use and for the router's GET /get_loads.
  It sums `num_tokens` over the returned array (one entry per data-parallel rank, as SGLang answers);
  a worker without /get_load is reported with load -1 and power_of_two then balances blind.
- traffic: /v1/chat/completions, /v1/completions, /generate, POST /flush_cache: answered by the app (api.py).

What the router drops: chat and /generate bodies lose `session_id`, `scr` and `cache_salt` (it
re-serialises them through its own types; /v1/completions keeps them), and only the X-SMG-Routing-Key
header is forwarded. `request_session_id` reads the session id from that header when the body has none.

This module adds the one missing route, GET /get_load, to an app made by `api.create_app`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvsplice.server.metrics import EngineSnapshot, take_snapshot

GET_LOAD_PATH = "/get_load"
# The one request header sglang-router forwards to workers (lower case, as Starlette's Headers keys are).
ROUTING_KEY_HEADER = "x-smg-routing-key"


def load_report(snapshot: EngineSnapshot) -> list[dict[str, Any]]:
    """SGLang's /get_load body for one replica: a one-element list (kvsplice has one data-parallel rank)
    `[{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens"}]`. `num_reqs` counts running and waiting
    requests; `num_tokens` is the KV slots held by running requests and SCR sessions (SGLang also counts
    the KV its running requests hold, not the evictable prefix cache)."""
    return [{
        "dp_rank": 0,
        "num_reqs": snapshot.num_running + snapshot.num_waiting,
        "num_waiting_reqs": snapshot.num_waiting,
        "num_tokens": snapshot.slots_in_use,
    }]


def has_route(app: FastAPI, path: str) -> bool:
    """True when `app` already routes `path` (any method)."""
    return any(getattr(route, "path", None) == path for route in app.router.routes)


def install_router_routes(app: FastAPI) -> None:
    """Add GET /get_load to `app`, an app from `api.create_app` (its ServerState at `app.state.kvsplice`).
    Idempotent: does nothing when the app already routes /get_load. The snapshot is taken on the engine
    thread (AsyncEngine.call); while the engine is not running the answer is 503 with an OpenAI error body."""
    if has_route(app, GET_LOAD_PATH):
        return
    state = app.state.kvsplice

    @app.get(GET_LOAD_PATH)
    async def get_load() -> JSONResponse:
        if not state.async_engine.alive:
            body = {"error": {"message": "the engine is not running", "type": "server_error",
                              "param": None, "code": None}}
            return JSONResponse(body, status_code=503)
        snapshot = await state.async_engine.call(lambda: take_snapshot(state.engine))
        return JSONResponse(load_report(snapshot))


def request_session_id(body_session_id: Optional[str], headers: Mapping[str, str]) -> Optional[str]:
    """The session id of a request: the body's `session_id`, else the X-SMG-Routing-Key header.

    sglang-router re-serialises chat and /generate bodies through its own types and drops fields it does
    not know (kvsplice's `session_id`, `scr`, `cache_salt`); of the request headers it forwards
    X-SMG-Routing-Key (its `manual` policy's sticky key). So a client behind the router sends the session
    id in that header, which both pins the conversation (policy `manual`) and names the SCR session.
    `headers` is looked up case-insensitively when it is a Starlette `Headers`; pass a lower-case key dict
    otherwise. An empty header counts as absent."""
    if body_session_id is not None:
        return body_session_id
    return headers.get(ROUTING_KEY_HEADER) or None
