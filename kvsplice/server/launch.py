"""Run the API under uvicorn: in the foreground (`kvsplice serve`) or in a background thread (tests,
benchmarks), in one process with the engine."""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn

from kvsplice.config import EngineConfig
from kvsplice.server.api import ServerSettings, create_app
from kvsplice.server.request_log import RequestLog, start_record


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_app(engine_config: EngineConfig, settings: ServerSettings, log: Optional[RequestLog] = None):
    """Load the model, write the `kvsplice.start` line to `log`, and return the app. Raises what
    `build_engine` raises (ValueError / OSError for a model it cannot load)."""
    from kvsplice.engine.llm import build_engine  # imports torch and the model code

    engine = build_engine(engine_config)
    log = log or RequestLog()
    log.start(start_record(engine.name, settings.model_path, engine_config, engine.max_model_len,
                           settings.replica_name, settings.host, settings.port))
    return create_app(engine, settings, log)


def serve(engine_config: EngineConfig, settings: ServerSettings, log_level: str = "warning") -> None:
    """Load the model and serve on settings.host:settings.port until interrupted (blocks)."""
    app = build_app(engine_config, settings)
    uvicorn.run(app, host=settings.host or "127.0.0.1", port=settings.port or 8000, log_level=log_level,
                timeout_graceful_shutdown=5)


class ServerThread:
    """uvicorn serving `app` in a daemon thread of this process.

        server = ServerThread(app, port=free_port()); server.start()   # returns once it accepts requests
        ... server.url ...
        server.stop()
    """

    def __init__(self, app, host: str = "127.0.0.1", port: Optional[int] = None, log_level: str = "warning"):
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvsplice-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8123 (add /v1 for OpenAI clients)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Start serving; RuntimeError if uvicorn is not up within `timeout_s` or its thread died."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit (runs the app's shutdown: the engine thread stops) and join the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
