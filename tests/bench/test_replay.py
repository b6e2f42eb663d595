import difflib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvsplice.bench.commands import bench_main, report_main
from kvsplice.bench.replay import api_base, replay
from kvsplice.bench.report import build_report, load_run
from kvsplice.bench.trace import dump_trace
from kvsplice.bench.workload import generate_traces

SMALL = dict(min_tokens=300, max_tokens=800, min_turns=4, max_turns=5, max_output_tokens=16)


def _tokens(messages):
    words = []
    for message in messages:
        words += (message.get("content") or "").split()
        for call in message.get("tool_calls") or ():
            words += call["function"]["arguments"].split()
    return words


def _reuse(old, new):
    """A plausible kvsplice reuse split: LCP as prefix, later matching runs of >= 4 words relocated."""
    prefix = 0
    while prefix < min(len(old), len(new)) and old[prefix] == new[prefix]:
        prefix += 1
    matcher = difflib.SequenceMatcher(None, old[prefix:], new[prefix:], autojunk=False)
    blocks = [block for block in matcher.get_matching_blocks() if block.size >= 4]
    relocated = sum(block.size for block in blocks)
    prefilled = len(new) - prefix - relocated
    return {"prefix_tokens": prefix, "relocated_tokens": relocated, "prefilled_tokens": prefilled,
            "relocated_spans": len(blocks), "session": "matched" if old else "new", "fallback": None,
            "changed": prefilled, "span_tails": 0, "unchosen_spans": 0, "uncached_unchanged": 0,
            "prefill_flops": 2.0e3 * prefilled, "saved_flops": 2.0e3 * relocated}


class FakeOpenAI(ThreadingHTTPServer):
    """A tiny OpenAI-compatible chat server: streams two words, then usage (with kvsplice reuse if asked)."""

    def __init__(self, with_reuse=True, fail_every=None, mode="stream", delay_s=0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.with_reuse, self.fail_every, self.mode, self.delay_s = with_reuse, fail_every, mode, delay_s
        self.in_flight, self.max_in_flight = 0, 0
        self.bodies, self.previous = [], {}
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"data": [{"id": "fake-model"}]}).encode())

    def _send(self, status, content_type, payload):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self):
        server = self.server
        with server.lock:
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        time.sleep(server.delay_s)
        try:
            self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        finally:
            with server.lock:
                server.in_flight -= 1

    def _answer(self, body):
        server = self.server
        with server.lock:
            server.bodies.append(body)
            number = len(server.bodies)
            key = (body.get("cache_salt"), body["messages"][1]["content"])
            old, new = server.previous.get(key, []), _tokens(body["messages"])
            server.previous[key] = new
        if server.fail_every and number % server.fail_every == 0:
            self._send(500, "text/plain", b"boom")
            return
        reuse = _reuse(old, new)
        usage = {"prompt_tokens": len(new), "completion_tokens": 2, "total_tokens": len(new) + 2,
                 "prompt_tokens_details": {"cached_tokens": reuse["prefix_tokens"] + reuse["relocated_tokens"]}}
        if server.with_reuse:
            usage["reuse"] = reuse
        if server.mode == "json":
            message = {"role": "assistant", "content": "Hello world"}
            reply = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}
            self._send(200, "application/json", json.dumps(reply).encode())
            return
        if server.mode == "error_event":
            self._send(200, "text/event-stream", b'data: {"error": {"message": "overloaded"}}\n\n')
            return
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "length"}]},
                  {"choices": [], "usage": usage}]
        stream = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", stream.encode())


@pytest.fixture
def fake_server(request):
    server = FakeOpenAI(**getattr(request, "param", {}))
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _read_run(path):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


def test_api_base():
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"


def test_replay_records_usage_with_reuse(fake_server, tmp_path):
    conversations = generate_traces(3, seed=2, cache_salt="salt", **SMALL)
    out = tmp_path / "run.jsonl"
    records = replay(fake_server.url, conversations, concurrency=2, out_path=out, progress=False, scr="off")
    n_requests = sum(len(c.turns) for c in conversations)
    assert len(records) == n_requests
    assert [(r.conversation_id, r.turn) for r in records] == [(c.id, t) for c in conversations
                                                               for t in range(len(c.turns))]
    for record in records:
        assert record.error is None and record.output_text == "Hello world" and record.finish_reason == "length"
        assert 0 <= record.ttft_s <= record.total_s
        reuse = record.usage["reuse"]
        assert record.usage["prompt_tokens"] == reuse["prefix_tokens"] + reuse["relocated_tokens"] \
            + reuse["prefilled_tokens"]
    assert any(r.usage["reuse"]["relocated_tokens"] > 0 for r in records)
    body = fake_server.bodies[0]
    assert body["model"] == "fake-model" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "salt" and body["scr"] == "off" and "session_id" not in body
    # Turns of one conversation arrive in order.
    for conversation in conversations:
        sent = [b["messages"] for b in fake_server.bodies if b["messages"][1] == conversation.turns[0].messages[1]]
        assert sent == [list(turn.messages) for turn in conversation.turns]
    header, lines = _read_run(out)
    assert header["type"] == "header" and header["concurrency"] == 2 and header["n_requests"] == n_requests
    assert header["model"] == "fake-model" and header["scr"] == "off"
    assert sorted((line["conversation_id"], line["turn"]) for line in lines) == \
        sorted((r.conversation_id, r.turn) for r in records)
    report = build_report(load_run(out))
    assert report.problems == [] and report.all_turns.requests == n_requests
    assert report.all_turns.relocated > 0 and report.edited_turns.requests > 0


@pytest.mark.parametrize("fake_server", [{"fail_every": 3}], indirect=True)
def test_failing_requests_are_recorded_and_run_completes(fake_server, tmp_path):
    conversations = generate_traces(2, seed=3, **SMALL)
    out = tmp_path / "run.jsonl"
    records = replay(fake_server.url, conversations, concurrency=1, model="m", out_path=out, progress=False)
    assert len(records) == sum(len(c.turns) for c in conversations)
    failed = [r for r in records if r.error is not None]
    assert len(failed) == len(records) // 3
    assert all(r.error == "HTTP 500: boom" and r.usage is None for r in failed)
    assert all(r.usage is not None for r in records if r.error is None)
    _, lines = _read_run(out)
    assert len(lines) == len(records) and sum(1 for line in lines if line["error"]) == len(failed)


def test_unreachable_server_still_writes_the_run(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conversations = generate_traces(1, seed=1, **SMALL)
    out = tmp_path / "run.jsonl"
    records = replay(f"http://127.0.0.1:{port}", conversations, concurrency=1, out_path=out, progress=False,
                     timeout_s=2)
    assert records and all(r.error and r.error.startswith("ConnectError") for r in records)
    header, lines = _read_run(out)
    assert header["model"] is None and len(lines) == len(records)


@pytest.mark.parametrize("fake_server", [{"with_reuse": False}], indirect=True)
def test_bench_then_report_without_reuse(fake_server, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    dump_trace(generate_traces(2, seed=9, **SMALL), trace)
    out = tmp_path / "run.jsonl"
    assert bench_main(["--url", fake_server.url, "--trace", str(trace), "--out", str(out), "--no-progress",
                       "--session-ids"]) == 0
    # two conversations run at once, so the order of the bodies is not fixed
    assert {body["session_id"] for body in fake_server.bodies} == {"w9-0", "w9-1"}
    assert report_main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert "unknown" in printed and "OK: every identity held" in printed
    assert bench_main(["--url", fake_server.url, "--trace", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.parametrize("fake_server", [{"fail_every": 4}], indirect=True)
def test_bench_exit_status_reports_failures(fake_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    dump_trace(generate_traces(1, seed=9, **SMALL), trace)
    out = tmp_path / "run.jsonl"
    assert bench_main(["--url", fake_server.url, "--trace", str(trace), "--out", str(out), "--no-progress"]) == 1
    assert out.exists()
    assert report_main([str(out)]) == 0  # failed requests are listed, but accounting still holds


@pytest.mark.parametrize("fake_server", [{"mode": "json"}], indirect=True)
def test_non_streamed_json_answer_is_understood(fake_server):
    records = replay(fake_server.url, generate_traces(1, seed=4, **SMALL), concurrency=1, progress=False)
    assert all(r.error is None and r.output_text == "Hello world" and r.finish_reason == "stop" for r in records)
    assert all(r.usage["prompt_tokens"] > 0 and r.ttft_s is not None for r in records)


@pytest.mark.parametrize("fake_server", [{"mode": "error_event"}], indirect=True)
def test_error_event_in_stream_is_an_error(fake_server):
    records = replay(fake_server.url, generate_traces(1, seed=4, **SMALL), concurrency=1, progress=False)
    assert all(r.error is not None and "overloaded" in r.error and r.usage is None for r in records)


@pytest.mark.parametrize("fake_server", [{"delay_s": 0.05}], indirect=True)
def test_concurrency_bounds_conversations_in_flight(fake_server):
    conversations = generate_traces(4, seed=6, min_tokens=300, max_tokens=800, min_turns=2, max_turns=2,
                                    max_output_tokens=16)
    records = replay(fake_server.url, conversations, concurrency=2, progress=False)
    assert len(records) == 8 and all(r.error is None for r in records)
    assert fake_server.max_in_flight == 2
    with pytest.raises(ValueError, match="concurrency"):
        replay(fake_server.url, conversations, concurrency=0, progress=False)
