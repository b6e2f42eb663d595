"""AsyncEngine: drives an Engine in a background thread for asyncio callers (the HTTP server).
The thread is a ComputeThread, ideally the one that built the Engine (see
kvsplice.engine.compute_thread for why that matters to step time).

    asyncio handlers ──commands (add / abort / call)──> engine thread: drain commands, step()
                     <──RequestOutput per rid, via loop.call_soon_threadsafe──

Every engine call happens on the engine thread, so the Engine itself stays single-threaded.
A caller that stops iterating (client disconnect, cancellation) aborts its request, which frees
its slots.

Failures:
- a request that fails inside the engine ends its own stream with RequestFailedError (the engine
  frees what it held; the others go on);
- a refused request (duplicate id, full queue) is refused on the asyncio side before anything is
  registered or sent to the engine thread, so it never waits for a step nor touches another
  request's stream (the engine's own checks stay as a backstop);
- a step that raises outside every request's handling is logged and retried while the pool still
  adds up; MAX_STEP_FAILURES in a row, a broken pool, or any other exception in the thread stop
  the engine for good: `alive` turns False (health checks fail), every stream and pending call
  gets the error, and `on_fatal(exc)` runs (the server makes the process exit non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvsplice.engine.compute_thread import ComputeThread
from kvsplice.engine.engine import Engine, QueueFullError, RequestFailedError
from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_STEP_FAILURES = 3   # consecutive failed steps after which the engine thread gives up


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served until the process restarts."""


class AsyncEngine:
    """`on_fatal`: called once, on the engine thread, with the exception that stopped it (set it
    before `start()`); None: only `alive` and the streams say so. `compute`: the thread to run the
    step loop on (the one that built `engine`; default a new one). `stop` closes it."""

    def __init__(self, engine: Engine, on_fatal: Callable[[BaseException], None] | None = None,
                 compute: ComputeThread | None = None):
        self.engine = engine
        self.on_fatal = on_fatal
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._compute = compute or ComputeThread()
        self._loop_done: concurrent.futures.Future | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        # requests sent to the engine thread and not yet added (see `queued`); each counter is
        # written by one thread only
        self._adds_sent = 0
        self._adds_done = 0

    def start(self) -> None:
        self._loop_done = self._compute.submit(self._loop)

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)
        if self._loop_done is not None:
            concurrent.futures.wait([self._loop_done], timeout=10)
        self.engine.close()
        self._compute.close()

    @property
    def alive(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done() and self.error is None

    # ----- engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_work())
                if not self.engine.has_work():
                    continue
                outputs, failures = self._step(failures)
                for out in outputs:
                    self._deliver(out)
        except BaseException as exc:  # noqa: BLE001 -- the engine cannot go on: say so everywhere
            self._die(exc)

    def _step(self, failures: int) -> tuple[list[RequestOutput], int]:
        """One engine step: (its outputs, consecutive failed steps so far). A failed step is
        retried by the loop only while the pool still adds up (check_integrity raises otherwise);
        MAX_STEP_FAILURES in a row raise EngineDeadError."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 -- judged below
            failures += 1
            logger.error("engine step failed (%d in a row)", failures, exc_info=exc)
            if failures >= MAX_STEP_FAILURES:
                raise EngineDeadError(f"{failures} engine steps in a row failed "
                                      f"(last: {type(exc).__name__}: {exc})") from exc
            self.engine.check_integrity()
            return [], failures
        return outputs, 0

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            fn, future = command
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.rid)
        if target is None:
            return
        if out.finished:
            self._streams.pop(out.rid, None)
        self._put(target, out if out.error is None else RequestFailedError(out.rid, out.error))

    @staticmethod
    def _put(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: Any) -> None:
        loop, q = target
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass

    def _die(self, exc: BaseException) -> None:
        """The engine thread ends: fail every stream and pending call, then `on_fatal`."""
        self.error = exc
        logger.critical("the engine thread stopped; no request can be served", exc_info=exc)
        for rid in list(self._streams):
            target = self._streams.pop(rid, None)
            if target is not None:
                self._put(target, EngineDeadError(f"the engine stopped: {type(exc).__name__}: {exc}"))
        self._fail_pending_calls()
        if self.on_fatal is not None:
            try:
                self.on_fatal(exc)
            except Exception:  # noqa: BLE001 -- nothing is left to tell
                logger.exception("the engine's fatal-error hook failed")

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                command[1].set_exception(EngineDeadError("the engine thread is not running"))

    # ----- asyncio side -----------------------------------------------------------------
    def queued(self) -> int:
        """Requests waiting for admission or on their way to the engine thread, known without
        waiting for it: the length of the engine's waiting deque (read from this thread: len() of
        a deque is one atomic operation, so this is a snapshot, correct within one admission),
        plus the adds sent and not yet done. It may over-count by one, never under-count."""
        return self.engine.num_waiting() + self._adds_sent - self._adds_done

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result (or raise)."""
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        if self.error is not None:  # it died after the check above: nobody else will answer
            self._fail_pending_calls()
        return await asyncio.wrap_future(future)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, rid: str,
                       **request_kwargs) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs. Before the first output: ValueError for a
        request id already in use (nothing of the live request is touched), QueueFullError at
        once when the queue is full, and ValueError / QueueFullError from `Engine.add_request`.
        RequestFailedError if the request fails inside the engine, EngineDeadError if the engine
        stops. Abandoning the iterator aborts the request."""
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        max_waiting = self.engine.config.max_waiting
        if self.queued() >= max_waiting:
            raise QueueFullError(f"the waiting queue is full ({max_waiting} requests)")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._adds_sent += 1
        try:
            await self.call(lambda: self._add(prompt_ids, params, rid, request_kwargs))
        except asyncio.CancelledError:  # the add may still run: do not leave it running unobserved
            self._streams.pop(rid, None)
            self._commands.put((lambda: self.engine.abort(rid), concurrent.futures.Future()))
            raise
        except BaseException:
            self._streams.pop(rid, None)
            raise
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self._commands.put((lambda: self.engine.abort(rid), concurrent.futures.Future()))

    def _add(self, prompt_ids: list[int], params: SamplingParams, rid: str, request_kwargs: dict) -> str:
        """On the engine thread: add the request, and count it as no longer in transit."""
        try:
            return self.engine.add_request(prompt_ids, params, rid=rid, **request_kwargs)
        finally:  # after the add: a reader on the asyncio side may over-count by one, never under
            self._adds_done += 1
