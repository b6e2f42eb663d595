"""The hit rate is the workload: prefix hit rate, relocated share and TTFT against the number of
concurrent agent conversations, with the KV pool fixed.

    python benchmarks/hit_rate_sweep.py [--model DIR] [--num-slots 5000] [--counts 1,2,4,8] [--out runs/sweep]
                                        [--kv-disk-dir DIR [--kv-disk-gb F]]

Starts one kvsplice server (default model unless --model) with a pool of --num-slots tokens, writes a
synthetic agent trace, and runs `kvsplice bench --sweep` against it: for each count the cache is
flushed and that many conversations run at once. Prints the table; writes sweep.json/.md/.png.
With --kv-disk-dir the server has a disk tier under its pool (flushed with it at every count): K/V
the pool evicts is loaded back from disk instead of prefilled (the table's prefix share includes it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.bench.sweep import format_sweep, sweep, write_sweep
from kvsplice.bench.workload import generate_traces
from kvsplice.config import EngineConfig
from kvsplice.server.api import ServerSettings
from kvsplice.server.launch import ServerThread, build_app
from kvsplice.server.request_log import RequestLog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-slots", type=int, default=5_000)
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--min-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=1200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--kv-disk-dir", default=None, help="a disk tier under the pool (default: none)")
    parser.add_argument("--kv-disk-gb", type=float, default=4.0)
    args = parser.parse_args()

    counts = [int(part) for part in args.counts.split(",")]
    conversations = generate_traces(max(counts), args.seed, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                    min_turns=args.turns, max_turns=args.turns, max_output_tokens=16)
    tier = (DiskTierConfig.from_gb(args.kv_disk_dir, args.kv_disk_gb, write_queue_size=4096)
            if args.kv_disk_dir else None)
    config = EngineConfig(model=args.model, num_slots=args.num_slots, disk_tier=tier)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "server.log", "w") as log:
        app = build_app(config, ServerSettings(model_path=args.model), RequestLog(log))
        server = ServerThread(app)
        server.start(timeout_s=300)
        try:
            points = sweep(server.url, conversations, counts, send_session_id=True, progress=True)
        finally:
            server.stop()
    engine = app.state.kvsplice.engine
    if engine.cache.tier is not None:
        print(f"prompt tokens loaded from the disk tier: {engine.counters.disk_tokens} of "
              f"{engine.counters.prompt_tokens}; {engine.cache.tier.stats()}")
    print(f"pool: {args.num_slots} slots; disk tier: {args.kv_disk_dir or 'none'}; conversations of {args.min_tokens}-{args.max_tokens} tokens, "
          f"{args.turns} turns; turns after the first only")
    print(format_sweep(points), end="")
    write_sweep(points, out)


if __name__ == "__main__":
    main()
