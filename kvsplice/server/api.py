"""The HTTP API: an OpenAI-compatible front (chat, completions, models), vLLM's /tokenize, /detokenize and
/version, SGLang-compatible endpoints (so an sglang-router can balance several kvsplice replicas), health,
readiness and Prometheus metrics. docs/SERVING.md documents every route and field.

    HTTP body ─pydantic (protocol.py)─> prompt ids (chat.py | tokenizer) + SamplingParams (sampling.py)
        ─> AsyncEngine.generate (tracking.py) ─> RequestOutput deltas ─> JSON, or SSE chunks (sse.py)
        ─> on the last delta (or an abort): one `kvsplice.request` log line + metrics (tracking.py)

This module builds the app: the error handlers, each protocol's routes (chat_completions.py,
completions.py, sglang_native.py), and the shared routes (probes, metrics, models, tokenization, version).

Errors: every 4xx/5xx body is OpenAI's `{"error": {"message", "type", "param", "code"}}` (errors.py).
Validation errors (malformed JSON, wrong types) are 400, not FastAPI's 422; ValueError from the engine is
400; an unknown model is 404; a body over the limit is 413; a missing or wrong API key is 401 (auth.py);
a full queue is 503 with Retry-After; a request that fails inside the engine is 500 naming its id, and so
is any other failure inside the server; a stopped engine is 503. A streamed request that fails before its
first token is answered with the error status (the first output is awaited before the 200 is sent); one
that fails later ends with an error event.

The event loop only moves bytes: parsing a body (body.py), rendering the chat template, tokenizing and
building a long answer run in a bounded worker pool (workers.py), so /health and /metrics answer while a
2 MB prompt is being tokenized; /metrics serves the engine's last snapshot when the engine thread is
busy (snapshots.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsplice import __version__
from kvsplice.engine.async_engine import EngineDeadError
from kvsplice.engine.compute_thread import ComputeThread
from kvsplice.engine.engine import RequestFailedError
from kvsplice.server import protocol as p
from kvsplice.server.auth import AuthMiddleware
from kvsplice.server.anthropic import install_anthropic_routes
from kvsplice.server.chat_completions import install_chat_routes
from kvsplice.server.completions import install_completion_routes
from kvsplice.server.errors import (ApiError, InternalErrorMiddleware, RejectionLogMiddleware, bad_request,
                                    error_body, validation_message)
from kvsplice.server.openapi import (PROBE_ERRORS, READ_ERRORS, TOKEN_ERRORS, error_responses, install_openapi,
                                     json_request_body)
from kvsplice.server.replica import install_router_routes
from kvsplice.server.responses import install_responses_routes
from kvsplice.server.request_log import RequestLog
from kvsplice.server.sglang_native import install_generate_routes, install_info_routes
from kvsplice.server.state import ServerSettings, ServerState
from kvsplice.server.tokenization import DetokenizeRequest, TokenizeRequest, check_token_ids, detokenize, tokenize
from kvsplice.server.tracking import engine_unavailable

__all__ = ["ServerSettings", "ServerState", "create_app"]

# install(app, state) adds a family of routes and returns the request body models they parse (their
# schemas go into the OpenAPI document).
RouteInstaller = Callable[[FastAPI, ServerState], tuple[type[BaseModel], ...]]


def _install_probe_routes(app: FastAPI, state: ServerState) -> tuple[type[BaseModel], ...]:
    """Probes (/health, /readiness, /health_generate: GET and HEAD) and /metrics."""

    async def health() -> Response:
        """Liveness: 200 while the engine thread runs (the model is loaded and warmed up before the
        app starts); with --compile-decode on, also whether its graphs are "building" (eager steps
        serve meanwhile), "active" or "failed"."""
        if not state.async_engine.alive:
            return JSONResponse(error_body("the engine thread died", "server_error"), status_code=503)
        fast = state.engine.runner.fast
        compiled = fast.compiled if fast is not None else None
        return JSONResponse({"status": "ok"} if compiled is None else {"status": "ok", "compiled_decode": compiled.state})

    async def readiness() -> Response:
        """Readiness: 200 only when the engine thread answers a call between steps."""
        if not state.async_engine.alive:
            return engine_unavailable()
        try:
            await asyncio.wait_for(state.async_engine.call(lambda: True), timeout=30)
        except (asyncio.TimeoutError, RuntimeError) as exc:
            return JSONResponse(error_body(f"the engine does not answer: {exc!r}", "server_error"), status_code=503)
        return JSONResponse({"status": "ready"})

    for path, probe in (("/health", health), ("/readiness", readiness), ("/health_generate", readiness)):
        _add_probe(app, path, probe)

    @app.get("/metrics", responses=error_responses(500), response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus exposition; engine gauges from the last snapshot when the engine thread is busy."""
        snapshot = await state.snapshots.get()
        return Response(state.metrics.render(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8")

    return ()


def _add_probe(app: FastAPI, path: str, probe) -> None:
    """Route GET and HEAD of `path` to `probe` (HEAD: the same status and headers, no body), each with
    its own OpenAPI operation id."""
    name = path.strip("/")
    for method in ("GET", "HEAD"):
        app.add_api_route(path, probe, methods=[method], responses=PROBE_ERRORS,
                          operation_id=f"{name}_{method.lower()}")


def _install_models_and_tokens_routes(app: FastAPI, state: ServerState) -> tuple[type[BaseModel], ...]:
    """GET /v1/models, /v1/models/{id}, POST /tokenize, /detokenize, GET /version. One router, so that a
    dependency given to `include_router` (e.g. API-key authentication) covers all of them."""
    router = APIRouter()

    @router.get("/v1/models", responses=READ_ERRORS)
    async def models() -> dict[str, Any]:
        """One card per served name, the reported one first (as vLLM lists --served-model-name)."""
        return p.ModelList(data=[_model_card(state, name) for name in state.names.reported]).model_dump()

    @router.get("/v1/models/{model_id:path}", responses=error_responses(401, 404, 500))
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return _model_card(state, model_id).model_dump()

    # bodies parsed within the limits and tokenized off the loop, as on the inference routes
    @router.post("/tokenize", openapi_extra=json_request_body(TokenizeRequest), responses=TOKEN_ERRORS)
    async def tokenize_text(request: Request) -> dict[str, Any]:
        body = await state.parse(request, TokenizeRequest)
        state.check_model(body.model)
        return await state.workers.run(tokenize, state.engine.tokenizer, body, state.context_limit)

    @router.post("/detokenize", openapi_extra=json_request_body(DetokenizeRequest), responses=TOKEN_ERRORS)
    async def detokenize_ids(request: Request) -> dict[str, Any]:
        body = await state.parse(request, DetokenizeRequest)
        state.check_model(body.model)
        error = check_token_ids(body.tokens, state.engine.model_config.vocab_size)
        if error:
            raise ApiError(400, error, param="tokens")
        return await state.workers.run(detokenize, state.engine.tokenizer, body.tokens)

    @router.get("/version", responses=READ_ERRORS)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.include_router(router)
    return TokenizeRequest, DetokenizeRequest


def _model_card(state: ServerState, name: str) -> p.ModelCard:
    # root: the served name (the first, for every alias), as SGLang reports it; the path when exposed
    root = state.settings.model_path if state.settings.expose_model_path and state.settings.model_path else None
    return p.ModelCard(id=name, created=state.created, root=root or state.model_name,
                       max_model_len=state.context_limit)


# Every family of routes, in the OpenAPI document's path order (the order they were always declared in:
# SGLang's descriptions come after the probes). A new protocol's routes plug in with one line here.
ROUTES: tuple[RouteInstaller, ...] = (
    install_chat_routes,                  # /v1/chat/completions
    install_completion_routes,            # /v1/completions
    install_generate_routes,              # /generate, /flush_cache
    _install_probe_routes,                # /health, /readiness, /health_generate, /metrics
    install_info_routes,                  # /get_server_info, /get_model_info
    _install_models_and_tokens_routes,    # /v1/models, /tokenize, /detokenize, /version
    install_responses_routes,             # /v1/responses[/{id}] (OpenAI Responses API)
    install_anthropic_routes,             # /v1/messages[/count_tokens] (Anthropic Messages API)
)


def create_app(engine, settings: Optional[ServerSettings] = None, log: Optional[RequestLog] = None,
               compute: Optional[ComputeThread] = None) -> FastAPI:
    """A FastAPI app serving `engine` (a kvsplice Engine). The app's lifespan starts the engine thread and
    stops it on shutdown. `compute`: the thread that built `engine`, to step it on (see
    kvsplice.engine.compute_thread; default a new thread). Request log lines go to `log` (default:
    stdout); metrics live in a registry private to this app. The app's ServerState is at
    `app.state.kvsplice`."""
    state = ServerState(engine, settings or ServerSettings(), log or RequestLog(), compute)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.async_engine.start()
        try:
            yield
        finally:
            state.async_engine.stop()
            state.workers.shutdown()

    app = FastAPI(title="kvsplice", lifespan=lifespan)
    app.state.kvsplice = state
    _install_error_handlers(app, state)
    body_models = [model for install in ROUTES for model in install(app, state)]
    install_router_routes(app)
    install_openapi(app, body_models)
    return app


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every refusal and failure answered with OpenAI's error body (and counted in the metrics)."""

    def answer(status: int, body: dict[str, Any], headers: Optional[dict[str, str]] = None) -> JSONResponse:
        state.metrics.observe_error(status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return answer(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return answer(400, error_body(message, param=param))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        error = bad_request(exc)
        return answer(400, error.body())

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return answer(500, error_body(str(exc), "server_error", code="request_failed"))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return answer(503, error_body(str(exc), "ServiceUnavailableError", code="engine_stopped"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return answer(exc.status_code, error_body(str(exc.detail), kind, code=exc.status_code))

    # outermost first: an unexpected exception anywhere (authentication included) is a logged 500
    app.add_middleware(AuthMiddleware, keys=state.settings.api_keys, on_refuse=state.metrics.observe_error)
    app.add_middleware(InternalErrorMiddleware, on_error=state.metrics.observe_error)
    app.add_middleware(RejectionLogMiddleware, log=state.log.rejected)   # sees every 4xx, 401s included
