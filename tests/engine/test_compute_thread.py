"""ComputeThread: callables run in order on one thread; the server loads its model on the thread
that then steps it (kvsplice.engine.compute_thread says why that halves a decode step)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsplice.engine.compute_thread import ComputeThread


def test_tasks_run_in_order_on_one_other_thread_and_errors_come_back():
    compute = ComputeThread(name="test-compute")
    seen = []
    futures = [compute.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
    for future in futures:
        future.result(timeout=10)
    assert [i for i, _ in seen] == list(range(5))
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: 42) == 42          # a failed task does not stop the thread
    compute.close()
    with pytest.raises(RuntimeError, match="stopped"):
        compute.run(lambda: 1)


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvsplice-engine"]


def test_the_server_loads_the_model_on_the_thread_that_steps_it(tmp_path):
    from kvsplice.config import EngineConfig
    from kvsplice.server.api import ServerSettings
    from kvsplice.server.launch import ServerThread, build_app
    from kvsplice.server.request_log import RequestLog
    from tests.server.conftest import LineSink
    from tests.tiny_model import make_tiny_model_dir

    tiny_model_dir = make_tiny_model_dir(tmp_path / "m")
    before = set(engine_threads())
    settings = ServerSettings(model_path=str(tiny_model_dir))
    app = build_app(EngineConfig(model=str(tiny_model_dir), num_slots=1024), settings, RequestLog(LineSink()))
    loaded_on = [t for t in engine_threads() if t not in before]
    assert len(loaded_on) == 1                  # build_app ran the load there and kept the thread
    server = ServerThread(app)
    server.start()
    try:
        async_engine = app.state.kvsplice.async_engine
        stepped_on = asyncio.run(async_engine.call(threading.get_ident))
        assert stepped_on == loaded_on[0].ident
    finally:
        server.stop()
    loaded_on[0].join(timeout=10)
    assert not loaded_on[0].is_alive()          # stopping the app ends the thread
