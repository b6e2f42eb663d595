"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, served as chat turns
(chat_turn.py), so tools, grammar-forced calls, limits, tenancy and Suffix Cache Reuse work exactly as on
/v1/chat/completions.

    MessagesRequest ─> chat messages: system (string or text blocks), then each message's blocks
                       (a system-role message, as Claude Code sends mid-conversation: a system message,
                       which chat.py folds into the next user turn where the template shows none there):
                       text -> its role's text, tool_use -> the assistant's tool_calls,
                       tool_result -> a tool message, thinking -> the assistant's reasoning_content
        ─> chat turn ─> content blocks: thinking, text, tool_use; stop_reason end_turn | max_tokens |
                        stop_sequence | tool_use; usage with Anthropic's cache fields and kvsplice's reuse

tool_choice: auto -> auto, any -> required, tool -> that function, none -> none;
`disable_parallel_tool_use` -> parallel_tool_calls false.

Streamed: message_start, ping, then per block content_block_start, content_block_delta (text_delta,
input_json_delta, thinking_delta) ..., content_block_stop; message_delta (stop_reason, usage) and
message_stop; a failure after the first event is an `error` event.

Errors: every 4xx/5xx on these routes, whichever layer refuses the request (authentication, body
limits, validation, the engine), is Anthropic's body {"type": "error", "error": {"type", "message"}},
with kvsplice's `param` (the field at fault) and `code` kept inside `error` (AnthropicErrorMiddleware).
Authentication takes the `x-api-key` header as well as `Authorization: Bearer` (auth.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvsplice.server.anthropic_protocol import (AnthropicError, CountTokensRequest, MessagesRequest, TextBlock,
                                                ThinkingBlock, ToolResultBlock, ToolUseBlock)
from kvsplice.server.openapi import INFERENCE_ERRORS
from kvsplice.server.state import ServerState
from kvsplice.server.chat_turn import (CallArguments, CallStart, Finished, ReasoningDelta, TextDelta, Turn, Usage,
                                       chat_body, count_prompt_tokens, matched_stop, start_turn)
from kvsplice.server.errors import ERROR_STATUSES, ApiError, internal_error
from kvsplice.server.openapi import json_request_body

PATH_PREFIX = "/v1/messages"
ENDPOINT = "messages"
FIELD_NAMES = {"response_format": "output_config.format", "parallel_tool_calls": "tool_choice",
               "stop": "stop_sequences"}
# Anthropic's error type for each status the server sends
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


# ----- request -> chat messages ------------------------------------------------------------------------


def _system_text(system) -> Optional[str]:
    if system is None or isinstance(system, str):
        return system or None
    return "\n\n".join(block.text for block in system) or None


def _assistant_message(content) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts = [block.text for block in content if isinstance(block, TextBlock)]
    if texts:
        message["content"] = "".join(texts)
    thoughts = [block.thinking for block in content if isinstance(block, ThinkingBlock)]
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
             for block in content if isinstance(block, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    if any(isinstance(block, ToolResultBlock) for block in content):
        raise ApiError(400, "messages: tool_result blocks belong in user messages", param="messages")
    return message


def _user_messages(content) -> list[dict[str, Any]]:
    """A user message's blocks in order: tool results as tool messages, text runs as user messages."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for block in content:
        if isinstance(block, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise ApiError(400, f"messages: {block.type} blocks belong in assistant messages", param="messages")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def chat_messages(body) -> list[dict[str, Any]]:
    """The chat messages of the request. A final assistant message (Anthropic's prefill: the reply
    continues it) is refused: the chat template would open a new assistant turn after it instead."""
    if body.messages[-1].role == "assistant":
        raise ApiError(400, f"messages.{len(body.messages) - 1}: a final assistant message (prefilling the "
                            f"reply) is not supported; end with a user message",
                       param=f"messages.{len(body.messages) - 1}")
    system = _system_text(body.system)
    out = [{"role": "system", "content": system}] if system else []
    for message in body.messages:
        if message.role == "system":
            out.append({"role": "system", "content": _system_text(message.content) or ""})
        elif message.role == "user":
            out.extend(_user_messages(message.content))
        else:
            out.append(_assistant_message(message.content))
    return out


def _tool_fields(body) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema, "strict": tool.strict}}
            for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ApiError(400, "tool_choice: type tool needs a name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    return fields


def chat_fields(body: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body of this request."""
    fields = {"messages": chat_messages(body), "model": body.model, "max_tokens": body.max_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "stop": body.stop_sequences or None, "cache_salt": body.cache_salt, "session_id": body.session_id,
              "scr": body.scr, **_tool_fields(body)}
    return {name: value for name, value in fields.items() if value is not None}


# ----- the Message object ------------------------------------------------------------------------------


def usage_body(usage: Usage, output_tokens: Optional[int] = None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens computed, cache_read_input_tokens the ones
    served from the cache (exactly or relocated); nothing is reported as cache creation, as every
    prompt is cached without asking. The three add up to the prompt."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens,
            "reuse": usage.reuse}


def stop_reason(finish_reason: Optional[str], stop: Optional[str]) -> str:
    if stop is not None and finish_reason == "stop":
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn")


def _message_head(state: ServerState, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": state.model_name}


# ----- streaming ---------------------------------------------------------------------------------------


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


class MessageEvents:
    """The Messages event stream of one reply: chat_turn events -> content block events."""

    def __init__(self):
        self.index = -1
        self.open: Optional[str] = None   # the kind of the block being streamed: text, thinking, tool_use

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        sent = self.close()
        self.index += 1
        self.open = kind
        return sent + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def text(self, text: str, kind: str) -> list[str]:
        sent = []
        if self.open != kind:
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                        "signature": ""}
            sent = self._start(kind, block)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return sent + [_event("content_block_delta", {"index": self.index, "delta": delta})]

    def call_start(self, start: CallStart) -> list[str]:
        sent = self._start("tool_use", {"type": "tool_use", "id": start.call_id, "name": start.name, "input": {}})
        if start.arguments:
            sent += self.call_arguments(CallArguments(start.index, start.arguments))
        return sent

    def call_arguments(self, delta: CallArguments) -> list[str]:
        return [_event("content_block_delta", {"index": self.index,
                                               "delta": {"type": "input_json_delta", "partial_json": delta.text}})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


def _error_event(rid: str, exc: Exception) -> str:
    error = exc if isinstance(exc, ApiError) else internal_error(rid, exc)
    return _event("error", {"error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}})


# ----- handlers ----------------------------------------------------------------------------------------


class MessagesApi:
    """The Messages routes' handlers over one server's state."""

    def __init__(self, state: ServerState):
        self.state = state

    async def create(self, request: Request, body: MessagesRequest) -> Response:
        message_id = f"msg_{uuid.uuid4().hex}"
        fields = await self.state.workers.run(chat_fields, body)
        chat = await self.state.workers.run(chat_body, self.state, fields, FIELD_NAMES)
        turn = await start_turn(self.state, request, chat, ENDPOINT, message_id, FIELD_NAMES)
        stop = tuple(body.stop_sequences or ())
        if body.stream:
            return StreamingResponse(self._stream(turn, message_id, stop), media_type="text/event-stream")
        reply = await turn.reply()
        matched = matched_stop(self.state.engine.tokenizer, reply.token_ids, stop) if reply.finish_reason == "stop" \
            else None
        content: list[dict[str, Any]] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.content:
            content.append({"type": "text", "text": reply.content})
        content.extend({"type": "tool_use", "id": call.call_id, "name": call.name, "input": call.input()}
                       for call in reply.calls)
        return JSONResponse({**_message_head(self.state, message_id), "content": content,
                             "stop_reason": stop_reason(reply.finish_reason, matched), "stop_sequence": matched,
                             "usage": usage_body(reply.usage)})

    async def _stream(self, turn: Turn, message_id: str, stop: tuple[str, ...]) -> AsyncIterator[str]:
        first = Usage.of(turn.first)
        yield _event("message_start", {"message": {**_message_head(self.state, message_id), "content": [],
                                                   "stop_reason": None, "stop_sequence": None,
                                                   "usage": usage_body(first, output_tokens=0)}})
        yield _event("ping", {})
        blocks = MessageEvents()
        reply = turn.events()
        try:
            async for event in reply:
                if isinstance(event, TextDelta):
                    sent = blocks.text(event.text, "text")
                elif isinstance(event, ReasoningDelta):
                    sent = blocks.text(event.text, "thinking")
                elif isinstance(event, CallStart):
                    sent = blocks.call_start(event)
                elif isinstance(event, CallArguments):
                    sent = blocks.call_arguments(event)
                else:
                    sent = blocks.close() + self._end(event, stop)
                for line in sent:
                    yield line
        except Exception as exc:  # ApiError from the engine, or a failure: an error event ends the stream
            yield _error_event(message_id, exc)
        finally:
            await reply.aclose()

    def _end(self, finished: Finished, stop: tuple[str, ...]) -> list[str]:
        matched = matched_stop(self.state.engine.tokenizer, finished.token_ids, stop) \
            if finished.finish_reason == "stop" else None
        delta = {"stop_reason": stop_reason(finished.finish_reason, matched), "stop_sequence": matched}
        return [_event("message_delta", {"delta": delta, "usage": usage_body(finished.usage)}),
                _event("message_stop", {})]

    async def count_tokens(self, body: CountTokensRequest) -> JSONResponse:
        fields = await self.state.workers.run(lambda: {
            "messages": chat_messages(body), "model": body.model, **_tool_fields(body)})
        chat = await self.state.workers.run(chat_body, self.state, fields, FIELD_NAMES)
        return JSONResponse({"input_tokens": await count_prompt_tokens(self.state, chat, FIELD_NAMES)})


# ----- errors in Anthropic's shape ---------------------------------------------------------------------


def anthropic_error(status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's error body for an OpenAI error body answered with `status`."""
    error = openai_body.get("error") if isinstance(openai_body, dict) else None
    error = error if isinstance(error, dict) else {}
    kind = ERROR_TYPES.get(status, "api_error")
    return AnthropicError(error={"type": kind, "message": str(error.get("message") or ERROR_STATUSES.get(status, "")),
                                 "param": error.get("param"), "code": error.get("code")}).model_dump()


class AnthropicErrorMiddleware:
    """ASGI middleware: on the Messages routes, rewrite every JSON error answer (4xx/5xx, from any layer
    inside it) into Anthropic's error body. Other routes and successful answers pass untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        start: Optional[Message] = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and is_json:
                    start = message
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            try:
                original = json.loads(b"".join(chunks))
            except ValueError:
                original = {}
            body = json.dumps(anthropic_error(start["status"], original)).encode()
            headers = [(k, v) for k, v in start.get("headers") or [] if k != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses` of a Messages route that may answer `statuses`, each with Anthropic's error body."""
    return {status: {"model": AnthropicError, "description": ERROR_STATUSES[status]} for status in statuses}


def install_anthropic_routes(app: FastAPI, state: ServerState) -> tuple[type, ...]:
    """Add the Messages routes and their error middleware to `app` (an app of api.create_app serving
    `state`, whose other middleware is already installed); returns the body models for the OpenAPI
    document."""
    api = MessagesApi(state)
    errors = {200: INFERENCE_ERRORS[200], **error_responses(400, 401, 404, 413, 500, 503)}

    @app.post(PATH_PREFIX, openapi_extra=json_request_body(MessagesRequest), responses=errors)
    async def create_message(request: Request) -> Response:
        return await api.create(request, await state.parse(request, MessagesRequest))

    @app.post(PATH_PREFIX + "/count_tokens", openapi_extra=json_request_body(CountTokensRequest),
              responses=error_responses(400, 401, 404, 413, 500))
    async def count_tokens(request: Request) -> Response:
        return await api.count_tokens(await state.parse(request, CountTokensRequest))

    app.add_middleware(AnthropicErrorMiddleware)
    return MessagesRequest, CountTokensRequest
