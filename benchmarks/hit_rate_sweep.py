"""The hit rate is the workload: prefix hit rate, relocated share and TTFT against the number of
concurrent agent conversations, with the KV pool fixed.

    python benchmarks/hit_rate_sweep.py [--model DIR] [--num-slots 5000] [--counts 1,2,4,8] [--out runs/sweep]
                                        [--kv-disk-dir DIR [--kv-disk-gb F]] [--dtype float32]
    python benchmarks/hit_rate_sweep.py --tier-compare --counts 32 --num-slots 3200 ...

Starts one kvsplice server (default model unless --model) with a pool of --num-slots tokens, writes a
synthetic agent trace, and runs `kvsplice bench --sweep` against it: for each count the cache is
flushed and that many conversations run at once. Prints the table; writes sweep.json/.md/.png.
With --kv-disk-dir the server has a disk tier under its pool (flushed with it at every count): K/V
the pool evicts is loaded back from disk instead of prefilled (the table's prefix share includes it).

--tier-compare runs the same trace against three servers one after the other, in this one run: an
unbounded pool (--unbounded-slots), the --num-slots pool without a tier, and the --num-slots pool
with a disk tier (in --kv-disk-dir, or a temporary directory); it prints the three tables and the
small pools' prefilled tokens and TTFT p50 as ratios to the unbounded pool's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from kvsplice.bench.machine import cpu_line
from kvsplice.bench.sweep import format_sweep, sweep, write_sweep
from kvsplice.bench.workload import generate_traces
from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.config import EngineConfig
from kvsplice.server.api import ServerSettings
from kvsplice.server.launch import ServerThread, build_app
from kvsplice.server.request_log import RequestLog


def run_server(config: EngineConfig, model: str | None, conversations, counts: list[int], log_path: Path):
    """Sweep `counts` against one in-process server of `config`; (points, the engine's disk line)."""
    with open(log_path, "w") as log:
        app = build_app(config, ServerSettings(model_path=model), RequestLog(log))
        server = ServerThread(app)
        server.start(timeout_s=300)
        try:
            points = sweep(server.url, conversations, counts, send_session_id=True, progress=False)
        finally:
            server.stop()
    engine = app.state.kvsplice.engine
    disk = ""
    if engine.cache.tier is not None:
        stats = engine.cache.tier.stats()
        disk = (f"prompt tokens loaded from the disk tier: {engine.counters.disk_tokens} of "
                f"{engine.counters.prompt_tokens}; tier writes {stats.writes}, loads {stats.loads}, "
                f"evictions {stats.evictions}, dropped {stats.dropped_queue_full + stats.dropped_over_budget}")
    return points, disk


def compare(args, conversations, counts: list[int], out: Path) -> None:
    """The three servers of --tier-compare, then the ratios."""
    with tempfile.TemporaryDirectory(dir=args.kv_disk_dir or "/var/tmp") as tier_dir:
        tier = DiskTierConfig.from_gb(tier_dir, args.kv_disk_gb, write_queue_size=4096)
        runs = {}
        for name, slots, disk_tier in (("unbounded pool", args.unbounded_slots, None),
                                       ("small pool, no tier", args.num_slots, None),
                                       ("small pool + disk tier", args.num_slots, tier)):
            config = EngineConfig(model=args.model, dtype=args.dtype, num_slots=slots, disk_tier=disk_tier)
            runs[name], disk = run_server(config, args.model, conversations, counts, out / f"server-{slots}-{bool(disk_tier)}.log")
            print(f"{name}: {slots} slots{'; ' + disk if disk else ''}")
            print(format_sweep(runs[name]), end="")
    base = runs["unbounded pool"]
    for name in ("small pool, no tier", "small pool + disk tier"):
        for point, ref in zip(runs[name], base):
            print(f"{name}, {point.conversations} conversations: prefilled tokens {ratio(point.prefilled_tokens, ref.prefilled_tokens)} "
                  f"and TTFT p50 {ratio(point.ttft_p50_s, ref.ttft_p50_s)} the unbounded pool's "
                  f"({point.prefilled_tokens} / {ref.prefilled_tokens} tokens)")


def ratio(value, reference) -> str:
    return "-" if not value or not reference else f"{value / reference:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-slots", type=int, default=5_000)
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--min-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=1200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--kv-disk-dir", default=None, help="a disk tier under the pool (default: none)")
    parser.add_argument("--kv-disk-gb", type=float, default=4.0)
    parser.add_argument("--tier-compare", action="store_true",
                        help="unbounded pool, --num-slots without and with a disk tier, in one run")
    parser.add_argument("--unbounded-slots", type=int, default=65_536)
    args = parser.parse_args()

    counts = [int(part) for part in args.counts.split(",")]
    conversations = generate_traces(max(counts), args.seed, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                    min_turns=args.turns, max_turns=args.turns, max_output_tokens=args.max_output_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_line()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"conversations of {args.min_tokens}-{args.max_tokens} tokens, {args.turns} turns, at most "
          f"{args.max_output_tokens} output tokens, {args.dtype}; turns after the first only")
    if args.tier_compare:
        compare(args, conversations, counts, out)
        print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return
    tier = (DiskTierConfig.from_gb(args.kv_disk_dir, args.kv_disk_gb, write_queue_size=4096)
            if args.kv_disk_dir else None)
    config = EngineConfig(model=args.model, dtype=args.dtype, num_slots=args.num_slots, disk_tier=tier)
    points, disk = run_server(config, args.model, conversations, counts, out / "server.log")
    if disk:
        print(disk)
    print(f"pool: {args.num_slots} slots; disk tier: {args.kv_disk_dir or 'none'}")
    print(format_sweep(points), end="")
    write_sweep(points, out)


if __name__ == "__main__":
    main()
