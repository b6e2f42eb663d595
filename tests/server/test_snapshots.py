"""/metrics' engine snapshot: a busy engine thread makes a scrape wait at most `wait_s`, answered with
the last snapshot; one refresh is queued at a time."""

from __future__ import annotations

import asyncio

from kvsplice.server.snapshots import SnapshotCache


class SlowEngine:
    """Stands in for AsyncEngine: `call` answers only once `release` is set, counting calls."""

    def __init__(self):
        self.alive, self.engine, self.calls = True, None, 0
        self.release = asyncio.Event()

    async def call(self, fn):
        self.calls += 1
        await self.release.wait()
        return f"snapshot {self.calls}"


def test_a_busy_engine_gets_the_last_snapshot_without_a_backlog():
    async def scenario():
        engine = SlowEngine()
        cache = SnapshotCache(engine, wait_s=0.01)
        assert [await cache.get() for _ in range(5)] == [None] * 5  # busy from the start: nothing yet
        assert engine.calls == 1  # one refresh queued, not five
        engine.release.set()
        await asyncio.sleep(0)
        assert await cache.get() in ("snapshot 1", "snapshot 2")
        engine.release.clear()
        assert await cache.get() is not None  # busy again: the last snapshot, at once
        engine.release.set()
        engine.alive = False
        assert await cache.get() is not None  # a stopped engine: the last one, no call
    asyncio.run(scenario())
