"""AsyncEngine: drives an Engine in a background thread for asyncio callers (the HTTP server).

    asyncio handlers ──commands (add / abort / call)──> engine thread: drain commands, step()
                     <──RequestOutput per rid, via loop.call_soon_threadsafe──

Every engine call happens on the engine thread, so the Engine itself stays single-threaded.
A caller that stops iterating (client disconnect, cancellation) aborts its request, which frees
its slots.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvsplice.engine.engine import Engine
from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="kvsplice-engine", daemon=True)
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ----- engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_work())
                if self.engine.has_work():
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as exc:  # the engine is broken: fail every stream, loudly
            self.error = exc
            for rid in list(self._streams):
                self._deliver_error(rid, exc)
            raise

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
        loop, q = target
        if out.finished:
            self._streams.pop(out.rid, None)
        loop.call_soon_threadsafe(q.put_nowait, out)

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        loop, q = self._streams.pop(rid)
        loop.call_soon_threadsafe(q.put_nowait, exc)

    # ----- asyncio side -----------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result (or raise)."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, rid: str,
                       **request_kwargs) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs. Raises ValueError / QueueFullError from
        `Engine.add_request` before the first output. Abandoning the iterator aborts it."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        try:
            await self.call(lambda: self.engine.add_request(prompt_ids, params, rid=rid, **request_kwargs))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self._commands.put((lambda: self.engine.abort(rid), concurrent.futures.Future()))
