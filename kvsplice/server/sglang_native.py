"""SGLang's native endpoints, so that an sglang-router can balance several kvsplice replicas (replica.py):
POST /generate (text or input ids; stream chunks carry the cumulative text, as SGLang sends them by
default), POST /flush_cache (operator: everything with the admin key, else the caller's own tenant), and the descriptions GET /get_server_info and /get_model_info (also
under SGLang's newer names /server_info and /model_info)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvsplice import __version__
from kvsplice.engine.request import RequestOutput
from kvsplice.server import protocol as p
from kvsplice.server.auth import flush_owner, refuse_browser_request
from kvsplice.server.errors import ApiError, bind_request_id
from kvsplice.server.openapi import ADMIN_ERRORS, INFERENCE_ERRORS, READ_ERRORS, json_request_body
from kvsplice.server.sampling import check_prompt_ids, check_vocab_ids, max_tokens, sglang_sampling
from kvsplice.server.sse import stream_response
from kvsplice.server.state import ServerState
from kvsplice.server.tracking import (RequestTracker, collect, engine_extras, engine_unavailable, message_offsets,
                                      session_id, submit)


def install_generate_routes(app: FastAPI, state: ServerState) -> tuple[type[BaseModel], ...]:
    """Add POST /generate and POST /flush_cache to `app`; returns the body model /generate parses."""

    @app.post("/generate", openapi_extra=json_request_body(p.GenerateRequest), responses=INFERENCE_ERRORS)
    async def generate(request: Request) -> Response:
        body = await state.parse(request, p.GenerateRequest)
        tracker, outputs = await _start(state, request, body)
        if body.stream:
            return stream_response(tracker.rid, _chunks(tracker, outputs), outputs)
        await collect(request, outputs)
        return JSONResponse(_payload(tracker))

    @app.post("/flush_cache", responses=ADMIN_ERRORS)
    async def flush_cache(request: Request) -> Response:
        """Drop every unlocked cache entry and idle session, in the pool and the disk tier: every
        tenant's with the admin key (or on a server without keys), else the caller's own tenant's
        (`kvsplice.server.auth.flush_owner`). POST only."""
        refuse_browser_request(request)
        owner = flush_owner(request, state.settings.api_keys)
        if not state.async_engine.alive:
            return engine_unavailable()
        await state.async_engine.call(functools.partial(state.engine.flush_cache, owner))
        scope = "every tenant's" if owner is None else "this tenant's"
        return JSONResponse({"status": "ok", "message": f"cache flushed ({scope})"})

    return (p.GenerateRequest,)


def install_info_routes(app: FastAPI, state: ServerState) -> tuple[type[BaseModel], ...]:
    """Add GET /get_server_info, /server_info, /get_model_info and /model_info to `app` (no bodies)."""
    engine = state.engine

    @app.get("/get_server_info", responses=READ_ERRORS)
    @app.get("/server_info", responses=READ_ERRORS)
    async def server_info() -> dict[str, Any]:
        return _server_info(state)

    @app.get("/get_model_info", responses=READ_ERRORS)
    @app.get("/model_info", responses=READ_ERRORS)
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.public_model_path, "tokenizer_path": state.public_model_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "served_model_name": state.model_name, "max_model_len": engine.max_model_len}

    return ()


async def _start(state: ServerState, request: Request,
                 body: p.GenerateRequest) -> tuple[RequestTracker, AsyncIterator[RequestOutput]]:
    """Check, tokenize and submit the request (every refusal is raised here, before any answer)."""
    rid = bind_request_id(request, body.rid or uuid.uuid4().hex)
    tokenizer = state.engine.tokenizer
    if body.text is not None:
        prompt_ids, prompt_param = await state.workers.run(tokenizer.encode, body.text), "text"
    else:
        prompt_ids, prompt_param = list(body.input_ids), "input_ids"
    sp = body.sampling_params
    if sp.max_new_tokens < 1:
        raise ApiError(400, f"sampling_params.max_new_tokens: must be >= 1, got {sp.max_new_tokens}",
                       param="sampling_params.max_new_tokens")
    budget = max_tokens(state, len(prompt_ids), sp.max_new_tokens, prompt_param, "sampling_params.max_new_tokens")
    check_prompt_ids(state, prompt_ids, prompt_param)
    check_vocab_ids(state, sp.stop_token_ids, "sampling_params.stop_token_ids")
    params = sglang_sampling(sp, budget)
    session = session_id(state, body, request)
    tracker = RequestTracker(rid, "generate", session)
    offsets = message_offsets(body.message_offsets, len(prompt_ids))
    outputs = await submit(state, tracker, prompt_ids, params,
                           {**engine_extras(body, session, request), "message_offsets": offsets})
    return tracker, outputs


def _payload(tracker: RequestTracker) -> dict[str, Any]:
    """SGLang's answer so far: all the text and ids generated, and `meta_info`."""
    last = tracker.last
    meta = {"id": tracker.rid, "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "cached_tokens": last.reuse.prefix_tokens + last.reuse.relocated_tokens,
            "finish_reason": {"type": last.finish_reason} if last.finished else None,
            "e2e_latency": time.perf_counter() - tracker.start_s, "reuse": last.reuse.as_dict()}
    return {"text": "".join(o.new_text for o in tracker.outputs),
            "output_ids": [t for o in tracker.outputs for t in o.new_token_ids], "meta_info": meta}


async def _chunks(tracker: RequestTracker,
                  outputs: AsyncIterator[RequestOutput]) -> AsyncGenerator[dict[str, Any], None]:
    """One cumulative payload per output."""
    async for _ in outputs:
        yield _payload(tracker)


def _server_info(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    cfg = engine.config
    return {
        "model_path": state.public_model_path,
        "tokenizer_path": state.public_model_path,
        "served_model_name": state.model_name,
        "is_generation": True,
        "context_length": engine.max_model_len,
        "max_total_num_tokens": cfg.num_slots,
        "max_running_requests": cfg.max_running,
        "max_prefill_tokens": cfg.max_batch_tokens,
        "chunked_prefill_size": cfg.max_batch_tokens,
        "disable_radix_cache": not cfg.prefix_cache,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "dp_size": 1,
        "tp_size": 1,
        "host": state.settings.host,
        "port": state.settings.port,
        "replica_name": state.settings.replica_name,
        "scr": {f: getattr(cfg.reuse, f) for f in cfg.reuse.__dataclass_fields__},
        "version": __version__,
        **state.settings.extra_info,
    }
