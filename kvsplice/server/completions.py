"""POST /v1/completions (OpenAI's legacy completions): a prompt (text or token ids) -> `n` choices ->
one `text_completion` answer, or a stream of `text_completion` chunks (sse.py). `echo` with
`max_tokens` 0 scores the prompt (its logprobs) without generating."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvsplice.engine.request import RequestOutput
from kvsplice.server import protocol as p
from kvsplice.server.choices import Choice, merge
from kvsplice.server.errors import ApiError, bind_request_id
from kvsplice.server.openapi import INFERENCE_ERRORS, json_request_body
from kvsplice.server.sampling import (check_prompt_ids, compile_constraint, constraint_field, max_tokens,
                                      openai_sampling, text_constraint)
from kvsplice.server.sse import stream_response
from kvsplice.server.state import ServerState
from kvsplice.server.tracking import RequestTracker, collect, message_offsets, submit_choices
from kvsplice.server.usage import choices_usage, wants_stream_usage


def install_completion_routes(app: FastAPI, state: ServerState) -> tuple[type[BaseModel], ...]:
    """Add POST /v1/completions to `app`; returns the body model it parses."""

    @app.post("/v1/completions", openapi_extra=json_request_body(p.CompletionRequest), responses=INFERENCE_ERRORS)
    async def completions(request: Request) -> Response:
        body = await state.parse(request, p.CompletionRequest)
        completion = await _start(state, request, body)
        tokenizer = state.engine.tokenizer
        outputs = merge(completion.choices)
        if body.stream:
            return stream_response(completion.head["id"], _chunks(completion, body, tokenizer, outputs), outputs)
        await collect(request, outputs)
        # echo + logprobs grows with the prompt: build and render the answer off the loop
        return await state.workers.run(lambda: JSONResponse(_answer(completion, body, tokenizer)))

    return (p.CompletionRequest,)


@dataclass(frozen=True)
class _Completion:
    """A submitted completion: `head` (id, created, model) starts its answer and every chunk; `prompt` as
    the client sent it and as ids; `score_only`: max_tokens 0 with echo (the one generated token is
    dropped)."""

    head: dict[str, Any]
    choices: list[Choice]
    prefill: Optional[RequestTracker]
    prompt: Union[str, list[int]]
    prompt_ids: list[int]
    score_only: bool


async def _start(state: ServerState, request: Request, body: p.CompletionRequest) -> _Completion:
    """Check, tokenize and submit the request (every refusal is raised here, before any answer)."""
    rid = bind_request_id(request, f"cmpl-{uuid.uuid4().hex}")
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    prompt = body.single_prompt()
    prompt_ids = await state.workers.run(tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 is only allowed with echo=true (scoring the prompt)", param="max_tokens")
    if body.echo and body.stream:
        raise ApiError(400, "echo is not supported with stream=true", param="echo")
    constraint = text_constraint(body)
    await compile_constraint(state, constraint, constraint_field(body))
    score_only = body.max_tokens == 0
    # max_tokens=0 with echo: generate one token and drop it, as vLLM does.
    budget = max_tokens(state, len(prompt_ids), 1 if score_only else body.max_tokens, "prompt")
    check_prompt_ids(state, prompt_ids, "prompt")
    prompt_lps = (body.logprobs or 0) if body.echo and body.logprobs is not None else None
    params = openai_sampling(body, budget, body.logprobs, prompt_lps, constraint)
    offsets = message_offsets(body.message_offsets, len(prompt_ids))
    choices, prefill = await submit_choices(state, request, body, "completions", rid, prompt_ids, params, body.n,
                                            offsets)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    return _Completion(head, choices, prefill, prompt, prompt_ids, score_only)


def _answer(completion: _Completion, body: p.CompletionRequest, tokenizer) -> dict[str, Any]:
    """The `text_completion` answer of a finished request (with echo: the prompt, and its logprobs)."""
    prompt_ids, score_only = completion.prompt_ids, completion.score_only
    first = completion.prefill or completion.choices[0].tracker
    prompt_lps = next((o.prompt_logprobs for o in first.outputs if o.prompt_logprobs), None)
    prompt_text = ""
    if body.echo:
        prompt = completion.prompt
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    out = []
    for choice in completion.choices:
        outs = [] if score_only else choice.tracker.outputs
        text = "".join(o.new_text for o in outs)
        gen_lps = [(lp.token_id, lp) for o in outs for lp in o.logprobs]
        entries: list = []
        if body.echo and body.logprobs is not None:
            entries = list(zip(prompt_ids, prompt_lps or (None,) * len(prompt_ids)))
        logprobs = _logprobs(tokenizer, entries + gen_lps, 0) if body.logprobs is not None else None
        out.append({"index": choice.index, "text": prompt_text + text, "logprobs": logprobs,
                    "finish_reason": "length" if score_only else choice.tracker.last.finish_reason})
    usage = choices_usage(completion.choices, completion.prefill, 0 if score_only else None)
    return {**completion.head, "object": "text_completion", "choices": out, "usage": usage}


async def _chunks(completion: _Completion, body: p.CompletionRequest, tokenizer,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[dict[str, Any], None]:
    """The `text_completion` chunk payloads: each choice's new text (and logprobs), then (when asked) usage."""
    chunk_head = {**completion.head, "object": "text_completion"}
    offsets = [0] * len(completion.choices)
    want_logprobs = body.logprobs is not None
    async for index, out in outputs:
        logprobs = None
        if want_logprobs:
            logprobs = _logprobs(tokenizer, [(lp.token_id, lp) for lp in out.logprobs], offsets[index])
        offsets[index] += len(out.new_text)
        if out.new_text or out.finished or logprobs:
            yield {**chunk_head, "choices": [{"index": index, "text": out.new_text, "logprobs": logprobs,
                                              "finish_reason": out.finish_reason if out.finished else None}]}
    if wants_stream_usage(body):
        yield {**chunk_head, "choices": [], "usage": choices_usage(completion.choices, completion.prefill)}


def _logprobs(tokenizer, lps, first_offset: int) -> dict[str, Any]:
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
