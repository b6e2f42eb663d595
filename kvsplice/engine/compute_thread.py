"""ComputeThread: the one OS thread on which a serving process runs its torch work, from loading
the model to every engine step.

Why one thread. torch's CPU kernels parallelise with OpenMP (libgomp in the PyPI wheels). Every OS
thread that has run a parallel region keeps a team of worker threads for the life of the process,
and once a process holds more OpenMP threads than it has cores, libgomp stops the workers from
spinning between regions (the throttled GOMP_SPINCOUNT, see the libgomp manual's "GOMP_SPINCOUNT"):
each of the several hundred small parallel ops of a decode step then waits for a worker to be woken
from a futex. A model loaded on the main thread and stepped on an engine thread is exactly that
case, measured slower than loading and stepping on one thread (docs/BENCHMARKS_HISTORY.md,
"Decode threads in the server" and "Figures formerly quoted in code").

So the server loads the model on its ComputeThread and runs the engine loop on the same thread
(`AsyncEngine(compute=...)`); nothing else in the serving process calls torch.

    main thread:     ComputeThread() ── run(build_engine) ──> Engine ── create_app ── uvicorn
    compute thread:                      build_engine ...               AsyncEngine loop (steps)
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    """A daemon thread that runs submitted callables one at a time, in order. Daemon: a step that
    never returns cannot keep the process from exiting (the server's exit deadline relies on it)."""

    def __init__(self, name: str = "kvsplice-engine"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "concurrent.futures.Future[T]":
        """Queue `fn`; the future gets its result or exception. After `close` the future fails
        with RuntimeError at once."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed.is_set() or not self._thread.is_alive():
            future.set_exception(RuntimeError("the compute thread has stopped"))
            return future
        self._tasks.put((fn, future))
        return future

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the compute thread; blocks until it returns, and raises what it raised."""
        return self.submit(fn).result()

    def close(self) -> None:
        """Stop after the tasks already queued (returns at once; a running task is not stopped)."""
        self._closed.set()
        self._tasks.put(None)

    def _serve(self) -> None:
        while True:
            task: Any = self._tasks.get()
            if task is None:
                return
            fn, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 -- handed to whoever waits on the future
                future.set_exception(exc)
