"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, served as chat turns
(chat_turn.py), so tools, grammar-forced calls, `text.format` schemas, limits, tenancy and Suffix Cache
Reuse work exactly as on /v1/chat/completions.

    ResponseRequest ─> chat messages: [instructions as system] + stored history (previous_response_id)
                       + input items (messages, function_call, function_call_output, reasoning)
        ─> chat turn ─> output items: reasoning, message (output_text), function_call ...
        ─> the Response object, or its event stream; stored (store: true, the default) for chaining

A chain of responses (each naming the one before in `previous_response_id`) is one SCR session, named
after the chain's first response: from the third turn on, every turn attaches to the conversation's K/V
by that name, without content matching (the second finds the first turn's session by content, as the
first turn, not yet known to start a chain, leaves it unnamed; the second names it). A body's own
`session_id` wins.

Streamed: response.created, response.in_progress, then per output item response.output_item.added,
its content (response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done; or response.function_call_arguments.delta ..., .done; or
response.reasoning_text.delta ..., .done), response.output_item.done; finally response.completed
(response.incomplete when max_output_tokens cut the reply; response.failed when it failed).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvsplice.server.openapi import INFERENCE_ERRORS
from kvsplice.server.state import ServerState
from kvsplice.server.auth import request_owner
from kvsplice.server.chat_turn import (CallArguments, CallStart, Finished, ReasoningDelta, Reply, TextDelta, Turn,
                                       Usage, chat_body, start_turn)
from kvsplice.server.errors import ApiError, internal_error
from kvsplice.server.openapi import error_responses, json_request_body
from kvsplice.server.response_store import ResponseStore, StoredResponse
from kvsplice.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem,
                                                ResponseRequest)

# chat fields whose errors name another field here
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
SESSION_PREFIX = "response:"
ENDPOINT = "responses"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ----- input items -> chat messages --------------------------------------------------------------------


def input_messages(items) -> list[dict[str, Any]]:
    """Chat messages of `input` (a string: one user message). Consecutive assistant items (reasoning,
    a message, function calls) make one assistant message; each function_call_output a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    turn: Optional[dict[str, Any]] = None   # the assistant message later assistant items join

    def assistant() -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": None}
        out.append(message)
        return message

    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            if turn is None or turn["content"] is not None or turn.get("tool_calls"):
                turn = assistant()
            turn["content"] = item.text()
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
            turn = None
        elif isinstance(item, FunctionCallItem):
            turn = turn or assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            turn = None
        elif isinstance(item, ReasoningItem):
            if turn is None or turn["content"] is not None or turn.get("tool_calls"):
                turn = assistant()
            turn["reasoning_content"] = item.text()
    return out


def _tool_choice(choice) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def chat_fields(body: ResponseRequest, history: tuple[dict[str, Any], ...], session_id: Optional[str]) -> dict:
    """The chat-completions body of this request."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + list(history)
    fields: dict[str, Any] = {
        "messages": messages, "model": body.model, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": _tool_choice(body.tool_choice), "cache_salt": body.cache_salt, "session_id": session_id,
        "scr": body.scr, "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if body.text is not None and body.text.format is not None:
        try:
            fields["response_format"] = body.text.format.response_format()
        except ValueError as error:
            raise ApiError(400, str(error), param="text.format") from error
    return {name: value for name, value in fields.items() if value is not None}


# ----- the Response object -----------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, Any]:
    """The Response's `usage`: OpenAI's fields, SGLang's `prompt_tokens` / `completion_tokens` beside
    them (its Responses usage has both names, and its clients read these), and kvsplice's `reuse`."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens, "reuse": usage.reuse}


def reasoning_item(text: str, item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, status: str, item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reply_items(reply: Reply) -> list[dict[str, Any]]:
    """The output items of a whole reply: its reasoning, its text, its calls (in that order)."""
    status = "incomplete" if reply.finish_reason == "length" else "completed"
    items = [reasoning_item(reply.reasoning)] if reply.reasoning else []
    if reply.content:
        items.append(message_item(reply.content, status))
    items.extend(call_item(call.call_id, call.name, call.arguments) for call in reply.calls)
    return items


class ResponseHead:
    """What every Response object of one request repeats: its id, creation time and request settings."""

    def __init__(self, state: ServerState, body: ResponseRequest, response_id: str):
        self.response_id, self.created = response_id, int(time.time())
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
        defaults = state.engine.tokenizer.sampling_defaults   # generation_config.json's, for fields left unset
        self.fields = {
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": state.model_name,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
            "top_p": defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
            "tool_choice": (body.tool_choice.model_dump() if body.tool_choice is not None
                            and not isinstance(body.tool_choice, str) else body.tool_choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "text": {"format": fmt or {"type": "text"}}, "store": body.store is not False,
            "metadata": body.metadata or {}, "truncation": "disabled", "background": False,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "user": body.user,
        }

    def body(self, status: str, output: list[dict[str, Any]], usage: Optional[Usage] = None,
             error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """The Response object in `status` ("in_progress", "completed", "incomplete", "failed")."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": incomplete, "output": output, **self.fields,
                "usage": usage_body(usage) if usage is not None else None}


def _status(finish_reason: Optional[str]) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


# ----- streaming ---------------------------------------------------------------------------------------


class ResponseEvents:
    """The Responses event stream of one reply: turns chat_turn events into SSE events (numbered by
    `sequence_number`) and collects the output items they describe."""

    def __init__(self, head: ResponseHead):
        self.head = head
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None   # the item whose content is streaming
        self.calls: dict[int, dict[str, Any]] = {}   # reply call index -> its item

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        response = self.head.body("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def text(self, delta: str, kind: str) -> list[str]:
        """Events for text (`kind` "message" or "reasoning"), opening an item of that kind if needed."""
        sent: list[str] = []
        if self.open is None or self.open["type"] != kind:
            sent += self.close()
            item = message_item("", "in_progress") if kind == "message" else {**reasoning_item(""), "status": None}
            sent += self._add(item)
            sent.append(self.event("response.content_part.added", **self._where(item), content_index=0,
                                   part=dict(item["content"][0])))
        item = self.open
        item["content"][0]["text"] += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        sent.append(self.event(name, **self._where(item), content_index=0, delta=delta, **extra))
        return sent

    def call_start(self, start: CallStart) -> list[str]:
        sent = self.close()
        item = call_item(start.call_id, start.name, "", status="in_progress")
        self.calls[start.index] = item
        sent += self._add(item)
        if start.arguments:
            sent += self.call_arguments(CallArguments(start.index, start.arguments))
        return sent

    def call_arguments(self, delta: CallArguments) -> list[str]:
        item = self.calls[delta.index]
        item["arguments"] += delta.text
        return [self.event("response.function_call_arguments.delta", **self._where(item), delta=delta.text)]

    def close(self, status: str = "completed") -> list[str]:
        """The done events of the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item)
        sent = []
        if item["type"] == "function_call":
            sent.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                sent.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                       logprobs=[]))
            else:
                sent.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            sent.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item["status"] = status
        sent.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return sent

    def finish(self, finished: Finished) -> tuple[list[str], dict[str, Any]]:
        """The closing events and the final Response object."""
        status = _status(finished.finish_reason)
        sent = self.close("incomplete" if status == "incomplete" and self.open is not None
                          and self.open["type"] == "message" else "completed")
        for item in self.calls.values():
            item["status"] = "completed"
        body = self.head.body(status, self.items, finished.usage)
        sent.append(self.event("response.completed" if status == "completed" else "response.incomplete",
                               response=body))
        return sent, body

    def failed(self, exc: Exception) -> str:
        error = exc if isinstance(exc, ApiError) else internal_error(self.head.response_id, exc)
        body = self.head.body("failed", self.items, error={"code": error.code or "server_error",
                                                           "message": error.message})
        return self.event("response.failed", response=body)


# ----- handlers ----------------------------------------------------------------------------------------


class ResponsesApi:
    """The Responses routes' handlers over one server's state and its response store."""

    def __init__(self, state: ServerState, store: ResponseStore):
        self.state, self.store = state, store

    def _previous(self, request: Request, response_id: Optional[str]) -> Optional[StoredResponse]:
        if response_id is None:
            return None
        stored = self.store.get(request_owner(request), response_id)
        if stored is None:
            raise _not_found(response_id, "previous_response_id")
        return stored

    async def create(self, request: Request, body: ResponseRequest) -> Response:
        response_id = _new_id("resp")
        previous = self._previous(request, body.previous_response_id)
        root_id = previous.root_id if previous else response_id
        history = (previous.history if previous else ()) + tuple(input_messages(body.input))
        keep = body.store is not False
        # Only a chained request names the session: a first turn stays anonymous, so that a client
        # sending its whole conversation again (no previous_response_id) still finds it by content.
        session_id = body.session_id or (SESSION_PREFIX + root_id if previous else None)
        fields = chat_fields(body, history, session_id)
        chat = await self.state.workers.run(chat_body, self.state, fields, FIELD_NAMES)
        turn = await start_turn(self.state, request, chat, ENDPOINT, response_id, FIELD_NAMES, body.max_tool_calls)
        head = ResponseHead(self.state, body, response_id)

        def keep_response(answer: dict[str, Any], message: dict[str, Any]) -> None:
            if keep:
                self.store.put(request_owner(request),
                               StoredResponse(response_id, root_id, history + (message,), answer))

        if body.stream:
            return StreamingResponse(self._stream(turn, head, keep_response), media_type="text/event-stream")
        reply = await turn.reply()
        answer = head.body(_status(reply.finish_reason), reply_items(reply), reply.usage)
        keep_response(answer, reply.message())
        return JSONResponse(answer)

    async def _stream(self, turn: Turn, head: ResponseHead, keep_response) -> AsyncIterator[str]:
        events = ResponseEvents(head)
        for line in events.start():
            yield line
        reply = turn.events()
        try:
            async for event in reply:
                if isinstance(event, TextDelta):
                    sent = events.text(event.text, "message")
                elif isinstance(event, ReasoningDelta):
                    sent = events.text(event.text, "reasoning")
                elif isinstance(event, CallStart):
                    sent = events.call_start(event)
                elif isinstance(event, CallArguments):
                    sent = events.call_arguments(event)
                else:
                    sent, answer = events.finish(event)
                    keep_response(answer, _message_of(events.items))
                for line in sent:
                    yield line
        except Exception as exc:  # ApiError from the engine, or a failure: response.failed ends the stream
            yield events.failed(exc)
        finally:
            await reply.aclose()

    def get(self, request: Request, response_id: str) -> JSONResponse:
        stored = self.store.get(request_owner(request), response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.body)

    def delete(self, request: Request, response_id: str) -> JSONResponse:
        if not self.store.delete(request_owner(request), response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _message_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat assistant message the streamed output items make (the stored history's last turn)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if item["type"] == "message":
            message["content"] = (message["content"] or "") + item["content"][0]["text"]
        elif item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return message


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"{param}: no stored response {response_id!r} (never stored, deleted, evicted, or made "
                         f"with another API key)", param=param, code="response_not_found",
                    error_type="invalid_request_error")


def install_responses_routes(app: FastAPI, state: ServerState, store: Optional[ResponseStore] = None) -> tuple[type, ...]:
    """Add the Responses routes to `app` (an app of api.create_app, serving `state`); returns the body
    models for the OpenAPI document."""
    api = ResponsesApi(state, store or ResponseStore())
    lookup_errors = error_responses(401, 404, 500)

    @app.post("/v1/responses", openapi_extra=json_request_body(ResponseRequest), responses=INFERENCE_ERRORS)
    async def create_response(request: Request) -> Response:
        return await api.create(request, await state.parse(request, ResponseRequest))

    @app.get("/v1/responses/{response_id}", responses=lookup_errors)
    async def get_response(request: Request, response_id: str) -> Response:
        return api.get(request, response_id)

    @app.delete("/v1/responses/{response_id}", responses=lookup_errors)
    async def delete_response(request: Request, response_id: str) -> Response:
        return api.delete(request, response_id)

    return (ResponseRequest,)
