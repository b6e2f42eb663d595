"""The server's machine-readable log lines (parsed by `kvsplice report`, see kvsplice/bench/report.py).

    kvsplice.start {"model": ..., "engine": {...}, "reuse": {every ReuseConfig field}, ...}   once
    kvsplice.request {"rid": ..., "prompt_tokens": ..., <usage.reuse flattened>, ...}         per request
    kvsplice.rejected {"status": 400, "route": ..., "param": ..., "message": ..., "rid": ...} per 4xx answer

A request line carries ids and counts only, never prompt or completion text; the session id is replaced
by a short hash so logs can be shared without the client's conversation names. A rejected line carries
the error the client got (its message cut at MAX_REJECTED_MESSAGE characters), never the request body.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import threading
from typing import Any, Optional, TextIO

START_PREFIX = "kvsplice.start "
REQUEST_PREFIX = "kvsplice.request "
REJECTED_PREFIX = "kvsplice.rejected "
MAX_REJECTED_MESSAGE = 500


def session_hash(session_id: Optional[str]) -> Optional[str]:
    """A stable 12-hex-digit hash of `session_id` (sha256), or None when there is none."""
    if session_id is None:
        return None
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()[:12]


def flatten_reuse(reuse: dict[str, Any]) -> dict[str, Any]:
    """`reuse` with nested objects (e.g. `prefilled_breakdown`) lifted to top-level keys.
    The nested objects themselves are dropped; a top-level key already present wins."""
    flat: dict[str, Any] = {}
    for key, value in reuse.items():
        if isinstance(value, dict):
            for inner_key, inner_value in value.items():
                flat.setdefault(inner_key, inner_value)
        else:
            flat[key] = value
    return flat


def start_record(model_name: str, model_path: Optional[str], engine_config, max_model_len: int,
                 replica: Optional[str], host: Optional[str] = None, port: Optional[int] = None) -> dict[str, Any]:
    """The start line's object: served model name and path, every engine setting, every reuse setting
    (`reuse`, all ReuseConfig fields), the context limit, replica name and address."""
    engine = {f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config) if f.name != "reuse"}
    return {
        "model": model_name,
        "model_path": model_path,
        "max_model_len": max_model_len,
        "engine": engine,
        "reuse": dataclasses.asdict(engine_config.reuse),
        "scr": "on" if engine_config.reuse.enabled else "off",
        "replica": replica,
        "host": host,
        "port": port,
    }


def request_record(rid: str, prompt_tokens: int, completion_tokens: int, reuse: Optional[dict[str, Any]],
                   ttft_s: Optional[float], e2e_s: float, finish_reason: Optional[str],
                   session_id: Optional[str], replica: Optional[str], endpoint: str) -> dict[str, Any]:
    """One request line's object: ids, token counts, usage.reuse flattened, timings, finish reason,
    hashed session id, replica. No text."""
    record: dict[str, Any] = {"rid": rid, "endpoint": endpoint, "prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens}
    record.update(flatten_reuse(reuse or {}))
    record.update({"ttft_s": None if ttft_s is None else round(ttft_s, 6), "e2e_s": round(e2e_s, 6),
                   "finish_reason": finish_reason, "session_id": session_hash(session_id), "replica": replica})
    return record


def rejected_record(status: int, route: str, param: Optional[str], message: str,
                    rid: Optional[str]) -> dict[str, Any]:
    """One rejected line's object: the status, the route, the error's param and message (cut), the request
    id (None when the request was refused before it got one)."""
    if len(message) > MAX_REJECTED_MESSAGE:
        message = message[:MAX_REJECTED_MESSAGE] + "..."
    return {"status": status, "route": route, "param": param, "message": message, "rid": rid}


class RequestLog:
    """Writes the log lines to `stream` (default: stdout), one `write` + flush per line, thread-safe."""

    def __init__(self, stream: Optional[TextIO] = None):
        self._stream = stream
        self._lock = threading.Lock()

    def _write(self, prefix: str, record: dict[str, Any]) -> None:
        line = prefix + json.dumps(record, separators=(",", ":"), default=str) + "\n"
        stream = self._stream or sys.stdout
        with self._lock:
            stream.write(line)
            stream.flush()

    def start(self, record: dict[str, Any]) -> None:
        """Write the `kvsplice.start` line."""
        self._write(START_PREFIX, record)

    def request(self, record: dict[str, Any]) -> None:
        """Write one `kvsplice.request` line."""
        self._write(REQUEST_PREFIX, record)

    def rejected(self, record: dict[str, Any]) -> None:
        """Write one `kvsplice.rejected` line."""
        self._write(REJECTED_PREFIX, record)
