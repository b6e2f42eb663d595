"""Fixtures for the server tests: one tiny model directory and one real uvicorn server per session."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.tiny_model import make_tiny_model_dir


class LineSink:
    """A text stream that keeps every written line (thread-safe), standing in for stdout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text = ""

    def write(self, text: str) -> int:
        with self._lock:
            self._text += text
        return len(text)

    def flush(self) -> None:
        pass

    def lines(self) -> list[str]:
        with self._lock:
            return self._text.splitlines()


class RunningServer:
    """A started ServerThread plus what the tests need to look at."""

    def __init__(self, thread, app, sink: LineSink, model_dir: Path):
        self.thread, self.app, self.sink, self.model_dir = thread, app, sink, model_dir
        self.url = thread.url
        self.state = app.state.kvsplice

    def metric(self, name: str) -> float:
        """The value of the one series of `name` from GET /metrics (whatever its labels, e.g. model_name)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                  if sample.name == name]
        if len(values) != 1:
            raise KeyError(f"{name}: {len(values)} series")
        return values[0]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random llama HF directory with a ChatML template (built once per session)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


def start_server(model_dir: Path, settings_kwargs: dict | None = None, **engine_kwargs) -> RunningServer:
    """Build an engine on `model_dir` and serve it from a background thread on a free port.
    `settings_kwargs`: ServerSettings fields (api_keys, limits, ...)."""
    from kvsplice.config import EngineConfig
    from kvsplice.server.api import ServerSettings
    from kvsplice.server.launch import ServerThread, build_app
    from kvsplice.server.request_log import RequestLog

    sink = LineSink()
    config = EngineConfig(model=str(model_dir), **engine_kwargs)
    settings = ServerSettings(model_path=str(model_dir), replica_name="r0", **(settings_kwargs or {}))
    app = build_app(config, settings, RequestLog(sink))
    thread = ServerThread(app)
    thread.start()
    response = httpx.get(f"{thread.url}/health", timeout=10)
    assert response.status_code == 200
    return RunningServer(thread, app, sink, model_dir)


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The shared server: tiny model, 2048-slot pool."""
    running = start_server(tiny_model_dir, num_slots=2048, max_batch_tokens=512)
    yield running
    running.thread.stop()


@pytest.fixture(scope="session")
def client(server):
    """A real `openai` client pointed at the shared server."""
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def engine_call(server: RunningServer, fn):
    """`fn()` run on the server's engine thread between steps (AsyncEngine.call), from a test thread."""
    return asyncio.run(server.state.async_engine.call(fn))


def assert_idle_without_leak(server: RunningServer, timeout_s: float = 20.0) -> None:
    """Wait until no request runs or waits, then check the pool's conservation and that no slot is held
    beyond idle SCR sessions' private K/V (those belong to conversations, not to requests)."""
    engine = server.state.engine
    deadline = time.monotonic() + timeout_s
    while engine_call(server, lambda: engine.num_running() + engine.num_waiting()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_call(server, lambda: engine.num_running() + engine.num_waiting()) == 0
    engine_call(server, engine.check_integrity)
    assert engine_call(server, lambda: engine.slots_in_use() - engine.reuse.private_slots()) == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
