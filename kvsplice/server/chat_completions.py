"""POST /v1/chat/completions: messages -> the chat template's prompt ids (chat.py) -> `n` choices ->
one `chat.completion` answer, or a stream of `chat.completion.chunk` events (sse.py).

    body ─ tools, reply constraint (sampling.reply_plan) ─ prompt ids (worker pool) ─ SamplingParams
         ─ choices (tracking.submit_choices) ─ reply text -> assistant message / deltas (replies.py)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams
from kvsplice.server import extras
from kvsplice.server import protocol as p
from kvsplice.server.chat import ChatTemplateError
from kvsplice.server.choices import Choice, merge
from kvsplice.server.errors import ApiError, bind_request_id
from kvsplice.server.openapi import INFERENCE_ERRORS, json_request_body
from kvsplice.server.replies import ReplyFormat
from kvsplice.server.extras import (finish_fields, generated_ids, running_usage, wants_continuous_usage,
                                    with_reasoning_slot)
from kvsplice.server.sampling import (check_token_id_fields, compile_reply_constraints, max_tokens, openai_sampling,
                                      reply_plan, truncate_prompt)
from kvsplice.server.sse import stream_response
from kvsplice.server.state import ServerState
from kvsplice.server.tracking import RequestTracker, collect, submit_choices
from kvsplice.server.usage import choices_usage, wants_stream_usage


def install_chat_routes(app: FastAPI, state: ServerState) -> tuple[type[BaseModel], ...]:
    """Add POST /v1/chat/completions to `app`; returns the body model it parses."""

    @app.post("/v1/chat/completions", openapi_extra=json_request_body(p.ChatCompletionRequest),
              responses=INFERENCE_ERRORS)
    async def chat_completions(request: Request) -> Response:
        body = await state.parse(request, p.ChatCompletionRequest)
        chat = await _start(state, request, body)
        tokenizer = state.engine.tokenizer
        outputs = merge(chat.choices)
        if body.stream:
            return stream_response(chat.head["id"], _chunks(chat, body, tokenizer, outputs), outputs)
        await collect(request, outputs)
        return JSONResponse(_completion(chat, body, tokenizer))

    return (p.ChatCompletionRequest,)


@dataclass(frozen=True)
class _Chat:
    """A submitted chat completion: `head` (id, created, model) starts its answer and every chunk; `fmt`
    turns its reply text into messages or deltas."""

    head: dict[str, Any]
    choices: list[Choice]
    prefill: Optional[RequestTracker]
    fmt: ReplyFormat
    prompt_ids: list[int]
    params: SamplingParams


async def _start(state: ServerState, request: Request, body: p.ChatCompletionRequest) -> _Chat:
    """Check, render and submit the request (every refusal is raised here, before any answer)."""
    rid = bind_request_id(request, f"chatcmpl-{uuid.uuid4().hex}")
    state.check_model(body.model)
    if body.max_tokens == 0:
        raise ApiError(400, "max_tokens: must be >= 1 for chat completions", param="max_tokens")
    tools, constraint, constraint_param = reply_plan(state, body)
    await compile_reply_constraints(state, body, tools, constraint, constraint_param)
    try:
        prompt_ids = await state.workers.run(state.chat.prompt_ids, body.messages, tools.template_tools,
                                             body.chat_template_kwargs, body.add_generation_prompt,
                                             bool(body.continue_final_message))
    except ChatTemplateError as error:
        raise ApiError(400, str(error), param=error.param) from error
    check_token_id_fields(state, body)
    offsets = await state.workers.run(state.chat.message_offsets, body.messages, prompt_ids, tools.template_tools,
                                      body.chat_template_kwargs, body.add_generation_prompt,
                                      bool(body.continue_final_message)) if state.wants_message_offsets else None
    prompt_ids, cut = truncate_prompt(state, prompt_ids, body.truncate_prompt_tokens, body.truncation_side)
    if offsets is not None:
        offsets = [offset - cut for offset in offsets if cut < offset <= cut + len(prompt_ids)]
    budget = max_tokens(state, len(prompt_ids), body.max_tokens, "messages")
    top_n = body.top_logprobs or 0
    params = openai_sampling(body, budget, top_n if body.logprobs else None, body.prompt_logprobs, constraint,
                             tools.keep_special_tokens, state.engine.tokenizer.sampling_defaults)
    choices, prefill = await submit_choices(state, request, body, "chat", rid, prompt_ids, params, body.n, offsets)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    fmt = ReplyFormat(state.settings.reasoning_parser, tools, state.chat.parser)
    return _Chat(head, choices, prefill, fmt, prompt_ids, params)


def _completion(chat: _Chat, body: p.ChatCompletionRequest, tokenizer) -> dict[str, Any]:
    """The `chat.completion` answer of a finished request (with return_token_ids: the prompt's ids, and
    each choice's; with prompt_logprobs: the prompt's, in vLLM's shape)."""
    out = []
    for choice in chat.choices:
        outputs = choice.tracker.outputs
        last = choice.tracker.last.finish_reason
        message, reason = chat.fmt.message("".join(o.new_text for o in outputs), last)
        lps = [lp for o in outputs for lp in o.logprobs]
        entry = {"index": choice.index, "message": message, "finish_reason": reason,
                 "logprobs": _logprobs(tokenizer, lps, body.return_tokens_as_token_ids) if body.logprobs else None,
                 **finish_fields(tokenizer, chat.params, chat.prompt_ids, outputs, last)}
        if body.return_token_ids:
            entry["token_ids"] = generated_ids(outputs)
        out.append(entry)
    answer = {**chat.head, "object": "chat.completion", "choices": out,
              "usage": choices_usage(chat.choices, chat.prefill)}
    answer["prompt_logprobs"] = None    # vLLM's response always has the key (null when not asked for)
    if body.prompt_logprobs is not None:
        first = chat.prefill or chat.choices[0].tracker
        lps = next((o.prompt_logprobs for o in first.outputs if o.prompt_logprobs), None)
        answer["prompt_logprobs"] = extras.prompt_logprobs(tokenizer, chat.prompt_ids, lps, body.prompt_logprobs)
    if body.return_token_ids:
        answer["prompt_token_ids"] = chat.prompt_ids
    return answer


async def _chunks(chat: _Chat, body: p.ChatCompletionRequest, tokenizer,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[dict[str, Any], None]:
    """The `chat.completion.chunk` payloads: each choice's role (with return_token_ids, the prompt's ids
    on the first), its deltas, then (when asked) usage; with continuous usage, every chunk has the
    usage so far."""
    chunk_head = {**chat.head, "object": "chat.completion.chunk"}
    streams = [chat.fmt.stream() for _ in chat.choices]
    continuous = wants_continuous_usage(body)
    for choice in chat.choices:
        chunk = {**chunk_head, "choices": [{"index": choice.index, "delta": with_reasoning_slot(
            {"role": "assistant", "content": ""}), "logprobs": None, "finish_reason": None}]}
        if body.return_token_ids and choice.index == 0:
            chunk["prompt_token_ids"] = chat.prompt_ids
        if continuous:
            chunk["usage"] = running_usage(dataclasses.replace(choice.tracker.outputs[0], completion_tokens=0))
        yield chunk
    async for index, out in outputs:
        delta = streams[index].feed(out.new_text, final=out.finished)
        reason = streams[index].finish_reason(out.finish_reason) if out.finished else None
        logprobs = _logprobs(tokenizer, out.logprobs, body.return_tokens_as_token_ids) if body.logprobs else None
        if not (delta or out.finished or logprobs or (body.return_token_ids and out.new_token_ids)):
            continue
        entry = {"index": index, "delta": with_reasoning_slot(delta), "finish_reason": reason, "logprobs": logprobs,
                 "stop_reason": None, "matched_stop": None}
        if out.finished:
            entry.update(finish_fields(tokenizer, chat.params, chat.prompt_ids, chat.choices[index].tracker.outputs,
                                       out.finish_reason))
        if body.return_token_ids:
            entry["token_ids"] = list(out.new_token_ids)
        chunk = {**chunk_head, "choices": [entry]}
        if continuous:
            chunk["usage"] = running_usage(out)
        yield chunk
    if wants_stream_usage(body):
        yield {**chunk_head, "choices": [], "usage": choices_usage(chat.choices, chat.prefill)}


def _logprobs(tokenizer, lps, as_ids: bool) -> dict[str, Any]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}, each token's
    `top_logprobs` what its request asked for (the `top_logprobs` most likely, or its `logprob_token_ids`).
    `as_ids` (vLLM's `return_tokens_as_token_ids`) writes each `token` as "token_id:N"; `bytes` stay the
    token's own UTF-8 bytes."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_str(token_id)
        token = f"token_id:{token_id}" if as_ids else text
        return {"token": token, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}
