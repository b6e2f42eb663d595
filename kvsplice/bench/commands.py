"""The `kvsplice bench`, `kvsplice report` and `kvsplice workload` subcommands (argparse front ends).

Each `*_main(argv)` parses `argv` (without the subcommand name), prints to stdout/stderr and returns the
exit status instead of exiting, so `kvsplice.cli` can dispatch to it. Exit 2 means bad arguments or an
unreadable input file.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from kvsplice.bench.report import RunError, build_report, format_report, load_run, write_report
from kvsplice.bench.replay import replay
from kvsplice.bench.trace import TraceError, dump_trace, load_trace
from kvsplice.bench.workload import generate_traces


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[Optional[argparse.Namespace], int]:
    """Parse argv; argparse exits on bad arguments and --help, which we turn into a status."""
    try:
        return parser.parse_args(argv), 0
    except SystemExit as stop:
        return None, stop.code if isinstance(stop.code, int) else 2


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsplice bench", description="Replay a trace against an OpenAI server.")
    parser.add_argument("--url", required=True, help="server URL, with or without /v1")
    parser.add_argument("--trace", required=True, help="JSONL trace (kvsplice workload)")
    parser.add_argument("--concurrency", type=int, default=4, help="conversations in flight (default 4)")
    parser.add_argument("--out", default="run.jsonl", help="run records, JSONL (default run.jsonl)")
    parser.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    parser.add_argument("--scr", choices=["off"], default=None, help="send scr='off' (kvsplice only)")
    parser.add_argument("--session-ids", action="store_true", help="send session_id = conversation id")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--sweep", default=None, metavar="N1,N2,...",
                        help="sweep mode: for each count, flush the server cache and replay that many "
                             "conversations at once; writes sweep.json/.md/.png into --sweep-out")
    parser.add_argument("--sweep-out", default="sweep", help="output directory of --sweep (default sweep)")
    return parser


def _sweep(args: argparse.Namespace, conversations: list) -> int:
    from pathlib import Path

    import httpx

    from kvsplice.bench.sweep import format_sweep, sweep, write_sweep
    try:
        counts = [int(part) for part in args.sweep.split(",") if part.strip()]
        points = sweep(args.url, conversations, counts, send_session_id=args.session_ids,
                       progress=not args.no_progress)
    except ValueError as error:
        print(f"kvsplice bench: bad --sweep: {error}", file=sys.stderr)
        return 2
    except httpx.HTTPError as error:
        print(f"kvsplice bench: the server failed during the sweep: {error}", file=sys.stderr)
        return 1
    print(format_sweep(points), end="")
    written = write_sweep(points, Path(args.sweep_out))
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 1 if any(point.errors for point in points) else 0


def bench_main(argv: list[str]) -> int:
    """`kvsplice bench --url URL --trace FILE [--concurrency N] [--out run.jsonl] [--model NAME] [--scr off]`.

    Replays the trace and writes the run file. Returns 0 when every request succeeded, 1 when some
    failed (the run file still holds every measurement), 2 for bad arguments or an unreadable trace.
    """
    args, status = _parse(_bench_parser(), argv)
    if args is None:
        return status
    if args.concurrency < 1:
        print("kvsplice bench: --concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        conversations = load_trace(args.trace)
    except (TraceError, OSError) as error:
        print(f"kvsplice bench: cannot read trace: {error}", file=sys.stderr)
        return 2
    if args.sweep is not None:
        return _sweep(args, conversations)
    records = replay(args.url, conversations, concurrency=args.concurrency, model=args.model, out_path=args.out,
                     progress=not args.no_progress, scr=args.scr, timeout_s=args.timeout,
                     send_session_id=args.session_ids)
    failed = [record for record in records if record.error is not None]
    print(f"{len(records)} requests, {len(failed)} failed; wrote {args.out}")
    for record in failed[:5]:
        print(f"  {record.conversation_id} turn {record.turn}: {record.error}", file=sys.stderr)
    return 1 if failed else 0


def report_main(argv: list[str]) -> int:
    """`kvsplice report RUN [--vs OTHER] [--out DIR]`: print the report tables (and write files to DIR).

    Returns 0 when every self-check holds, 1 when any fails (the failures are printed), 2 for bad
    arguments or an unreadable run file.
    """
    parser = argparse.ArgumentParser(prog="kvsplice report", description="Token, FLOPs and TTFT report of a run.")
    parser.add_argument("run", help="replay run (kvsplice bench) or kvsplice server log")
    parser.add_argument("--vs", default=None, help="another run or server log to compare with")
    parser.add_argument("--out", default=None, help="directory for report.md, summary.json and PNG plots")
    args, status = _parse(parser, argv)
    if args is None:
        return status
    try:
        run = load_run(args.run)
        other = load_run(args.vs) if args.vs is not None else None
    except (RunError, OSError, UnicodeDecodeError) as error:
        print(f"kvsplice report: cannot read run: {error}", file=sys.stderr)
        return 2
    report = build_report(run, other)
    print(format_report(report), end="")
    if args.out is not None:
        written = write_report(report, args.out)
        print(f"wrote {', '.join(str(path) for path in written)}")
    return 1 if report.problems else 0


def workload_main(argv: list[str]) -> int:
    """`kvsplice workload --out FILE --conversations N --seed S [--min-tokens --max-tokens --min-turns
    --max-turns --tokens-per-word --max-output-tokens --cache-salt --edits]`: write a synthetic agent trace.

    Returns 0 on success, 2 for bad arguments.
    """
    parser = argparse.ArgumentParser(prog="kvsplice workload", description="Generate context-editing agent traces.")
    parser.add_argument("--out", required=True, help="JSONL trace to write")
    parser.add_argument("--conversations", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--min-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32000)
    parser.add_argument("--min-turns", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=40)
    parser.add_argument("--tokens-per-word", type=float, default=1.3)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--cache-salt", default=None)
    parser.add_argument("--edits", choices=["mixed", "early"], default="mixed",
                        help="edit kinds: mixed (default) or early (every turn edits before token 1024)")
    args, status = _parse(parser, argv)
    if args is None:
        return status
    try:
        conversations = generate_traces(
            args.conversations, args.seed, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
            min_turns=args.min_turns, max_turns=args.max_turns, tokens_per_word=args.tokens_per_word,
            max_output_tokens=args.max_output_tokens, cache_salt=args.cache_salt, edits=args.edits)
        dump_trace(conversations, args.out)
    except (ValueError, OSError) as error:
        print(f"kvsplice workload: {error}", file=sys.stderr)
        return 2
    n_turns = sum(len(conversation.turns) for conversation in conversations)
    print(f"wrote {len(conversations)} conversations, {n_turns} turns to {args.out}")
    return 0
