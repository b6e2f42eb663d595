"""Run the API under uvicorn: in the foreground (`kvsplice serve`) or in a background thread (tests,
benchmarks), in one process with the engine.

If the engine thread stops (see kvsplice.engine.async_engine), `/health` fails at once and `serve`
shuts uvicorn down and returns ENGINE_FAILED_EXIT (the process exits non-zero, so that systemd,
Kubernetes or a router restarts it); should the shutdown hang, the process is ended after
EXIT_DEADLINE_S. A ServerThread (tests) keeps its process: it only calls the hook it is given.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Optional, TextIO

import uvicorn

from kvsplice.config import EngineConfig
from kvsplice.engine.compute_thread import ComputeThread
from kvsplice.engine.failpoints import Failpoints
from kvsplice.server.api import ServerSettings, create_app
from kvsplice.server.request_log import RequestLog, start_record

logger = logging.getLogger(__name__)

ENGINE_FAILED_EXIT = 1
EXIT_DEADLINE_S = 15.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_app(engine_config: EngineConfig, settings: ServerSettings, log: Optional[RequestLog] = None,
              failpoints: Optional[Failpoints] = None, warm: bool = False, decode_builder=None):
    """Load the model, warm it up (`warm`, kvsplice.engine.warmup), write the `kvsplice.start` line
    to `log`, and return the app. Raises what `build_engine` raises (ValueError / OSError for a
    model it cannot load). `failpoints`: a test seam handed to the Engine; `decode_builder`: what
    builds the compiled decode step (default inductor). The model is loaded on the ComputeThread
    that will step it (see kvsplice.engine.compute_thread: loaded on this thread instead, a decode
    step was measured slower). The compiled decode step, where it is on, is not waited for: it
    builds in the background and the engine switches to it between two steps once it is built
    (kvsplice.models.compiled_decode); the start-up heap is frozen again then."""
    from kvsplice.engine.llm import build_engine  # imports torch and the model code
    from kvsplice.engine.warmup import warm_up

    def build():
        started = time.perf_counter()
        engine = build_engine(engine_config, failpoints=failpoints, decode_builder=decode_builder,
                              wait_for_compile=False)
        logger.info("engine built in %.1f s", time.perf_counter() - started)
        if warm:
            warm_up(engine)
        return engine

    compute = ComputeThread()
    try:
        engine = compute.run(build)
    except BaseException:
        compute.close()
        raise
    compiled = engine.runner.fast.compiled if engine.runner.fast is not None else None
    if compiled is not None:   # its traced graphs add objects the first freeze did not see
        compiled.future.add_done_callback(lambda _: freeze_startup_heap())
        compiled.start()
    log = log or RequestLog()
    app = create_app(engine, settings, log, compute)
    log.start(start_record(app.state.kvsplice.model_name, settings.model_path, engine_config, engine.max_model_len,
                           settings.replica_name, settings.host, settings.port))
    return app


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now into the permanent generation (`gc.freeze`), so
    that later collections of the oldest generation no longer walk it. Returns how many objects
    were frozen. Side effect: process-wide; objects frozen here are never collected (they are
    the model, the compiled graphs and the app, alive until the process ends).

    Why: CPython's collector holds the GIL while it runs, and the engine thread needs the GIL
    between the ops of every step. A served process holds hundreds of thousands of tracked
    objects after start-up, more with `--compile-decode` (sympy expressions of the traced graphs'
    symbolic shapes), so each oldest-generation collection was measured stalling every stream
    (docs/BENCHMARKS_HISTORY.md, "Against llama.cpp's llama-server on the same GGUF"). vLLM
    freezes its start-up heap for the same reason."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def is_loopback(host: str) -> bool:
    """True when `host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(settings: ServerSettings) -> Optional[str]:
    """The start-up warning for a server listening beyond loopback without an API key, or None."""
    host = settings.host or "127.0.0.1"
    if is_loopback(host) or settings.api_keys.enabled:
        return None
    return (f"kvsplice serve: warning: listening on {host}:{settings.port} without an API key: anyone who can "
            f"reach this port can use the model, read /get_server_info and flush the cache; set "
            f"KVSPLICE_API_KEY (or --api-key) or listen on 127.0.0.1 (docs/SECURITY.md)")


def serve(engine_config: EngineConfig, settings: ServerSettings, log_level: str = "warning",
          stderr: TextIO = sys.stderr) -> int:
    """Load the model and serve on settings.host:settings.port until interrupted (blocks). Returns
    the process's exit status: 0 after an interrupt, ENGINE_FAILED_EXIT when the engine stopped.
    `KVSPLICE_FAILPOINTS` in the environment arms failpoints (tests of the process itself). Log
    records (failed requests with their tracebacks, the engine stopping) go to stderr. Warns on
    `stderr` first when the server is reachable beyond loopback without an API key."""
    warning = exposure_warning(settings)
    if warning:
        print(warning, file=stderr, flush=True)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")   # no-op if configured
    logging.getLogger("kvsplice").setLevel(logging.INFO)   # start-up lines: build, warm-up, compiled decode
    failpoints = Failpoints.from_env(os.environ)
    app = build_app(engine_config, settings, failpoints=failpoints, warm=failpoints is None)   # armed: no warm-up
    freeze_startup_heap()
    config = uvicorn.Config(app, host=settings.host or "127.0.0.1", port=settings.port or 8000,
                            log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    failed = threading.Event()
    app.state.kvsplice.async_engine.on_fatal = exit_on_engine_failure(server, failed)
    server.run()
    return ENGINE_FAILED_EXIT if failed.is_set() else 0


def exit_on_engine_failure(server: uvicorn.Server, failed: threading.Event) -> Callable[[BaseException], None]:
    """The fatal hook of `serve`: log, set `failed`, ask uvicorn to shut down, and end the process
    with ENGINE_FAILED_EXIT if it is still there EXIT_DEADLINE_S later."""

    def on_fatal(exc: BaseException) -> None:
        logger.critical("the engine stopped (%r); shutting the server down to be restarted", exc)
        failed.set()
        server.should_exit = True
        deadline = threading.Timer(EXIT_DEADLINE_S, os._exit, args=(ENGINE_FAILED_EXIT,))
        deadline.daemon = True
        deadline.start()

    return on_fatal


class ServerThread:
    """uvicorn serving `app` in a daemon thread of this process.

        server = ServerThread(app, port=free_port()); server.start()   # returns once it accepts requests
        ... server.url ...
        server.stop()

    `on_engine_failure(exc)`: called if the engine thread stops (default: nothing; `/health` fails).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: Optional[int] = None, log_level: str = "warning",
                 on_engine_failure: Optional[Callable[[BaseException], None]] = None):
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        if on_engine_failure is not None:
            app.state.kvsplice.async_engine.on_fatal = on_engine_failure
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
