"""benchmarks/agent_harnesses.py without the CLIs: its recording proxy in front of a server on the tiny
model (requests forwarded as they are, answers streamed back, each exchange's status and usage.reuse
kept, for all three protocols), and how it tells the edits between two requests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server
from tests.tiny_model import make_tiny_model_dir

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "agent_harnesses.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("agent_harnesses_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_edits_between_requests_are_named(script):
    old = ["sys", "tools", "u1", "a1", "u2"]
    assert script.describe_edit(old, old + ["a2", "u3"]) == "+2 appended"
    assert script.describe_edit(old, ["sys", "tools", "u1", "u2"]) == "-1 deleted at 3"
    assert script.describe_edit(old, ["sys", "tools", "u1", "A1", "u2"]) == "1->1 replaced at 3"
    assert script.describe_edit(old, old) == "same"
    # a moved cache breakpoint is no edit
    with_breakpoint = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                  "cache_control": {"type": "ephemeral"}}]}]}
    without = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert script.context_units("messages", with_breakpoint) == script.context_units("messages", without)


def test_the_proxy_records_every_protocols_exchanges(script, tmp_path):
    server = start_server(make_tiny_model_dir(tmp_path / "model"), num_slots=4096, max_batch_tokens=512)
    proxy = script.RecordingProxy(int(server.url.rsplit(":", 1)[1]))
    try:
        url = f"http://127.0.0.1:{proxy.port}"
        model = server.state.model_name
        proxy.harness, proxy.turn = "test", 1
        messages = [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Say hi."}]
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": messages, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}) as reply:
            assert reply.status_code == 200 and "data: [DONE]" in reply.read().decode()
        proxy.turn = 2
        followed = messages + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]
        assert httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "messages": followed, "max_tokens": 3}).status_code == 200
        assert httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": model, "input": "Say hi.", "max_output_tokens": 3, "stream": True}).status_code == 200
        assert httpx.post(f"{url}/v1/messages", timeout=60, json={
            "model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "Say hi."}]}).status_code == 200
        assert httpx.post(f"{url}/v1/responses", timeout=60, json={"input": "x", "frobnicate": 1}).status_code == 400
    finally:
        proxy.close()
        server.thread.stop()
    rows = script.analyse([script.dataclasses.asdict(e) for e in proxy.exchanges])
    assert [row["status"] for row in rows] == [200, 200, 200, 200, 400]
    assert [row["turn"] for row in rows] == [1, 2, 2, 2, 2]
    for row in rows[:4]:
        assert row["prompt"] > 0 and row["prompt"] == row["prefix"] + row["relocated"] + row["prefilled"], row
        assert not row["errors"]
    assert rows[1]["edit"] == "vs #0: +2 appended" and rows[1]["prefix"] > 0
    assert rows[4]["errors"] and "frobnicate" in rows[4]["errors"][0]
