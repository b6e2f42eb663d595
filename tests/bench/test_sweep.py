"""The hit-rate sweep against a live server with a small, fixed KV pool: reuse falls once the
conversations in flight no longer fit."""

from __future__ import annotations

from pathlib import Path

from kvsplice.bench.commands import bench_main
from kvsplice.bench.sweep import sweep, write_sweep
from kvsplice.bench.trace import dump_trace
from kvsplice.bench.workload import generate_traces
from tests.server.conftest import start_server
from tests.tiny_model import make_tiny_model_dir


def test_reuse_falls_when_conversations_outgrow_the_pool(tmp_path: Path):
    conversations = generate_traces(6, seed=3, min_tokens=250, max_tokens=400, min_turns=4, max_turns=4,
                                    max_output_tokens=8)
    server = start_server(make_tiny_model_dir(tmp_path / "model"), num_slots=3000, max_batch_tokens=512)
    try:
        points = sweep(server.url, conversations, [1, 6])
        trace = tmp_path / "trace.jsonl"
        dump_trace(conversations, trace)
        status = bench_main(["--url", server.url, "--trace", str(trace), "--sweep", "1,2",
                             "--sweep-out", str(tmp_path / "sweep"), "--no-progress", "--session-ids"])
        bad = bench_main(["--url", server.url, "--trace", str(trace), "--sweep", "0,99", "--no-progress"])
    finally:
        server.thread.stop()
    alone, crowded = points
    assert alone.errors == crowded.errors == 0
    reused = lambda p: p.prefix_share + p.relocated_share  # noqa: E731
    # Alone, every turn after the first reuses all but its new messages: over 40% of the prompt
    # tokens in this trace (the tool calls and results it adds each turn are rendered as text by the
    # tiny model's template, so new content is about half of what is sent).
    assert reused(alone) > 0.4
    assert reused(crowded) < reused(alone)
    assert status == 0 and bad == 2
    written = write_sweep(points, tmp_path / "out")
    assert all(path.exists() and path.stat().st_size > 0 for path in written)
