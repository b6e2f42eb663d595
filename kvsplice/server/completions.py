"""POST /v1/completions (OpenAI's legacy completions): one prompt or a batch (text or token ids) -> `n`
choices per prompt (index prompt * n + choice) -> one `text_completion` answer, or a stream of
`text_completion` chunks (sse.py). `echo` with `max_tokens` 0 scores the prompt (its logprobs) without
generating. A batch's prompts are submitted together, after their common prefix was prefilled once (so
each finds it in the prefix cache); its usage sums the prompts'."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams
from kvsplice.server import extras
from kvsplice.server import protocol as p
from kvsplice.server.choices import Choice, merge
from kvsplice.server.errors import ApiError, bind_request_id
from kvsplice.server.openapi import INFERENCE_ERRORS, json_request_body
from kvsplice.server.extras import finish_fields, generated_ids, running_usage, wants_continuous_usage
from kvsplice.server.sampling import (check_prompt_ids, check_token_id_fields, compile_constraint, constraint_field,
                                      max_tokens, openai_sampling, text_constraint, truncate_prompt)
from kvsplice.server.sse import stream_response
from kvsplice.server.state import ServerState
from kvsplice.server.tracking import (RequestTracker, collect, engine_extras, message_offsets, submit,
                                     submit_choices)
from kvsplice.server.usage import choices_usage, wants_stream_usage

# the shortest common prefix of a batch's prompts that is prefilled once before they are submitted
MIN_SHARED_PREFIX = 16
DEFAULT_COMPLETION_TOKENS = 16


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
class _Prompt:
    """One prompt of the request: as the client sent it and as ids, its `n` choices (their indexes
    prompt index * n + choice), and the tracker of the request that prefilled it for them (n > 1)."""

    prompt: Union[str, list[int]]
    prompt_ids: list[int]
    params: SamplingParams
    choices: list[Choice]
    prefill: Optional[RequestTracker]

    @property
    def first(self) -> RequestTracker:
        """The tracker whose first output carries the prompt's logprobs."""
        return self.prefill or self.choices[0].tracker


@dataclass(frozen=True)
class _Completion:
    """A submitted completion: `head` (id, created, model) starts its answer and every chunk; its
    prompts in order; `score_only`: max_tokens 0 with echo (the one generated token is dropped)."""

    head: dict[str, Any]
    prompts: list[_Prompt]
    score_only: bool

    @property
    def choices(self) -> list[Choice]:
        """Every prompt's choices, in index order."""
        return [choice for prompt in self.prompts for choice in prompt.choices]


async def _start(state: ServerState, request: Request, body: p.CompletionRequest) -> _Completion:
    """Check, tokenize and submit the request (every refusal is raised here, before any answer)."""
    rid = bind_request_id(request, f"cmpl-{uuid.uuid4().hex}")
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    prompts = body.prompts()
    prompt_ids = await state.workers.run(
        lambda: [tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt) for prompt in prompts])
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 is only allowed with echo=true (scoring the prompt)", param="max_tokens")
    if body.echo and body.stream and body.max_tokens == 0:
        raise ApiError(400, "max_tokens: 0 (scoring the prompt) is not streamed: send stream=false",
                       param="max_tokens")
    check_token_id_fields(state, body)
    constraint = text_constraint(body)
    await compile_constraint(state, constraint, constraint_field(body))
    full_lengths = [len(ids) for ids in prompt_ids]
    prompt_ids, params, offsets = _prompt_params(state, body, prompt_ids, constraint)
    # a truncated prompt is echoed as what was kept (its ids, decoded)
    prompts = [prompt if len(ids) == length else ids for prompt, ids, length in zip(prompts, prompt_ids, full_lengths)]
    if len(prompt_ids) > 1 and params[0].prompt_logprobs is None:
        await _prefill_shared_prefix(state, request, body, rid, prompt_ids)
    submitted: list[_Prompt] = []
    try:
        for position, (prompt, ids, prompt_params) in enumerate(zip(prompts, prompt_ids, params)):
            suffix = f"-p{position}" if len(prompts) > 1 else ""
            choices, prefill = await submit_choices(state, request, body, "completions", rid + suffix, ids,
                                                    prompt_params, body.n, offsets)
            choices = [Choice(position * body.n + c.index, c.tracker, c.outputs) for c in choices]
            submitted.append(_Prompt(prompt, ids, prompt_params, choices, prefill))
    except BaseException:
        for choice in (choice for entry in submitted for choice in entry.choices):
            await choice.outputs.aclose()
        raise
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    return _Completion(head, submitted, body.max_tokens == 0)


def _prompt_params(state: ServerState, body: p.CompletionRequest, prompt_ids: list[list[int]],
                   constraint) -> tuple[list[list[int]], list[SamplingParams], Optional[tuple[int, ...]]]:
    """Each prompt's ids (truncated as asked) and SamplingParams, and the message offsets of a single
    prompt (shifted by its truncation); 400 naming the field for a prompt that does not fit."""
    score_only = body.max_tokens == 0
    echo_lps = (body.logprobs or 0) if body.echo and body.logprobs is not None else None
    wanted = [n for n in (echo_lps, body.prompt_logprobs) if n is not None]
    prompt_lps = max(wanted) if wanted else None    # one pass serves the echo and prompt_logprobs
    kept, params, cuts = [], [], []
    for ids in prompt_ids:
        ids, cut = truncate_prompt(state, ids, body.truncate_prompt_tokens, body.truncation_side)
        # max_tokens=0 with echo: generate one token and drop it, as vLLM does.
        # OpenAI's and vLLM's completions default: 16 tokens (chat's is the rest of the context), unless
        # the model's generation_config sets its own budget
        default = state.engine.tokenizer.max_new_tokens or DEFAULT_COMPLETION_TOKENS
        requested = body.max_tokens if body.max_tokens is not None else min(default, state.context_limit - len(ids))
        budget = max_tokens(state, len(ids), 1 if score_only else requested, "prompt")
        check_prompt_ids(state, ids, "prompt")
        kept.append(ids)
        cuts.append(cut)
        params.append(openai_sampling(body, budget, body.logprobs, prompt_lps, constraint,
                                      defaults=state.engine.tokenizer.sampling_defaults))
    if body.message_offsets is None:
        return kept, params, None
    offsets = message_offsets(body.message_offsets, len(prompt_ids[0]))   # checked against the prompt sent
    kept_offsets = [o - cuts[0] for o in offsets if cuts[0] < o <= cuts[0] + len(kept[0])]
    return kept, params, message_offsets(kept_offsets, len(kept[0]))


async def _prefill_shared_prefix(state: ServerState, request: Request, body: p.CompletionRequest, rid: str,
                                 prompt_ids: list[list[int]]) -> None:
    """Put the prompts' longest common prefix into the prefix cache once (one greedy token, SCR off: it
    is no conversation), so that the batch's prompts, submitted together, all find it cached."""
    shared = _common_prefix(prompt_ids)
    if len(shared) < MIN_SHARED_PREFIX:     # a BOS, or a word: not worth a request of its own
        return
    extras = {**engine_extras(body, None, request), "scr": "off", "message_offsets": None}
    tracker = RequestTracker(f"{rid}-prefix", "completions", None)
    outputs = await submit(state, tracker, shared, SamplingParams(max_tokens=1, temperature=0.0), extras)
    await collect(request, outputs)


def _common_prefix(prompt_ids: list[list[int]]) -> list[int]:
    """The longest run of ids every prompt starts with (shorter than the shortest prompt, which must keep
    a token to compute)."""
    shortest = min(len(ids) for ids in prompt_ids)
    length = 0
    while length < shortest - 1 and all(ids[length] == prompt_ids[0][length] for ids in prompt_ids):
        length += 1
    return prompt_ids[0][:length]


def _answer(completion: _Completion, body: p.CompletionRequest, tokenizer) -> dict[str, Any]:
    """The `text_completion` answer of a finished request (with echo: each prompt, and its logprobs)."""
    out = [choice for prompt in completion.prompts for choice in _prompt_choices(prompt, completion, body, tokenizer)]
    return {**completion.head, "object": "text_completion", "choices": out, "usage": _usage(completion)}


def _prompt_choices(prompt: _Prompt, completion: _Completion, body: p.CompletionRequest,
                    tokenizer) -> list[dict[str, Any]]:
    """The answer's choices of one prompt. An echoed prompt of token ids is decoded with its special
    tokens, as `tokens` shows them, and the reply's `text_offset` starts where the echoed text ends."""
    prompt_ids, score_only = prompt.prompt_ids, completion.score_only
    prompt_lps = next((o.prompt_logprobs for o in prompt.first.outputs if o.prompt_logprobs), None)
    prompt_text = _echo_text(prompt, tokenizer) if body.echo else ""
    echoed = _echo_logprobs(prompt, prompt.first.outputs, body, tokenizer) if body.echo else None
    out = []
    for choice in prompt.choices:
        outs = [] if score_only else choice.tracker.outputs
        text = "".join(o.new_text for o in outs)
        logprobs = None
        if body.logprobs is not None:
            generated = [(lp.token_id, lp) for o in outs for lp in o.logprobs]
            logprobs = _logprobs(tokenizer, generated, len(prompt_text), None, body.return_tokens_as_token_ids)
            if echoed is not None:
                logprobs = _joined(echoed, logprobs)
        reason = "length" if score_only else choice.tracker.last.finish_reason
        entry = {"index": choice.index, "text": prompt_text + text, "logprobs": logprobs, "finish_reason": reason,
                 **finish_fields(tokenizer, prompt.params, prompt_ids, outs, reason)}
        # vLLM's choices always have the key (null when not asked for)
        entry["prompt_logprobs"] = None if body.prompt_logprobs is None else \
            extras.prompt_logprobs(tokenizer, prompt_ids, prompt_lps, body.prompt_logprobs)
        if body.return_token_ids:
            entry.update(prompt_token_ids=prompt_ids, token_ids=generated_ids(outs))
        out.append(entry)
    return out


def _echo_text(prompt: _Prompt, tokenizer) -> str:
    """The echoed prompt: as sent, or a prompt of token ids decoded with its special tokens (as the
    echoed `tokens` show them)."""
    return prompt.prompt if isinstance(prompt.prompt, str) else tokenizer.decode(prompt.prompt_ids,
                                                                                 skip_special_tokens=False)


def _echo_logprobs(prompt: _Prompt, outputs: Sequence[RequestOutput], body: p.CompletionRequest,
                   tokenizer) -> dict[str, Any]:
    """The echoed prompt's `logprobs` (the first of `outputs` that carries prompt logprobs; null
    entries where none does yet): the answer's, and a streamed choice's first chunk's."""
    lps = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None)
    echoed = list(zip(prompt.prompt_ids, lps or (None,) * len(prompt.prompt_ids)))
    return _logprobs(tokenizer, echoed, 0, body.logprobs or 0, body.return_tokens_as_token_ids)


def _usage(completion: _Completion) -> dict[str, Any]:
    """`usage` of the whole request: each prompt counted once (its choices share it), summed over the
    prompts; in `reuse`, the counters are summed and the rest is the first prompt's."""
    parts = [choices_usage(prompt.choices, prompt.prefill, 0 if completion.score_only else None)
             for prompt in completion.prompts]
    return functools.reduce(_add_usage, parts)


def _add_usage(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {key: add(value, b.get(key)) for key, value in a.items()}
        is_count = isinstance(a, int) and not isinstance(a, bool) and isinstance(b, int)
        return a + b if is_count else a

    return add(total, part)


async def _chunks(completion: _Completion, body: p.CompletionRequest, tokenizer,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[dict[str, Any], None]:
    """The `text_completion` chunk payloads: each choice's new text (and logprobs; with return_token_ids
    its new ids, the prompt's on its first chunk; the usage so far when continuous), then (when asked)
    usage."""
    chunk_head = {**completion.head, "object": "text_completion"}
    prompts = {choice.index: (prompt, choice) for prompt in completion.prompts for choice in prompt.choices}
    offsets = {index: 0 for index in prompts}
    started: set[int] = set()
    want_logprobs, continuous = body.logprobs is not None, wants_continuous_usage(body)
    async for index, out in outputs:
        prompt, choice = prompts[index]
        # echo: a choice's first chunk starts with the prompt (and its logprobs), as vLLM and SGLang stream it
        echo = body.echo and index not in started
        echo_text = _echo_text(prompt, tokenizer) if echo else ""
        offsets[index] += len(echo_text)
        logprobs = None
        if want_logprobs:
            logprobs = _logprobs(tokenizer, [(lp.token_id, lp) for lp in out.logprobs], offsets[index], None,
                                 body.return_tokens_as_token_ids)
            if echo:
                logprobs = _joined(_echo_logprobs(prompt, (out, *prompt.first.outputs), body, tokenizer), logprobs)
        offsets[index] += len(out.new_text)
        if not (echo or out.new_text or out.finished or logprobs or (body.return_token_ids and out.new_token_ids)):
            continue
        reason = out.finish_reason if out.finished else None
        entry = {"index": index, "text": echo_text + out.new_text, "logprobs": logprobs, "finish_reason": reason,
                 "stop_reason": None, "matched_stop": None}
        if out.finished:
            entry.update(finish_fields(tokenizer, prompt.params, prompt.prompt_ids, choice.tracker.outputs, reason))
        if body.return_token_ids:
            entry["token_ids"] = list(out.new_token_ids)
            if index not in started:
                entry["prompt_token_ids"] = prompt.prompt_ids
        started.add(index)
        chunk = {**chunk_head, "choices": [entry]}
        if continuous:
            chunk["usage"] = running_usage(out)
        yield chunk
    if wants_stream_usage(body):
        yield {**chunk_head, "choices": [], "usage": _usage(completion)}


def _logprobs(tokenizer, lps, first_offset: int, top_n: Optional[int], as_ids: bool) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob} or None),
    text_offset (character offset of each token in the returned text, from `first_offset`). An entry of
    `lps` may be None (the first prompt token): its logprob and top_logprobs are null. `top_logprobs`
    holds the first `top_n` entries of each `lp.top` (all of them when None: a generated token's are
    what its request asked for, the most likely or its `logprob_token_ids`) and, as vLLM's, the chosen
    one (so `logprobs: 0` gives just it). `as_ids` (vLLM's `return_tokens_as_token_ids`) writes each
    token, in `tokens` and as a `top_logprobs` key, as "token_id:N"; `text_offset` still counts the
    tokens' text, which is what the answer's text holds."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = first_offset

    def name(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else tokenizer.token_str(token_id)

    for token_id, lp in lps:
        tokens.append(name(token_id))
        offsets.append(offset)
        offset += len(tokenizer.token_str(token_id))
        token_lps.append(None if lp is None else lp.logprob)
        if lp is None:
            tops.append(None)
            continue
        top = {name(t): v for t, v in lp.top[:top_n]}
        top.setdefault(name(token_id), lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _joined(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    """Two `logprobs` objects as one (the echoed prompt's, then the reply's)."""
    return {key: first[key] + second[key] for key in first}
