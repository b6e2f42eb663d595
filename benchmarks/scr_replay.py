"""SCR on vs off on the default model: the same agent trace replayed against kvsplice servers.

Generates a context-editing agent trace (`kvsplice.bench.workload`, `--edits mixed` or `early`), then, in
this process, starts one server per run in `--runs`, replays the trace, stops it, and compares:

    ids    SCR on (default ReuseConfig), each request sends its conversation id as `session_id`
    auto   SCR on, no session ids: every turn must find its conversation by content
    off    SCR off (the prefix cache alone)

With `ids` and `off`: `kvsplice report ON --vs OFF --out DIR` and the edited-turn table below. With `ids` and
`auto`: the session-matching table, i.e. the share of edited turns whose session was matched without ids
(goal 100%) and the prefilled tokens of both (goal: equal), with the auto run's fallback reasons. Each
server gets one warm-up request (another cache_salt) first, so the first replayed request does not pay
for one-time start-up work.

    python benchmarks/scr_replay.py [--conversations 6] [--seed 0] [--min-tokens 1500] [--max-tokens 3000]
        [--min-turns 4] [--max-turns 6] [--max-output-tokens 16] [--concurrency 2] [--edits mixed|early]
        [--runs ids,off] [--out runs/scr_replay]

Writes under --out: trace.jsonl, one LABEL.jsonl replay run and LABEL.server.log per run (labels scr_on,
scr_auto, scr_off), report/ (report.md, summary.json, plots; with ids and off) and summary.md (the tables
printed at the end). Exit status 1 if any request failed or a self-check failed, 2 for bad arguments.
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

# run name -> (label, server settings, whether requests send their conversation id)
RUNS = {"ids": ("scr_on", ReuseConfig(), True), "auto": ("scr_auto", ReuseConfig(), False),
        "off": ("scr_off", ReuseConfig(enabled=False), True)}
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
    parser.add_argument("--edits", choices=["mixed", "early"], default="mixed", help="the workload's edit kinds")
    parser.add_argument("--runs", default="ids,off", help="comma-separated runs among ids, auto, off")
    parser.add_argument("--out", default="runs/scr_replay")
    return parser


def run_one(label: str, reuse: ReuseConfig, send_session_id: bool, conversations: list[Conversation],
            args: argparse.Namespace, out_dir: Path) -> tuple[Path, float]:
    """Start a server with `reuse`, warm it up, replay the trace into out_dir/LABEL.jsonl (with or without
    session ids), stop the server. The server's request log goes to out_dir/LABEL.server.log. Returns the
    run path and the replay's seconds."""
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
                   send_session_id=send_session_id)
            return run_path, time.perf_counter() - started
        finally:
            server.stop()


def _ttft_p50(run: Run, edited: bool) -> Optional[float]:
    values = [row.ttft_s for row in run.rows if row.edited == edited and row.ttft_s is not None]
    return float(np.percentile(values, 50)) if values else None


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_table(on: Run, off: Run) -> str:
    """Markdown: per scope (edited / unedited / all turns), prompt tokens, relocated share with SCR on,
    prefilled on vs off (and the drop), TTFT p50 on vs off."""
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


def matching_table(ids: Run, auto: Run) -> str:
    """Markdown: per scope (edited / all turns), requests, the share whose session was matched with and
    without session ids, prefilled tokens of both and their ratio; then the auto run's fallback reasons on
    edited turns."""
    ids_report, auto_report = build_report(ids), build_report(auto)
    lines = ["| turns | requests | matched with ids | matched without ids | prefilled with ids | prefilled without ids"
             " | without / with |", "|---|---:|---:|---:|---:|---:|---:|"]
    for scope, ids_totals, auto_totals in (("edited", ids_report.edited_turns, auto_report.edited_turns),
                                           ("all", ids_report.all_turns, auto_report.all_turns)):
        with_ids, without = ids_report.sessions[scope], auto_report.sessions[scope]
        ratio = auto_totals.prefilled / ids_totals.prefilled if ids_totals.prefilled else 0.0
        lines.append(f"| {scope} | {without.requests} | {100 * with_ids.matched_share:.1f}% | "
                     f"{100 * without.matched_share:.1f}% | {ids_totals.prefilled} | {auto_totals.prefilled} | "
                     f"{ratio:.3f} |")
    reasons = auto_report.sessions["edited"].fallback
    lines += ["", "Edited turns without ids that relocated nothing, by fallback reason: "
              + (", ".join(f"{reason} {count}" for reason, count in reasons.items()) or "none")]
    return "\n".join(lines) + "\n"


def _chosen_runs(text: str) -> Optional[list[str]]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    return names if names and all(name in RUNS for name in names) and len(set(names)) == len(names) else None


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    chosen = _chosen_runs(args.runs)
    if chosen is None:
        print(f"scr_replay: --runs must list distinct names among {', '.join(RUNS)}, got {args.runs!r}",
              file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations = generate_traces(args.conversations, args.seed, min_tokens=args.min_tokens,
                                    max_tokens=args.max_tokens, min_turns=args.min_turns, max_turns=args.max_turns,
                                    max_output_tokens=args.max_output_tokens, edits=args.edits)
    dump_trace(conversations, out_dir / "trace.jsonl")
    runs, seconds, status = {}, {}, 0
    for name in chosen:
        label, reuse, send_session_id = RUNS[name]
        path, seconds[label] = run_one(label, reuse, send_session_id, conversations, args, out_dir)
        runs[name] = load_run(path)
    tables = []
    if "ids" in runs and "off" in runs:
        status = report_main([str(out_dir / "scr_on.jsonl"), "--vs", str(out_dir / "scr_off.jsonl"),
                              "--out", str(out_dir / "report")])
        tables.append(summary_table(runs["ids"], runs["off"]))
    if "ids" in runs and "auto" in runs:
        tables.append(matching_table(runs["ids"], runs["auto"]))
    tables.append("Replay wall time: " + ", ".join(f"{label} {value:.1f} s" for label, value in seconds.items()) + "\n")
    text = "\n".join(tables)
    (out_dir / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 1 if status != 0 or any(run.failed for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
