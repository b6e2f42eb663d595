"""One assistant turn of a protocol served through the chat-completions path (OpenAI's Responses API,
Anthropic's Messages API): the adapter translates its body into a ChatCompletionRequest, and the turn
runs exactly as a chat completion does (chat template, tool offer and parsing, grammar-forced calls and
structured outputs, limits, tenancy, SCR sessions), then hands back the reply in neutral parts.

    protocol body ─(adapter)─> ChatCompletionRequest + FieldNames ─start_turn─> Turn
        await turn.reply()   -> Reply: content, reasoning, calls, finish reason, Usage
        turn.events()        -> ReasoningDelta | TextDelta | CallStart | CallArguments ..., then Finished

Errors name the adapter's fields, not the chat ones: `FieldNames` maps a chat field (`messages`,
`max_tokens`, `response_format`, ...) to the protocol's (`input`, `max_output_tokens`, `text.format`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from starlette.requests import Request

from kvsplice.engine.request import RequestOutput
from kvsplice.server import protocol as p
from kvsplice.server import sampling
from kvsplice.server.sampling import compile_reply_constraints, openai_sampling, reply_plan
from kvsplice.server.state import ServerState
from kvsplice.server.tracking import collect, submit_choices
from kvsplice.server.body import validate_body
from kvsplice.server.chat import ChatTemplateError
from kvsplice.server.choices import Choice
from kvsplice.server.errors import ApiError, bind_request_id
from kvsplice.server.replies import ReplyFormat

FieldNames = Mapping[str, str]   # chat field -> the protocol's field of the same meaning


@dataclass(frozen=True)
class Call:
    """One tool call of a reply: its id, the function's name, the arguments as JSON text."""

    call_id: str
    name: str
    arguments: str

    def input(self) -> dict[str, Any]:
        """The arguments as an object ({} when they are not a JSON object)."""
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Usage:
    """What a finished turn cost: prompt tokens (`cached` of them from the cache, exactly or relocated),
    completion tokens, and kvsplice's `reuse` (ReuseStats.as_dict())."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reuse: dict[str, Any]

    @classmethod
    def of(cls, out: RequestOutput) -> "Usage":
        return cls(out.prompt_tokens, out.completion_tokens, out.reuse.prefix_tokens + out.reuse.relocated_tokens,
                   out.reuse.as_dict())


@dataclass(frozen=True)
class Reply:
    """A whole reply: visible text (None: none), the reasoning block (None: none), the calls, the chat
    finish reason ("stop", "length", "tool_calls", ...), the generated token ids and the usage."""

    content: Optional[str]
    reasoning: Optional[str]
    calls: tuple[Call, ...]
    finish_reason: Optional[str]
    token_ids: tuple[int, ...]
    usage: Usage

    def message(self) -> dict[str, Any]:
        """The reply as a chat assistant message (what a later turn sends back)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [{"id": c.call_id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return message


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    """A call's first delta: its index in the reply, id, name and the first arguments text."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    """The last event: the chat finish reason, the generated token ids and the usage."""

    finish_reason: Optional[str]
    token_ids: tuple[int, ...]
    usage: Usage


Event = Union[TextDelta, ReasoningDelta, CallStart, CallArguments, Finished]


def renamed(error: ApiError, names: FieldNames) -> ApiError:
    """`error` naming the protocol's field instead of the chat field it names (unchanged if none)."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    base = head.split("[", 1)[0]
    if base not in names:
        return error
    param = names[base] + (dot + rest if dot else "")
    message = error.message
    if message.startswith(error.param):
        message = param + message[len(error.param):]
    elif message.startswith(base):
        message = names[base] + message[len(base):]
    return ApiError(error.status, message, param=param, code=error.code, error_type=error.error_type,
                    headers=error.headers)


def chat_body(state: ServerState, fields: dict[str, Any], names: FieldNames) -> p.ChatCompletionRequest:
    """`fields` (a chat-completions body) validated within the server's limits; a 400 names the
    protocol's field."""
    try:
        return validate_body(p.ChatCompletionRequest, fields, state.limits)
    except ApiError as error:
        raise renamed(error, names) from error


class Turn:
    """A submitted turn: its engine request (first output already in) and how its reply is shaped."""

    def __init__(self, rid: str, request: Request, choice: Choice, fmt: ReplyFormat):
        self.rid, self.request, self.choice, self.fmt = rid, request, choice, fmt

    @property
    def first(self) -> RequestOutput:
        """The first output (the prompt's size and reuse are known from it)."""
        return self.choice.tracker.outputs[0]

    async def reply(self) -> Reply:
        """Wait for the whole reply (a client that disconnects aborts it)."""
        await collect(self.request, self.choice.outputs)
        outputs = self.choice.tracker.outputs
        message, reason = self.fmt.message("".join(o.new_text for o in outputs), outputs[-1].finish_reason)
        calls = tuple(Call(c["id"], c["function"]["name"], c["function"]["arguments"])
                      for c in message.get("tool_calls") or ())
        return Reply(message["content"] or None, message.get("reasoning_content") or None, calls, reason,
                     tuple(t for o in outputs for t in o.new_token_ids), Usage.of(outputs[-1]))

    async def events(self) -> AsyncIterator[Event]:
        """The reply as events, ending with Finished. Closing it aborts the request."""
        stream = self.fmt.stream()
        token_ids: list[int] = []
        outputs = self.choice.outputs
        try:
            async for out in outputs:
                token_ids.extend(out.new_token_ids)
                delta = stream.feed(out.new_text, final=out.finished)
                if delta.get("reasoning_content"):
                    yield ReasoningDelta(delta["reasoning_content"])
                if delta.get("content"):
                    yield TextDelta(delta["content"])
                for call in delta.get("tool_calls") or ():
                    if "id" in call:
                        yield CallStart(call["index"], call["id"], call["function"]["name"],
                                        call["function"].get("arguments") or "")
                    else:
                        yield CallArguments(call["index"], call["function"]["arguments"])
                if out.finished:
                    yield Finished(stream.finish_reason(out.finish_reason), tuple(token_ids), Usage.of(out))
        finally:
            await outputs.aclose()


async def start_turn(state: ServerState, request: Request, body: p.ChatCompletionRequest, endpoint: str,
                     rid: str, names: FieldNames, max_calls: Optional[int] = None) -> Turn:
    """Submit `body` as one chat turn (n = 1; `max_calls`: keep at most that many calls of the reply).
    Raises ApiError (naming the protocol's fields) before anything is sent."""
    try:
        return await _start_turn(state, request, body, endpoint, bind_request_id(request, rid), names, max_calls)
    except ApiError as error:
        raise renamed(error, names) from error


async def _start_turn(state: ServerState, request: Request, body: p.ChatCompletionRequest, endpoint: str,
                      rid: str, names: FieldNames, max_calls: Optional[int]) -> Turn:
    state.check_model(body.model)
    tools, constraint, constraint_param = reply_plan(state, body)
    if max_calls is not None:
        tools = dataclasses.replace(tools, max_calls=min(max_calls, tools.max_calls or max_calls))
    await compile_reply_constraints(state, body, tools, constraint, constraint_param)
    try:
        prompt_ids = await state.workers.run(state.chat.prompt_ids, body.messages, tools.template_tools)
    except ChatTemplateError as error:
        raise ApiError(400, str(error), param=error.param) from error
    max_tokens = sampling.max_tokens(state, len(prompt_ids), body.max_tokens, names.get("messages", "messages"),
                                     names.get("max_tokens", "max_tokens"))
    params = openai_sampling(body, max_tokens, None, None, constraint, tools.keep_special_tokens,
                             state.engine.tokenizer.sampling_defaults)
    offsets = await state.workers.run(state.chat.message_offsets, body.messages, prompt_ids,
                                      tools.template_tools) if state.wants_message_offsets else None
    choices, _ = await submit_choices(state, request, body, endpoint, rid, prompt_ids, params, 1, offsets)
    return Turn(rid, request, choices[0], ReplyFormat(state.settings.reasoning_parser, tools, state.chat.parser))


async def count_prompt_tokens(state: ServerState, body: p.ChatCompletionRequest, names: FieldNames) -> int:
    """The prompt tokens `body` would have, as the turn would render it (tools offered included)."""
    try:
        state.check_model(body.model)
        tools, _, _ = reply_plan(state, body)
        return len(await state.workers.run(state.chat.prompt_ids, body.messages, tools.template_tools))
    except ChatTemplateError as error:
        raise renamed(ApiError(400, str(error), param=error.param), names) from error
    except ApiError as error:
        raise renamed(error, names) from error


def matched_stop(tokenizer, token_ids: tuple[int, ...], stop: tuple[str, ...]) -> Optional[str]:
    """The stop string that ended a reply of `token_ids` (the earliest in the decoded text, the longer
    on a tie), or None when it ended otherwise (EOS, a stop token)."""
    if not stop or not token_ids or token_ids[-1] in tokenizer.eos_token_ids:
        return None
    text = tokenizer.decode(list(token_ids))
    found = [(text.find(s), -len(s), s) for s in stop if s in text]
    return min(found)[2] if found else None
