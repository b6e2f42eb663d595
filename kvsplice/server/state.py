"""What every route shares: the server's settings and its state (the engine, its async driver, the
served names, metrics, the request log, the worker pool), one per app at `app.state.kvsplice`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel

from kvsplice.engine.async_engine import AsyncEngine
from kvsplice.engine.compute_thread import ComputeThread
from kvsplice.server.auth import ApiKeys
from kvsplice.server.body import parse_request
from kvsplice.server.chat import ChatRenderer
from kvsplice.server.errors import ApiError
from kvsplice.server.limits import RequestLimits
from kvsplice.server.metrics import ServerMetrics
from kvsplice.server.model_names import served_names
from kvsplice.server.request_log import RequestLog
from kvsplice.server.snapshots import SnapshotCache
from kvsplice.server.tool_parsers import get_parser
from kvsplice.server.workers import WorkerPool


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
        # characters of the longest token's text, at least what it decodes to (a byte-fallback token's
        # "<0x0A>" is 6 for 1): bounds the characters a reply of n tokens can have (sampling.reply_chars)
        self.longest_token_chars = max(map(len, self.vocab), default=0) if self.vocab else None
        self.special_tokens = frozenset(token.content for token in getattr(backend, "added_tokens_decoder", {}).values()
                                        if token.special)
        self.limits = settings.limits.resolve(self.context_limit)
        self.workers = WorkerPool(settings.prep_threads)
        self.snapshots = SnapshotCache(self.async_engine)

    async def parse(self, request: Request, model: type[BaseModel]):
        """The request's JSON body as `model`, within `limits` (body.py); ApiError otherwise."""
        return await parse_request(request, model, self.limits, self.workers)

    def check_model(self, model: Optional[str]) -> None:
        """404 naming the served names unless `model` (a request's `model` field; None: not given) is one
        of them."""
        if model is not None and not self.names.accepts(model):
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.names.reported))}",
                           param="model", code="model_not_found", error_type="NotFoundError")

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
