"""The engine's latest state for /metrics, without waiting on a busy engine thread.

An EngineSnapshot is taken on the engine thread between steps (AsyncEngine.call). Under load a step can
take seconds, and a scrape that waited for it would time out in Prometheus. `SnapshotCache.get` asks
for a fresh snapshot, waits at most `wait_s` for it, and otherwise answers with the last one (None
before the first). At most one refresh is queued at a time, so a stalled engine does not collect a
backlog of snapshot calls; a refresh that arrives late still updates the cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from kvsplice.server.metrics import EngineSnapshot, take_snapshot

LOG = logging.getLogger("kvsplice.server")


class SnapshotCache:
    """The latest EngineSnapshot of `async_engine.engine` and when it was taken (time.monotonic())."""

    def __init__(self, async_engine, wait_s: float = 0.05):
        self.async_engine, self.wait_s = async_engine, wait_s
        self.last: Optional[EngineSnapshot] = None
        self.taken_at: Optional[float] = None
        self._refresh: Optional[asyncio.Task] = None

    async def _take(self) -> None:
        try:
            self.last = await self.async_engine.call(lambda: take_snapshot(self.async_engine.engine))
            self.taken_at = time.monotonic()
        except Exception:  # the engine stopped meanwhile: keep the last snapshot
            LOG.warning("taking an engine snapshot failed", exc_info=True)

    async def get(self) -> Optional[EngineSnapshot]:
        """A snapshot at most `wait_s` old when the engine answers in time, else the last one."""
        if not self.async_engine.alive:
            return self.last
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._take())
        try:
            await asyncio.wait_for(asyncio.shield(self._refresh), timeout=self.wait_s)
        except asyncio.TimeoutError:
            pass
        return self.last
