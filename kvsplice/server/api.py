"""The HTTP API: an OpenAI-compatible front (chat, completions, models), vLLM's /tokenize, /detokenize and
/version, SGLang-compatible endpoints (so an sglang-router can balance several kvsplice replicas), health,
readiness and Prometheus metrics. docs/SERVING.md documents every route and field.

    HTTP body ─pydantic (protocol.py)─> prompt ids (chat.py | tokenizer) + SamplingParams
        ─> AsyncEngine.generate ─> RequestOutput deltas ─> JSON or SSE chunks
        ─> on the last delta (or an abort): one `kvsplice.request` log line + metrics

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

Tenancy: with API keys, each key is a tenant; its `owner` goes to the engine with every request, and
the engine's cache namespace is (owner, cache_salt).

A client that disconnects aborts its request: for streams, the response task is cancelled, which closes
`AsyncEngine.generate` (its `finally` aborts the request and frees its slots); for plain requests a
watcher polls `request.is_disconnected()` and cancels the collecting task.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsplice import __version__
from kvsplice.cache.checkpoint_policy import check_message_offsets
from kvsplice.engine.async_engine import AsyncEngine, EngineDeadError
from kvsplice.engine.compute_thread import ComputeThread
from kvsplice.engine.engine import QueueFullError, RequestFailedError
from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams
from kvsplice.server import protocol as p
from kvsplice.server.auth import ApiKeys, AuthMiddleware, refuse_browser_request, request_owner
from kvsplice.server.body import parse_request
from kvsplice.server.chat import ChatRenderer, ChatTemplateError
from kvsplice.server.choices import Choice, merge, start_choices, usage_totals
from kvsplice.server.constraints import ConstraintError, reply_constraint
from kvsplice.server.errors import (ApiError, InternalErrorMiddleware, bad_request, bind_request_id, error_body,
                                    internal_error, validation_message)
from kvsplice.server.limits import RequestLimits
from kvsplice.server.metrics import RequestObservation, ServerMetrics
from kvsplice.server.model_names import served_names
from kvsplice.server.openapi import error_responses, install_openapi, json_request_body
from kvsplice.server.replica import install_router_routes, request_session_id
from kvsplice.server.replies import ReplyFormat
from kvsplice.server.request_log import RequestLog, request_record
from kvsplice.server.snapshots import SnapshotCache
from kvsplice.server.tokenization import DetokenizeRequest, TokenizeRequest, check_token_ids, detokenize, tokenize
from kvsplice.server.tool_parsers import get_parser
from kvsplice.server.tools import ToolPlan, ToolRequestError, plan_tools
from kvsplice.structured.spec import StructuredSpec
from kvsplice.server.workers import WorkerPool

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25
# What each kind of route may answer besides 200 (the OpenAPI document declares exactly these).
# An inference route answers JSON, or with "stream": true an event stream (Server-Sent Events).
INFERENCE_ERRORS = {200: {"content": {"application/json": {}, "text/event-stream": {}}},
                    **error_responses(400, 401, 404, 413, 500, 503)}
READ_ERRORS = error_responses(401, 500)
ADMIN_ERRORS = error_responses(401, 403, 500, 503)
PROBE_ERRORS = error_responses(500, 503)
TOKEN_ERRORS = error_responses(400, 401, 404, 413, 500)
ROUTING_KEY_PARAM = "X-SMG-Routing-Key"  # the header a router passes the session id in (replica.py)


@dataclass(frozen=True)
class ServerSettings:
    """Server-level options. `model_path`: the --model the model was loaded from (None: the default
    model). `served_model_names`: the names to serve under (the first is reported; empty: derived from
    the model, see model_names.py). `reasoning_parser`: move `<think>` blocks of replies into
    `reasoning_content`. `tool_call_parser`: the tool-call syntax by vLLM name (None: detected from the
    chat template). `chat_template`: a template that replaces the model's (its text). `api_keys`: the
    accepted keys (none: no authentication). `limits`: per-request bounds (context-derived defaults are
    filled in from the model). `expose_model_path`: show `model_path` in /get_server_info,
    /get_model_info and /v1/models (by default they name the served model, not a filesystem path).
    `prep_threads`: worker threads for parsing, templates and tokenization."""

    model_path: Optional[str] = None
    served_model_names: tuple[str, ...] = ()
    replica_name: Optional[str] = None
    reasoning_parser: bool = False
    tool_call_parser: Optional[str] = None
    chat_template: Optional[str] = None
    host: Optional[str] = None
    port: Optional[int] = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    limits: RequestLimits = field(default_factory=RequestLimits)
    expose_model_path: bool = False
    prep_threads: int = 2


# ----- app state ---------------------------------------------------------------------------------------


class ServerState:
    """What handlers share: the engine, its async driver, settings, metrics and the request log."""

    def __init__(self, engine, settings: ServerSettings, log: RequestLog, compute: Optional[ComputeThread] = None):
        self.engine = engine
        self.async_engine = AsyncEngine(engine, compute=compute)
        self.settings = settings
        self.log = log
        self.names = served_names(settings.served_model_names, settings.model_path, engine.name)
        self.metrics = ServerMetrics(self.names.primary, settings.replica_name, engine.max_model_len)
        self.created = int(time.time())
        parser = get_parser(settings.tool_call_parser) if settings.tool_call_parser else None
        self.chat = ChatRenderer(engine.tokenizer, settings.chat_template, parser)
        backend = engine.tokenizer.backend
        self.vocab = backend.get_vocab() if hasattr(backend, "get_vocab") else None
        self.special_tokens = frozenset(token.content for token in getattr(backend, "added_tokens_decoder", {}).values()
                                        if token.special)
        self.limits = settings.limits.resolve(self.context_limit)
        self.workers = WorkerPool(settings.prep_threads)
        self.snapshots = SnapshotCache(self.async_engine)

    async def parse(self, request: Request, model: type[BaseModel]):
        """The request's JSON body as `model`, within `limits` (body.py); ApiError otherwise."""
        return await parse_request(request, model, self.limits, self.workers)

    @property
    def public_model_path(self) -> str:
        """The model path shown to clients: the served name unless the operator exposes the path."""
        if self.settings.expose_model_path and self.settings.model_path:
            return self.settings.model_path
        return self.engine.name

    @property
    def model_name(self) -> str:
        """The name every response reports."""
        return self.names.primary

    @property
    def wants_message_offsets(self) -> bool:
        """Whether chat requests should carry message offsets: a hybrid model whose checkpoint policy
        saves states at message starts (other models have no use for them)."""
        cache = self.engine.cache
        return cache.states is not None and cache.policy.messages

    @property
    def context_limit(self) -> int:
        """Longest sequence (prompt + completion) a request may have."""
        return min(self.engine.max_model_len, self.engine.config.num_slots)


def _check_model(state: ServerState, model: Optional[str]) -> None:
    if model is not None and not state.names.accepts(model):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(map(repr, state.names.reported))}",
                       param="model", code="model_not_found", error_type="NotFoundError")


def _max_tokens(state: ServerState, prompt_len: int, requested: Optional[int], prompt_param: str,
                budget_param: str = "max_tokens") -> int:
    """The completion budget: `requested`, or the rest of the context; 400 (with the numbers) if the prompt
    does not fit (naming `prompt_param`, the field that holds the prompt) or prompt + requested exceeds
    the context (naming `budget_param`, the field that holds `requested`)."""
    limit = state.context_limit
    if prompt_len >= limit:
        raise ApiError(400, f"the prompt has {prompt_len} tokens but this model's context limit is {limit} "
                            f"tokens (prompt + completion); shorten the prompt", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise ApiError(400, f"the prompt ({prompt_len} tokens) plus {budget_param} ({requested}) exceeds this "
                            f"model's context limit of {limit} tokens", param=budget_param,
                       code="context_length_exceeded")
    return requested


def _check_prompt_ids(state: ServerState, prompt_ids: list[int], param: str) -> None:
    """400 naming `param` for an empty prompt or a token id outside the vocabulary (the engine checks
    too, but cannot say which field the ids came from)."""
    if not prompt_ids:
        raise ApiError(400, f"{param}: must not be empty", param=param)
    vocab = state.engine.model_config.vocab_size
    bad = next((token for token in prompt_ids if not 0 <= token < vocab), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def _sampling(fields: p._SamplingFields, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int],
              structured: Optional[StructuredSpec] = None, keep_special_tokens: bool = False) -> SamplingParams:
    """SamplingParams from the OpenAI fields (OpenAI defaults: temperature 1, top_p 1); an invalid
    combination is a 400 naming the field."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=fields.top_k if fields.top_k not in (None, 0, -1) else None,
            min_p=fields.min_p or 0.0,
            seed=fields.seed,
            stop=fields.stop or (),
            stop_token_ids=tuple(fields.stop_token_ids or ()),
            ignore_eos=fields.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=fields.skip_special_tokens and not keep_special_tokens,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            repetition_penalty=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
            logit_bias=fields.logit_bias or (),
            min_tokens=fields.min_tokens,
            structured=structured,
        )
    except ValueError as error:
        name = str(error).split(":")[0].split(" ")[0]
        raise ApiError(400, str(error), param=name if name in type(fields).model_fields else None) from error


async def _compile(state: ServerState, spec: Optional[StructuredSpec], param: str) -> None:
    """Compile `spec` in a worker thread (the engine's compile is then a cache hit): a constraint
    that cannot compile is a 400 before the request is queued."""
    if spec is None:
        return
    try:
        await state.workers.run(state.engine.grammars.compile, spec)
    except ValueError as error:
        raise ApiError(400, str(error), param=param) from error


def _reply_plan(state: ServerState, body: p.ChatCompletionRequest) -> tuple[ToolPlan, Optional[StructuredSpec], str]:
    """The request's ToolPlan, the constraint on its reply, and the field that constraint came from."""
    try:
        tools = plan_tools(body, state.chat.parser, state.vocab, state.special_tokens)
        return tools, reply_constraint(body, tools.forced), "tools" if tools.forced else _constraint_field(body)
    except (ToolRequestError, ConstraintError) as error:
        raise ApiError(400, str(error), param=error.param) from error


def _constraint_field(body: p._SamplingFields) -> str:
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs"):
        if getattr(body, name) is not None:
            return name
    return "response_format"


# ----- running one request -----------------------------------------------------------------------------


@dataclass
class _Tracker:
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


def _finish(state: ServerState, tracker: _Tracker, finish_reason: Optional[str] = None) -> None:
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


async def _start(state: ServerState, tracker: _Tracker, prompt_ids: list[int], params: SamplingParams,
                 extras: dict[str, Any]) -> AsyncIterator[RequestOutput]:
    """Submit the request and return its output iterator, with the first output already fetched (so bad
    input and a full queue raise here, before any response is sent)."""
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
        raise _engine_failure(state, tracker, exc) from exc
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
            raise _engine_failure(state, tracker, exc) from exc
        finally:
            await gen.aclose()
            _finish(state, tracker, None if tracker.last and tracker.last.finished else "abort")

    return rest()


def _engine_failure(state: ServerState, tracker: _Tracker, exc: RuntimeError) -> ApiError:
    """The answer to a request the engine could not serve: a 500 `request_failed` when it failed inside
    the engine (which logged the traceback; the request's log line says finish reason 'error'), a 503
    when the engine thread has stopped, else a 500 naming the request (logged here with the traceback)."""
    if isinstance(exc, RequestFailedError):
        _finish(state, tracker, "error")
        return ApiError(500, str(exc), error_type="server_error", code="request_failed")
    if isinstance(exc, EngineDeadError) or not state.async_engine.alive:
        return ApiError(503, str(exc) if isinstance(exc, EngineDeadError) else "the engine is not running",
                        error_type="ServiceUnavailableError", code="engine_stopped")
    return internal_error(tracker.rid, exc)


def _stream_error(rid: str, exc: Exception) -> str:
    """The SSE event that ends a stream which failed after its 200 was sent."""
    error = exc if isinstance(exc, ApiError) else internal_error(rid, exc)
    return _sse(error.body())


async def _collect(request: Request, outputs: AsyncIterator[RequestOutput]) -> None:
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


def _usage(out: RequestOutput, completion_tokens: Optional[int] = None) -> dict[str, Any]:
    """`usage` of a finished request; `reuse` is ReuseStats.as_dict()."""
    reuse = out.reuse.as_dict()
    completion = out.completion_tokens if completion_tokens is None else completion_tokens
    return p.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=completion,
                   total_tokens=out.prompt_tokens + completion,
                   prompt_tokens_details=p.PromptTokensDetails(
                       cached_tokens=out.reuse.prefix_tokens + out.reuse.relocated_tokens),
                   reuse=reuse).model_dump()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _extras(body, session_id: Optional[str], request: Request) -> dict[str, Any]:
    """kvsplice's per-request fields for AsyncEngine.generate; `owner` is the API key's tenant."""
    return {"cache_salt": body.cache_salt, "session_id": session_id, "scr": body.scr,
            "owner": request_owner(request)}


def _session_id(state: ServerState, body, request: Request) -> Optional[str]:
    """The body's session_id, else the router's X-SMG-Routing-Key header (sglang-router drops body extras
    but passes that header), within the id length limit."""
    session_id = request_session_id(body.session_id, request.headers)
    if session_id is not None and len(session_id) > state.limits.max_id_chars:
        raise ApiError(400, f"{ROUTING_KEY_PARAM}: may have at most {state.limits.max_id_chars} characters, "
                            f"got {len(session_id)}", param=ROUTING_KEY_PARAM)
    return session_id


def _message_offsets(offsets: Optional[list[int]], prompt_len: int) -> Optional[tuple[int, ...]]:
    """A client's `message_offsets`, checked against the prompt (400 naming the field)."""
    try:
        return check_message_offsets(offsets, prompt_len) if offsets is not None else None
    except ValueError as exc:
        raise ApiError(400, str(exc), param="message_offsets") from exc


# ----- logprobs formats --------------------------------------------------------------------------------


def _chat_logprobs(tokenizer, lps, top_n: int) -> dict[str, Any]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top[:top_n]]} for lp in lps]}


def _legacy_logprobs(tokenizer, lps, first_offset: int) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob} or None),
    text_offset (character offset of each token in the returned text, from `first_offset`). An entry of
    `lps` may be None (the first prompt token): its logprob and top_logprobs are null."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = first_offset
    for token_id, lp in lps:
        text = tokenizer.token_str(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {tokenizer.token_str(t): v for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# ----- handlers ----------------------------------------------------------------------------------------


async def _start_request(state: ServerState, request: Request, body, endpoint: str, rid: str,
                         prompt_ids: list[int], params: SamplingParams, n: int,
                         message_offsets: Optional[Sequence[int]]) -> tuple[list[Choice], Optional[_Tracker]]:
    """Submit the request's `n` choices (choices.py: n > 1 prefills the prompt once, then shares it)."""
    session_id = _session_id(state, body, request)
    extras = {**_extras(body, session_id, request), "message_offsets": message_offsets}

    async def start(suffix: str, choice_params: SamplingParams):
        tracker = _Tracker(rid + suffix, endpoint, session_id)
        return tracker, await _start(state, tracker, prompt_ids, choice_params, extras)

    return await start_choices(start, lambda outputs: _collect(request, outputs), params, n)


def _choices_usage(choices: list[Choice], prefill: Optional[_Tracker], completion_tokens: Optional[int] = None):
    first, completion = usage_totals(choices, prefill)
    return _usage(first, completion if completion_tokens is None else completion_tokens)


async def _chat(state: ServerState, request: Request, body: p.ChatCompletionRequest) -> Response:
    rid = bind_request_id(request, f"chatcmpl-{uuid.uuid4().hex}")
    _check_model(state, body.model)
    if body.max_tokens == 0:
        raise ApiError(400, "max_tokens: must be >= 1 for chat completions", param="max_tokens")
    tools, constraint, constraint_param = _reply_plan(state, body)
    await _compile(state, constraint, constraint_param)
    try:
        prompt_ids = await state.workers.run(state.chat.prompt_ids, body.messages, tools.template_tools,
                                             body.chat_template_kwargs)
    except ChatTemplateError as error:
        raise ApiError(400, str(error), param=error.param) from error
    max_tokens = _max_tokens(state, len(prompt_ids), body.max_tokens, "messages")
    top_n = body.top_logprobs or 0
    params = _sampling(body, max_tokens, top_n if body.logprobs else None, None, constraint, tools.keep_special_tokens)
    offsets = await state.workers.run(state.chat.message_offsets, body.messages, prompt_ids, tools.template_tools,
                                      body.chat_template_kwargs) if state.wants_message_offsets else None
    choices, prefill = await _start_request(state, request, body, "chat", rid, prompt_ids, params, body.n, offsets)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    tokenizer = state.engine.tokenizer
    fmt = ReplyFormat(state.settings.reasoning_parser, tools, state.chat.parser)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(choices, prefill, head, tokenizer, top_n, body.logprobs, include_usage, fmt),
                                 media_type="text/event-stream")
    await _collect(request, merge(choices))
    out = []
    for choice in choices:
        outputs = choice.tracker.outputs
        message, reason = fmt.message("".join(o.new_text for o in outputs), choice.tracker.last.finish_reason)
        lps = [lp for o in outputs for lp in o.logprobs]
        out.append({"index": choice.index, "message": message, "finish_reason": reason,
                    "logprobs": _chat_logprobs(tokenizer, lps, top_n) if body.logprobs else None})
    return JSONResponse({**head, "object": "chat.completion", "choices": out, "usage": _choices_usage(choices, prefill)})


async def _chat_stream(choices: list[Choice], prefill: Optional[_Tracker], head: dict[str, Any], tokenizer,
                       top_n: int, want_logprobs: bool, include_usage: bool, fmt: ReplyFormat) -> AsyncIterator[str]:
    chunk_head = {**head, "object": "chat.completion.chunk"}
    streams = [fmt.stream() for _ in choices]
    outputs = merge(choices)
    try:
        for choice in choices:
            yield _sse({**chunk_head, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
        async for index, out in outputs:
            delta = streams[index].feed(out.new_text, final=out.finished)
            reason = streams[index].finish_reason(out.finish_reason) if out.finished else None
            logprobs = _chat_logprobs(tokenizer, out.logprobs, top_n) if want_logprobs else None
            if delta or out.finished or logprobs:
                yield _sse({**chunk_head, "choices": [{"index": index, "delta": delta, "finish_reason": reason,
                                                       "logprobs": logprobs}]})
        if include_usage:
            yield _sse({**chunk_head, "choices": [], "usage": _choices_usage(choices, prefill)})
    except Exception as exc:  # ApiError from the engine, or a failure: an error event, then [DONE]
        yield _stream_error(head["id"], exc)
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


async def _completion(state: ServerState, request: Request, body: p.CompletionRequest) -> Response:
    rid = bind_request_id(request, f"cmpl-{uuid.uuid4().hex}")
    _check_model(state, body.model)
    tokenizer = state.engine.tokenizer
    prompt = body.single_prompt()
    prompt_ids = await state.workers.run(tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 is only allowed with echo=true (scoring the prompt)", param="max_tokens")
    if body.echo and body.stream:
        raise ApiError(400, "echo is not supported with stream=true", param="echo")
    try:
        constraint = reply_constraint(body)
    except ConstraintError as error:
        raise ApiError(400, str(error), param=error.param) from error
    await _compile(state, constraint, _constraint_field(body))
    score_only = body.max_tokens == 0
    # max_tokens=0 with echo: generate one token and drop it, as vLLM does.
    max_tokens = _max_tokens(state, len(prompt_ids), 1 if score_only else body.max_tokens, "prompt")
    _check_prompt_ids(state, prompt_ids, "prompt")
    prompt_lps = (body.logprobs or 0) if body.echo and body.logprobs is not None else None
    params = _sampling(body, max_tokens, body.logprobs, prompt_lps, constraint)
    offsets = _message_offsets(body.message_offsets, len(prompt_ids))
    choices, prefill = await _start_request(state, request, body, "completions", rid, prompt_ids, params, body.n,
                                            offsets)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_completion_stream(choices, prefill, head, tokenizer, body.logprobs is not None,
                                                    include_usage), media_type="text/event-stream")
    await _collect(request, merge(choices))
    # echo + logprobs grows with the prompt: build and render the answer off the loop
    return await state.workers.run(lambda: JSONResponse(
        _completion_body(choices, prefill, head, tokenizer, prompt, prompt_ids, body, score_only)))


def _completion_body(choices: list[Choice], prefill: Optional[_Tracker], head: dict[str, Any], tokenizer, prompt,
                     prompt_ids: list[int], body: p.CompletionRequest, score_only: bool) -> dict[str, Any]:
    first = prefill or choices[0].tracker
    prompt_lps = next((o.prompt_logprobs for o in first.outputs if o.prompt_logprobs), None)
    prompt_text = ""
    if body.echo:
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    out = []
    for choice in choices:
        outs = [] if score_only else choice.tracker.outputs
        text = "".join(o.new_text for o in outs)
        gen_lps = [(lp.token_id, lp) for o in outs for lp in o.logprobs]
        entries: list = []
        if body.echo and body.logprobs is not None:
            entries = list(zip(prompt_ids, prompt_lps or (None,) * len(prompt_ids)))
        logprobs = _legacy_logprobs(tokenizer, entries + gen_lps, 0) if body.logprobs is not None else None
        out.append({"index": choice.index, "text": prompt_text + text, "logprobs": logprobs,
                    "finish_reason": "length" if score_only else choice.tracker.last.finish_reason})
    usage = _choices_usage(choices, prefill, 0 if score_only else None)
    return {**head, "object": "text_completion", "choices": out, "usage": usage}


async def _completion_stream(choices: list[Choice], prefill: Optional[_Tracker], head: dict[str, Any], tokenizer,
                             want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    chunk_head = {**head, "object": "text_completion"}
    offsets = [0] * len(choices)
    outputs = merge(choices)
    try:
        async for index, out in outputs:
            logprobs = None
            if want_logprobs:
                logprobs = _legacy_logprobs(tokenizer, [(lp.token_id, lp) for lp in out.logprobs], offsets[index])
            offsets[index] += len(out.new_text)
            if out.new_text or out.finished or logprobs:
                yield _sse({**chunk_head, "choices": [{"index": index, "text": out.new_text, "logprobs": logprobs,
                                                       "finish_reason": out.finish_reason if out.finished else None}]})
        if include_usage:
            yield _sse({**chunk_head, "choices": [], "usage": _choices_usage(choices, prefill)})
    except Exception as exc:  # ApiError from the engine, or a failure: an error event, then [DONE]
        yield _stream_error(head["id"], exc)
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


async def _generate(state: ServerState, request: Request, body: p.GenerateRequest) -> Response:
    """SGLang /generate: text is cumulative in stream chunks, as SGLang sends it by default."""
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
    max_tokens = _max_tokens(state, len(prompt_ids), sp.max_new_tokens, prompt_param,
                             "sampling_params.max_new_tokens")
    _check_prompt_ids(state, prompt_ids, prompt_param)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                top_k=sp.top_k if sp.top_k not in (None, 0, -1) else None, min_p=sp.min_p,
                                seed=sp.seed, stop=sp.stop or (), stop_token_ids=tuple(sp.stop_token_ids or ()),
                                ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens)
    except ValueError as exc:
        raise bad_request(exc, "sampling_params.") from exc
    session_id = _session_id(state, body, request)
    tracker = _Tracker(rid, "generate", session_id)
    offsets = _message_offsets(body.message_offsets, len(prompt_ids))
    outputs = await _start(state, tracker, prompt_ids, params,
                           {**_extras(body, session_id, request), "message_offsets": offsets})

    def payload() -> dict[str, Any]:
        last = tracker.last
        meta = {"id": rid, "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "cached_tokens": last.reuse.prefix_tokens + last.reuse.relocated_tokens,
                "finish_reason": {"type": last.finish_reason} if last.finished else None,
                "e2e_latency": time.perf_counter() - tracker.start_s, "reuse": last.reuse.as_dict()}
        return {"text": "".join(o.new_text for o in tracker.outputs),
                "output_ids": [t for o in tracker.outputs for t in o.new_token_ids], "meta_info": meta}

    if body.stream:
        async def stream() -> AsyncIterator[str]:
            try:
                async for _ in outputs:
                    yield _sse(payload())
            except Exception as exc:  # ApiError from the engine, or a failure: an error event, then [DONE]
                yield _stream_error(rid, exc)
            finally:
                await outputs.aclose()
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")
    await _collect(request, outputs)
    return JSONResponse(payload())


# ----- the app -----------------------------------------------------------------------------------------


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


def _model_card(state: ServerState, name: str) -> p.ModelCard:
    return p.ModelCard(id=name, created=state.created, root=state.public_model_path,
                       max_model_len=state.context_limit)


def _models_and_tokens_router(state: ServerState) -> APIRouter:
    """GET /v1/models, /v1/models/{id}, POST /tokenize, /detokenize, GET /version. One router, so that a
    dependency given to `include_router` (e.g. API-key authentication) covers all of them."""
    router = APIRouter()

    @router.get("/v1/models", responses=READ_ERRORS)
    async def models() -> dict[str, Any]:
        """One card per served name, the reported one first (as vLLM lists --served-model-name)."""
        return p.ModelList(data=[_model_card(state, name) for name in state.names.reported]).model_dump()

    @router.get("/v1/models/{model_id:path}", responses=error_responses(401, 404, 500))
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(state, model_id).model_dump()

    # bodies parsed within the limits and tokenized off the loop, as on the inference routes
    @router.post("/tokenize", openapi_extra=json_request_body(TokenizeRequest), responses=TOKEN_ERRORS)
    async def tokenize_text(request: Request) -> dict[str, Any]:
        body = await state.parse(request, TokenizeRequest)
        _check_model(state, body.model)
        return await state.workers.run(tokenize, state.engine.tokenizer, body, state.context_limit)

    @router.post("/detokenize", openapi_extra=json_request_body(DetokenizeRequest), responses=TOKEN_ERRORS)
    async def detokenize_ids(request: Request) -> dict[str, Any]:
        body = await state.parse(request, DetokenizeRequest)
        _check_model(state, body.model)
        error = check_token_ids(body.tokens, state.engine.model_config.vocab_size)
        if error:
            raise ApiError(400, error, param="tokens")
        return await state.workers.run(detokenize, state.engine.tokenizer, body.tokens)

    @router.get("/version", responses=READ_ERRORS)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return router


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
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


def _engine_unavailable() -> JSONResponse:
    return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)


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
    _install_inference_routes(app, state)
    _install_info_routes(app, state)
    app.include_router(_models_and_tokens_router(state))
    install_router_routes(app)
    from kvsplice.server.anthropic import install_anthropic_routes  # these build on this module: imported
    from kvsplice.server.responses import install_responses_routes  # once it is loaded
    agent_bodies = install_responses_routes(app, state) + install_anthropic_routes(app, state)
    install_openapi(app, (p.ChatCompletionRequest, p.CompletionRequest, p.GenerateRequest, TokenizeRequest,
                          DetokenizeRequest, *agent_bodies))
    return app


def _install_inference_routes(app: FastAPI, state: ServerState) -> None:
    """The routes that run the model: each parses its body (bounded, off the loop) and calls its handler."""

    @app.post("/v1/chat/completions", openapi_extra=json_request_body(p.ChatCompletionRequest),
              responses=INFERENCE_ERRORS)
    async def chat_completions(request: Request) -> Response:
        return await _chat(state, request, await state.parse(request, p.ChatCompletionRequest))

    @app.post("/v1/completions", openapi_extra=json_request_body(p.CompletionRequest), responses=INFERENCE_ERRORS)
    async def completions(request: Request) -> Response:
        return await _completion(state, request, await state.parse(request, p.CompletionRequest))

    @app.post("/generate", openapi_extra=json_request_body(p.GenerateRequest), responses=INFERENCE_ERRORS)
    async def generate(request: Request) -> Response:
        return await _generate(state, request, await state.parse(request, p.GenerateRequest))

    @app.post("/flush_cache", responses=ADMIN_ERRORS)
    async def flush_cache(request: Request) -> Response:
        """Admin: drop every unlocked cache entry and idle session, of every tenant. POST only."""
        refuse_browser_request(request)
        if not state.async_engine.alive:
            return _engine_unavailable()
        await state.async_engine.call(state.engine.flush_cache)
        return JSONResponse({"status": "ok", "message": "cache flushed"})


def _add_probe(app: FastAPI, path: str, probe) -> None:
    """Route GET and HEAD of `path` to `probe` (HEAD: the same status and headers, no body), each with
    its own OpenAPI operation id."""
    name = path.strip("/")
    for method in ("GET", "HEAD"):
        app.add_api_route(path, probe, methods=[method], responses=PROBE_ERRORS,
                          operation_id=f"{name}_{method.lower()}")


def _install_info_routes(app: FastAPI, state: ServerState) -> None:
    """Probes, metrics and descriptions of the served model."""
    engine = state.engine

    async def health() -> Response:
        """Liveness: 200 while the engine thread runs (the model is loaded before the app starts)."""
        if not state.async_engine.alive:
            return JSONResponse(error_body("the engine thread died", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    async def readiness() -> Response:
        """Readiness: 200 only when the engine thread answers a call between steps."""
        if not state.async_engine.alive:
            return _engine_unavailable()
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
