"""Replay a trace against any OpenAI-compatible server and record what each request cost.

Conversations run in parallel, at most `concurrency` at a time; the turns of one conversation run in
order. Every request streams with `stream_options.include_usage`, so the last chunk carries `usage`
(with kvsplice's `reuse` breakdown when the server is kvsplice). A failing request (HTTP error, broken
connection, timeout, error event in the stream) is recorded with its error and the run goes on.

The output is JSONL: a header line `{"type": "header", ...run settings...}` then one
`{"type": "request", ...RequestRecord fields...}` line per request, written as each request finishes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

import httpx
from tqdm import tqdm

from kvsplice.bench.trace import Conversation, Turn

RUN_FORMAT_VERSION = 1
ERROR_BODY_CHARS = 500


@dataclass(frozen=True)
class RequestRecord:
    """What one replayed request measured.

    usage: the server's final `usage` dict as sent (None if the stream carried none).
    ttft_s: seconds from sending to the first chunk with content (or reasoning_content) text, None if none
        came; for a server that answers with one JSON body instead of a stream, when that body arrived.
    total_s: seconds from sending to the end of the stream or the error.
    error: None on success, else "HTTP <status>: <body>" or "<ExceptionType>: <message>".
    """

    conversation_id: str
    turn: int
    edit: str
    usage: Optional[dict[str, Any]]
    ttft_s: Optional[float]
    total_s: float
    output_text: str
    finish_reason: Optional[str]
    error: Optional[str]


def api_base(url: str) -> str:
    """The `/v1` base URL for a server URL given with or without the `/v1` suffix."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def request_body(conversation: Conversation, turn: Turn, model: Optional[str], scr: Optional[str | dict],
                 send_session_id: bool) -> dict[str, Any]:
    """The chat-completions request for one turn: greedy, streamed, with usage in the last chunk.

    kvsplice's extra fields are sent only when set: `cache_salt` (from the trace), `scr`, `session_id`
    (the conversation id, when `send_session_id`); other servers may reject unknown fields.
    """
    body: dict[str, Any] = {
        "messages": list(turn.messages),
        "max_tokens": turn.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if conversation.cache_salt is not None:
        body["cache_salt"] = conversation.cache_salt
    if scr is not None:
        body["scr"] = scr
    if send_session_id:
        body["session_id"] = conversation.id
    return body


@dataclass
class _StreamState:
    """Accumulates one streamed response (mutable: filled chunk by chunk)."""

    started: float
    first_content_at: Optional[float] = None
    text: str = ""
    usage: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    def take(self, chunk: dict[str, Any]) -> None:
        """Fold one decoded `data:` chunk into the state."""
        if "error" in chunk:
            self.error = f"stream error: {json.dumps(chunk['error'])[:ERROR_BODY_CHARS]}"
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            # A non-streamed response (a server that ignored stream=true) carries `message`, not `delta`.
            delta = choice.get("delta") or choice.get("message") or {}
            content = delta.get("content")
            if (content or delta.get("reasoning_content")) and self.first_content_at is None:
                self.first_content_at = time.perf_counter()
            if content:
                self.text += content
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]


async def _stream_request(client: httpx.AsyncClient, base: str, body: dict[str, Any], state: _StreamState) -> None:
    async with client.stream("POST", f"{base}/chat/completions", json=body) as response:
        if response.status_code >= 400:
            raw = await response.aread()
            state.error = f"HTTP {response.status_code}: {raw.decode('utf-8', 'replace')[:ERROR_BODY_CHARS]}"
            return
        if response.headers.get("content-type", "").startswith("application/json"):
            try:
                state.take(json.loads(await response.aread()))
            except json.JSONDecodeError:
                state.error = "bad JSON response body"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            try:
                state.take(json.loads(data))
            except json.JSONDecodeError:
                state.error = f"bad stream chunk: {data[:ERROR_BODY_CHARS]}"
            if state.error is not None:
                return


async def _run_turn(client: httpx.AsyncClient, base: str, conversation: Conversation, turn_offset: int,
                    model: Optional[str], scr: Optional[str | dict], send_session_id: bool) -> RequestRecord:
    turn = conversation.turns[turn_offset]
    state = _StreamState(started=time.perf_counter())
    try:
        await _stream_request(client, base, request_body(conversation, turn, model, scr, send_session_id), state)
    except (httpx.HTTPError, OSError) as error:
        state.error = f"{type(error).__name__}: {error}"
    ended = time.perf_counter()
    return RequestRecord(
        conversation_id=conversation.id, turn=turn_offset, edit=turn.edit, usage=state.usage,
        ttft_s=None if state.first_content_at is None else state.first_content_at - state.started,
        total_s=ended - state.started, output_text=state.text, finish_reason=state.finish_reason,
        error=state.error,
    )


async def discover_model(client: httpx.AsyncClient, base: str) -> Optional[str]:
    """The first model id listed by GET /v1/models, or None if the server does not answer it."""
    try:
        response = await client.get(f"{base}/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        return str(models[0]["id"]) if models else None
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError):
        return None


def _write_line(out_file: Optional[TextIO], obj: dict[str, Any]) -> None:
    if out_file is not None:
        out_file.write(json.dumps(obj, ensure_ascii=False) + "\n")
        out_file.flush()


async def replay_async(url: str, conversations: list[Conversation], *, concurrency: int, model: Optional[str] = None,
                       out_path: Optional[str | Path] = None, progress: bool = True,
                       scr: Optional[str | dict] = None, timeout_s: float = 600.0,
                       send_session_id: bool = False) -> list[RequestRecord]:
    """Async form of `replay` (same contract); use it when an event loop is already running."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    base = api_base(url)
    records: list[RequestRecord] = []
    slots = asyncio.Semaphore(concurrency)
    n_requests = sum(len(conversation.turns) for conversation in conversations)
    out_file = open(out_path, "w", encoding="utf-8") if out_path is not None else None
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                                     limits=httpx.Limits(max_connections=concurrency + 1)) as client:
            served_model = model if model is not None else await discover_model(client, base)
            _write_line(out_file, {
                "type": "header", "format": RUN_FORMAT_VERSION, "url": url, "model": served_model,
                "model_requested": model, "concurrency": concurrency, "scr": scr, "timeout_s": timeout_s,
                "send_session_id": send_session_id, "n_conversations": len(conversations),
                "n_requests": n_requests, "started_at": time.time(),
            })
            with tqdm(total=n_requests, disable=not progress, unit="req", desc="replay") as bar:

                async def run_conversation(conversation: Conversation) -> None:
                    async with slots:
                        for turn_offset in range(len(conversation.turns)):
                            record = await _run_turn(client, base, conversation, turn_offset, served_model, scr,
                                                     send_session_id)
                            records.append(record)
                            _write_line(out_file, {"type": "request", **asdict(record)})
                            bar.update(1)

                await asyncio.gather(*(run_conversation(conversation) for conversation in conversations))
    finally:
        if out_file is not None:
            out_file.close()
    order = {conversation.id: offset for offset, conversation in enumerate(conversations)}
    return sorted(records, key=lambda record: (order[record.conversation_id], record.turn))


def replay(url: str, conversations: list[Conversation], *, concurrency: int, model: Optional[str] = None,
           out_path: Optional[str | Path] = None, progress: bool = True, scr: Optional[str | dict] = None,
           timeout_s: float = 600.0, send_session_id: bool = False) -> list[RequestRecord]:
    """Replay `conversations` against the OpenAI-compatible server at `url`; return one record per request.

    Runs up to `concurrency` conversations at once, each conversation's turns in order. `model=None` asks
    GET /v1/models for the first model (and omits `model` if that fails). `scr` is sent as the request's
    `scr` field when not None ("off" or an object). Per-request failures are recorded, never raised.
    When `out_path` is given, writes a header line and each record as it finishes (the file is complete
    even if some requests failed). Records come back sorted by (conversation order, turn).
    Must not be called from a running event loop (use `replay_async`).
    """
    return asyncio.run(replay_async(url, conversations, concurrency=concurrency, model=model, out_path=out_path,
                                    progress=progress, scr=scr, timeout_s=timeout_s,
                                    send_session_id=send_session_id))
