"""The server never dies of a request, through HTTP: an out-of-range SCR setting on an edited
conversation is a 400 naming the field; a duplicate request id leaves the live request's stream
alone; a full queue answers 503 without waiting for the engine thread; a request that fails inside
the engine gets a 500 (or an SSE error event) naming its id while the others are served; and an
engine thread that cannot go on makes /health fail and `kvsplice serve` exit non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvsplice.config import EngineConfig
from kvsplice.engine.failpoints import Failpoints
from kvsplice.reuse.config import ReuseConfig
from kvsplice.server.api import ServerSettings
from kvsplice.server.launch import ENGINE_FAILED_EXIT, ServerThread, build_app, free_port
from kvsplice.server.request_log import RequestLog
from tests.server.conftest import LineSink

SCR = ReuseConfig(match_min_tokens=32, min_span=8, tail=4)
SYSTEM = {"role": "system", "content": "You are a careful research agent. Agents edit their own context: "
                                       "they delete tool results and rewrite notes in place. " * 3}
TASK = {"role": "user", "content": "Task: read the documentation and summarise it."}
TOOL_RESULT = {"role": "user", "content": "Tool result: def main():\n    print('hello world')\n\n"
                                          "The function returns None when nothing is found. " * 6}
NOTES = {"role": "user", "content": "Working notes: Once upon a time there was a little robot who liked to "
                                    "read documentation. Tool results are long; notes are short. " * 3}


class Served:
    """A ServerThread on the tiny model with failpoints the test arms."""

    def __init__(self, model_dir, on_engine_failure=None, **engine_kwargs):
        self.failpoints = Failpoints()
        config = EngineConfig(model=str(model_dir), **engine_kwargs)
        app = build_app(config, ServerSettings(model_path=str(model_dir)), RequestLog(LineSink()),
                        failpoints=self.failpoints)
        self.state = app.state.kvsplice
        self.thread = ServerThread(app, on_engine_failure=on_engine_failure)
        self.thread.start()
        self.url = self.thread.url

    def on_engine(self, fn):
        """`fn()` run on the engine thread, between steps."""
        return asyncio.run(self.state.async_engine.call(fn))

    def assert_idle_and_whole(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + 10
        while self.on_engine(lambda: engine.num_running() + engine.num_waiting()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.on_engine(engine.check_integrity)
        assert self.on_engine(lambda: engine.cache.held_by(engine.scheduler.running)) == 0
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    running = Served(tiny_model_dir, num_slots=8192, max_batch_tokens=512, reuse=SCR)
    yield running
    running.thread.stop()


def chat(served, messages, **extra):
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)


def generate(served, rid, input_ids, max_new_tokens=8, stream=False):
    body = {"rid": rid, "input_ids": input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{served.url}/generate", json=body, timeout=60)


def sse_events(lines) -> list:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]


def test_finding1_huge_cdc_target_on_an_edited_conversation_is_a_400(served):
    """The reproducer: an edited conversation with scr {"cdc_target": 2**60, "fastdiff_min": 0}."""
    first = chat(served, [SYSTEM, TASK, TOOL_RESULT, NOTES])
    assert first.status_code == 200
    reply = {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
    edited = [SYSTEM, TASK, NOTES, reply, {"role": "user", "content": "Now continue with the next file."}]
    bad = chat(served, edited, scr={"cdc_target": 2**60, "fastdiff_min": 0})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "scr.cdc_target" and "scr.cdc_target" in error["message"]
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    # the largest allowed chunk size on the fast path serves the edited turn
    edge = chat(served, edited, scr={"cdc_target": 2**16, "fastdiff_min": 0})
    assert edge.status_code == 200 and edge.json()["usage"]["reuse"]["session"] == "matched"
    served.assert_idle_and_whole()


def test_finding2_duplicate_rid_leaves_the_victim_stream_alone(served):
    release = threading.Event()
    body = {"rid": "victim", "input_ids": list(range(5, 40)), "stream": True,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{served.url}/generate", json=body, timeout=60) as victim:
        lines = victim.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        reached = served.failpoints.pause("step", release)   # the victim is surely still running
        assert reached.wait(10)
        duplicate = generate(served, "victim", list(range(50, 60)))
        release.set()
        assert duplicate.status_code == 400 and "already in use" in duplicate.json()["error"]["message"]
        events = sse_events([first, *lines])
    final = events[-1]
    assert len(final["output_ids"]) == 48 and final["meta_info"]["finish_reason"] == {"type": "length"}
    served.assert_idle_and_whole()


def test_a_request_failing_in_the_engine_gets_a_500_naming_it_and_the_others_are_served(served):
    prompts = {f"ok-{i}": list(range(10 + i, 60 + i)) for i in range(3)}
    expected = {rid: generate(served, rid, ids).json()["output_ids"] for rid, ids in prompts.items()}
    served.failpoints.fail("forward", rid="culprit", times=None, after=2)   # mid-decode, batched
    served.failpoints.fail("detokenize", rid="streamed", after=3)
    results: dict[str, httpx.Response] = {}

    def send(rid, ids, stream=False):
        results[rid] = generate(served, rid, ids, max_new_tokens=16 if rid in prompts else 8, stream=stream)

    threads = [threading.Thread(target=send, args=(rid, ids)) for rid, ids in prompts.items()]
    threads += [threading.Thread(target=send, args=("culprit", list(range(100, 140)))),
                threading.Thread(target=send, args=("streamed", list(range(150, 190)), True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    served.failpoints.clear()
    failed = results["culprit"]
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert "request culprit failed" in error["message"] and error["type"] == "server_error"
    assert error["code"] == "request_failed"
    streamed = sse_events(results["streamed"].text.splitlines())
    assert results["streamed"].status_code == 200 and "request streamed failed" in streamed[-1]["error"]["message"]
    for rid in prompts:
        assert results[rid].status_code == 200
        assert results[rid].json()["output_ids"][:8] == expected[rid]
    served.assert_idle_and_whole()
    assert generate(served, "after", prompts["ok-0"]).json()["output_ids"] == expected["ok-0"]


@pytest.fixture(scope="module")
def small_queue(tiny_model_dir):
    running = Served(tiny_model_dir, num_slots=1024, max_running=1, max_waiting=1)
    yield running
    running.thread.stop()


def test_queue_full_503_does_not_wait_for_the_engine_thread(small_queue):
    release = threading.Event()
    reached = small_queue.failpoints.pause("forward", release)
    results: dict[str, int] = {}

    def send(rid):
        results[rid] = generate(small_queue, rid, list(range(5, 30))).status_code

    running = threading.Thread(target=send, args=("running",))
    running.start()
    assert reached.wait(10)   # "running" is admitted, the engine thread is held inside its step
    waiting = threading.Thread(target=send, args=("waiting",))
    waiting.start()
    deadline = time.monotonic() + 10
    while small_queue.state.async_engine.queued() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = generate(small_queue, "refused", list(range(5, 30)))
    assert not release.is_set()   # answered while the step still runs
    release.set()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    running.join(30)
    waiting.join(30)
    assert results == {"running": 200, "waiting": 200}
    small_queue.assert_idle_and_whole()


def test_a_dead_engine_fails_health_and_calls_the_hook(tiny_model_dir):
    died = threading.Event()
    served = Served(tiny_model_dir, on_engine_failure=lambda exc: died.set(), num_slots=512)
    try:
        served.failpoints.fail("step", times=None)
        response = generate(served, "x", list(range(5, 20)))
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        assert died.wait(10)
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 503
        assert httpx.get(f"{served.url}/readiness", timeout=10).status_code == 503
    finally:
        served.thread.stop()


@pytest.mark.slow  # starts `kvsplice serve` in a subprocess
def test_serve_exits_non_zero_when_the_engine_thread_dies(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "KVSPLICE_FAILPOINTS": "step"}   # every step fails: the step loop gives up
    proc = subprocess.Popen([sys.executable, "-m", "kvsplice.cli", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port), "--num-slots", "512"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.1)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=30)
        assert response.status_code == 503
        code = proc.wait(timeout=60)  # only guards against a hang
        assert code == ENGINE_FAILED_EXIT != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "engine" in proc.stderr.read()
