"""A bounded thread pool for the request work that grows with the input, so the event loop stays free.

Parsing a large body, rendering a chat template and tokenizing a long prompt take from milliseconds to
seconds; on the event loop they would stall every other connection, /health included. Handlers run them
here instead (`await workers.run(fn, *args)`). The tokenizers library releases the GIL while it encodes,
and pure-Python work (JSON, templates) yields it every few milliseconds, so the loop keeps answering.
At most `num_threads` such jobs run at once; further ones wait their turn in the pool's queue.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerPool:
    """`num_threads` worker threads named kvsplice-prep-N. `shutdown()` stops them (queued jobs are dropped)."""

    def __init__(self, num_threads: int = 2):
        if num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kvsplice-prep")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a worker thread; its result, or what it raised."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
