"""SCR on vs off on the default model: the same agent trace replayed against two kvsplice servers.

Generates a context-editing agent trace (`kvsplice.bench.workload`), then, in this process, starts a server
with SCR on (default ReuseConfig), replays the trace, stops it, starts a server with SCR off, replays again,
and runs `kvsplice report ON --vs OFF --out DIR`. Session ids are sent (the conversation id), so SCR keeps
its default settings: with automatic matching the default match_min_tokens=1024 would refuse turns whose
common prefix with the previous turn is shorter (an edit of the notes message at the start of the chat).
Each server gets one warm-up request (another cache_salt) first, so the first replayed request does not pay
for one-time start-up work.

    python benchmarks/scr_replay.py [--conversations 6] [--seed 0] [--min-tokens 1500] [--max-tokens 3000]
        [--min-turns 4] [--max-turns 6] [--max-output-tokens 16] [--concurrency 2] [--out runs/scr_replay]

Writes under --out: trace.jsonl, scr_on.jsonl / scr_off.jsonl (replay runs), scr_on.server.log /
scr_off.server.log (the servers' request logs), report/ (report.md, summary.json, plots) and summary.md
(the edited-turn table printed at the end). Exit status 1 if any request failed or a self-check failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from kvsplice.bench.commands import report_main
from kvsplice.bench.replay import replay
from kvsplice.bench.report import Run, TokenTotals, build_report, load_run
from kvsplice.bench.trace import Conversation, dump_trace
from kvsplice.bench.workload import generate_traces
from kvsplice.config import EngineConfig
from kvsplice.reuse.config import ReuseConfig
from kvsplice.server.api import ServerSettings
from kvsplice.server.launch import ServerThread, build_app
from kvsplice.server.request_log import RequestLog

RUNS = (("scr_on", ReuseConfig()), ("scr_off", ReuseConfig(enabled=False)))
WARM_UP = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0,
           "cache_salt": "warm-up"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--min-turns", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--num-slots", type=int, default=32_768, help="KV pool size of each server (tokens)")
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="runs/scr_replay")
    return parser


def run_one(label: str, reuse: ReuseConfig, conversations: list[Conversation], args: argparse.Namespace,
            out_dir: Path) -> tuple[Path, float]:
    """Start a server with `reuse`, warm it up, replay the trace into out_dir/LABEL.jsonl, stop the server.
    The server's request log goes to out_dir/LABEL.server.log. Returns the run path and the replay's seconds."""
    run_path, log_path = out_dir / f"{label}.jsonl", out_dir / f"{label}.server.log"
    with open(log_path, "w", encoding="utf-8") as log_file:
        config = EngineConfig(model=args.model, num_slots=args.num_slots, reuse=reuse)
        app = build_app(config, ServerSettings(model_path=args.model, replica_name=label), RequestLog(log_file))
        server = ServerThread(app)
        server.start()
        try:
            httpx.post(f"{server.url}/v1/chat/completions", json=WARM_UP, timeout=120).raise_for_status()
            started = time.perf_counter()
            replay(server.url, conversations, concurrency=args.concurrency, out_path=run_path, progress=True,
                   send_session_id=True)
            return run_path, time.perf_counter() - started
        finally:
            server.stop()


def _ttft_p50(run: Run, edited: bool) -> Optional[float]:
    values = [row.ttft_s for row in run.rows if row.edited == edited and row.ttft_s is not None]
    return float(np.percentile(values, 50)) if values else None


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_table(on: Run, off: Run, seconds: dict[str, float]) -> str:
    """Markdown: per scope (edited / unedited / all turns), prompt tokens, relocated share with SCR on,
    prefilled on vs off (and the drop), TTFT p50 on vs off; then the replay wall times."""
    on_report, off_report = build_report(on), build_report(off)
    scopes = (("edited", on_report.edited_turns, off_report.edited_turns, True),
              ("all", on_report.all_turns, off_report.all_turns, None))
    lines = ["| turns | requests | prompt tokens | relocated (SCR on) | prefix on / off | prefilled on | prefilled off"
             " | prefilled drop | TTFT p50 on s | TTFT p50 off s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scope, on_totals, off_totals, edited in scopes:
        on_ttft = _ttft_p50(on, True) if edited else (on_report.ttft.p50 if on_report.ttft else None)
        off_ttft = _ttft_p50(off, True) if edited else (off_report.ttft.p50 if off_report.ttft else None)
        lines.append(_summary_row(scope, on_totals, off_totals, on_ttft, off_ttft))
    lines.append(_summary_row("unedited", _minus(on_report.all_turns, on_report.edited_turns),
                              _minus(off_report.all_turns, off_report.edited_turns),
                              _ttft_p50(on, False), _ttft_p50(off, False)))
    lines += ["", "Replay wall time: " + ", ".join(f"{label} {value:.1f} s" for label, value in seconds.items())]
    return "\n".join(lines) + "\n"


def _minus(total: TokenTotals, part: TokenTotals) -> TokenTotals:
    return TokenTotals(*(getattr(total, name) - getattr(part, name)
                         for name in ("requests", "prompt", "prefix", "relocated", "prefilled")))


def _summary_row(scope: str, on: TokenTotals, off: TokenTotals, on_ttft: Optional[float],
                 off_ttft: Optional[float]) -> str:
    drop = 100 * (off.prefilled - on.prefilled) / off.prefilled if off.prefilled else 0.0
    return (f"| {scope} | {on.requests} | {on.prompt} | {on.relocated} ({100 * on.share('relocated'):.1f}%) | "
            f"{100 * on.share('prefix'):.1f}% / {100 * off.share('prefix'):.1f}% | {on.prefilled} | {off.prefilled} | "
            f"{drop:.1f}% | {_seconds(on_ttft)} | {_seconds(off_ttft)} |")


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations = generate_traces(args.conversations, args.seed, min_tokens=args.min_tokens,
                                    max_tokens=args.max_tokens, min_turns=args.min_turns, max_turns=args.max_turns,
                                    max_output_tokens=args.max_output_tokens)
    dump_trace(conversations, out_dir / "trace.jsonl")
    paths, seconds = {}, {}
    for label, reuse in RUNS:
        paths[label], seconds[label] = run_one(label, reuse, conversations, args, out_dir)
    status = report_main([str(paths["scr_on"]), "--vs", str(paths["scr_off"]), "--out", str(out_dir / "report")])
    on, off = load_run(paths["scr_on"]), load_run(paths["scr_off"])
    table = summary_table(on, off, seconds)
    (out_dir / "summary.md").write_text(table, encoding="utf-8")
    print(table)
    return 1 if status != 0 or on.failed or off.failed else 0


if __name__ == "__main__":
    sys.exit(main())
