"""Prompt tokens computed and time to first token on edited agent turns: SCR vs prefix caching alone.

One HTTP server (the default model unless --model), the same synthetic conversations
(`kvsplice.bench.workload.generate_traces`) replayed twice, each time in its own cache namespace
(cache_salt) so neither run sees the other's K/V:

    scr     SCR on, explicit session ids       prefilled = what SCR computes
    plain   scr="off" (radix prefix caching)   prefilled = everything after the first edit
    bound   from the SCR run's usage: `changed` = edited + appended tokens, the least any reuse computes

Only edited turns (not "first", not "append") are tabulated. Also prints the time of match + diff + plan
for 8K/32K/128K tokens (benchmarks/scr_plan_speed.py).

    python benchmarks/scr_edit.py [--model M] [--conversations 6] [--out scr_edit.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

from kvsplice.bench.replay import RequestRecord, replay
from kvsplice.bench.workload import generate_traces
from kvsplice.config import EngineConfig
from kvsplice.server.api import ServerSettings
from kvsplice.server.launch import ServerThread, build_app
from kvsplice.server.request_log import RequestLog


class _NullSink:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def edited_rows(records: list[RequestRecord]) -> dict[tuple[str, int], RequestRecord]:
    """Successful records of edited turns, keyed by (conversation, turn). Raises RuntimeError on a failed one."""
    rows = {}
    for record in records:
        if record.error is not None:
            raise RuntimeError(f"{record.conversation_id} turn {record.turn}: {record.error}")
        if record.edit not in ("first", "append"):
            rows[(record.conversation_id, record.turn)] = record
    return rows


def summarize(scr: dict, plain: dict) -> list[dict]:
    """One row per edit kind plus "all": mean prompt tokens, tokens computed (SCR / plain / bound), TTFT."""
    kinds = sorted({record.edit for record in scr.values()}) + ["all"]
    rows = []
    for kind in kinds:
        keys = [key for key, record in scr.items() if kind in ("all", record.edit)]
        reuse = [scr[key].usage["reuse"] for key in keys]
        rows.append({
            "edit": kind, "turns": len(keys),
            "prompt_tokens": statistics.mean(scr[k].usage["prompt_tokens"] for k in keys),
            "scr_prefilled": statistics.mean(r["prefilled_tokens"] for r in reuse),
            "scr_relocated": statistics.mean(r["relocated_tokens"] for r in reuse),
            "plain_prefilled": statistics.mean(plain[k].usage["reuse"]["prefilled_tokens"] for k in keys),
            "bound_changed": statistics.mean(r["changed"] for r in reuse),
            "scr_ttft_s": statistics.median(scr[k].ttft_s for k in keys),
            "plain_ttft_s": statistics.median(plain[k].ttft_s for k in keys),
        })
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table of `summarize`'s rows."""
    lines = ["| edit | turns | prompt | computed: SCR | plain prefix cache | lower bound (changed) | "
             "relocated | TTFT SCR (s, median) | TTFT plain (s, median) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['edit']} | {r['turns']} | {r['prompt_tokens']:.0f} | {r['scr_prefilled']:.0f} | "
                     f"{r['plain_prefilled']:.0f} | {r['bound_changed']:.0f} | {r['scr_relocated']:.0f} | "
                     f"{r['scr_ttft_s']:.2f} | {r['plain_ttft_s']:.2f} |")
    return "\n".join(lines)


def plan_speed_rows() -> Optional[list[dict]]:
    """Median match/diff/plan ms at 8K/32K/128K from benchmarks/scr_plan_speed.py (None if not importable)."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import random
        import scr_plan_speed as speed
        from kvsplice.reuse.config import ReuseConfig
    except ImportError:
        return None
    rng, rows = random.Random(0), []
    for size in speed.SIZES:
        store, conversations = speed.build_store(size, rng)
        new_ids = speed.edited(conversations[speed.SESSIONS // 2], rng)
        runs = [speed.time_request(store, new_ids, ReuseConfig()) for _ in range(3)]
        rows.append({"tokens": size, **{k: statistics.median(r[k] for r in runs) for k in ("match", "diff", "plan")}})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    """Start the server, replay both modes, print the tables, write --out (JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="scr_edit.json")
    args = parser.parse_args(argv)
    app = build_app(EngineConfig(model=args.model, num_slots=32_768),
                    ServerSettings(model_path=args.model, replica_name="bench"), RequestLog(_NullSink()))
    server = ServerThread(app)
    server.start(timeout_s=120)
    try:
        results = {}
        for mode, scr in (("scr", None), ("plain", "off")):
            conversations = generate_traces(args.conversations, args.seed, min_tokens=1500, max_tokens=4000,
                                            min_turns=4, max_turns=6, max_output_tokens=16, cache_salt=f"bench-{mode}")
            results[mode] = edited_rows(replay(server.url, conversations, concurrency=1, scr=scr,
                                               send_session_id=True, progress=False))
    finally:
        server.stop()
    rows = summarize(results["scr"], results["plain"])
    print(table(rows))
    speed = plan_speed_rows()
    if speed:
        print("\n| tokens | match ms | diff ms | plan ms |\n|---|---|---|---|")
        for row in speed:
            print(f"| {row['tokens']} | {row['match']:.1f} | {row['diff']:.1f} | {row['plan']:.1f} |")
    Path(args.out).write_text(json.dumps({"rows": rows, "plan_speed": speed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
