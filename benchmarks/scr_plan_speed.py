"""Time the pure-Python SCR core per request: session match + token diff + span plan.

Workload per size N (8K, 32K, 128K tokens): 16 sessions in the store, all sharing a 1500-token
system prompt, each with its own conversation (benchmarks/match_cost.py measures 1,000 sessions). The request edits one conversation as an agent would: deletes a 2K-token middle
section, inserts a 50-token note in its place, and appends 200 new tokens.

    python benchmarks/scr_plan_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import DiffStats, common_prefix_len, diff_tokens
from kvsplice.reuse.plan import make_plan
from kvsplice.reuse.session import SessionStore

SIZES = (8 * 1024, 32 * 1024, 128 * 1024)
SESSIONS = 16


def build_store(size: int, rng: random.Random) -> tuple[SessionStore, list[list[int]]]:
    """16 sessions of `size` tokens that share a 1500-token system prompt."""
    store = SessionStore(ReuseConfig(max_sessions=SESSIONS, session_max_tokens=SESSIONS * size))
    system = [rng.randrange(32_000) for _ in range(1500)]
    conversations = []
    for _ in range(SESSIONS):
        token_ids = system + [rng.randrange(32_000) for _ in range(size - len(system))]
        store.update(store.create("bench"), token_ids, private_tokens=len(token_ids))
        conversations.append(token_ids)
    return store, conversations


def edited(old_ids: list[int], rng: random.Random) -> list[int]:
    """Delete a 2K middle section, insert a 50-token note there, append 200 tokens."""
    middle = len(old_ids) // 2
    note = [rng.randrange(32_000) for _ in range(50)]
    appended = [rng.randrange(32_000) for _ in range(200)]
    return old_ids[:middle] + note + old_ids[middle + 2048 :] + appended


def time_request(store: SessionStore, new_ids: list[int], cfg: ReuseConfig) -> dict:
    """Run match, diff and plan once; return the stage times (ms) and what they found."""
    start = time.perf_counter()
    found = store.match(new_ids, "bench")
    matched = time.perf_counter()
    old_ids = found.session.token_ids
    stats = DiffStats()
    runs = diff_tokens(old_ids, new_ids, fastdiff_min=cfg.fastdiff_min, cdc_target=cfg.cdc_target, stats=stats)
    diffed = time.perf_counter()
    radix_prefix = common_prefix_len(old_ids, new_ids)  # stands in for the radix cache's match (A)
    result = make_plan(old_ids, new_ids, runs, prefix_len=radix_prefix, old_kv_len=len(old_ids), cfg=cfg)
    planned = time.perf_counter()
    result.plan.validate(old_ids, new_ids, len(old_ids))
    return {
        "match": (matched - start) * 1e3, "diff": (diffed - matched) * 1e3, "plan": (planned - diffed) * 1e3,
        "candidates": found.candidates, "path": stats.last_path, "relocated": result.plan.relocated_tokens,
        "prefilled": result.plan.prefilled_tokens,
    }


def main() -> None:
    """Print one table row per size with the median stage times over --repeats runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    cfg = ReuseConfig()
    print(f"{'tokens':>8} {'match ms':>9} {'diff ms':>8} {'plan ms':>8} {'total ms':>9} "
          f"{'cands':>5} {'path':>5} {'relocated':>9} {'prefilled':>9}")
    for size in SIZES:
        store, conversations = build_store(size, rng)
        new_ids = edited(conversations[SESSIONS // 2], rng)
        rows = [time_request(store, new_ids, cfg) for _ in range(args.repeats)]
        median = {key: statistics.median(row[key] for row in rows) for key in ("match", "diff", "plan")}
        last = rows[-1]
        print(f"{size:>8} {median['match']:>9.1f} {median['diff']:>8.1f} {median['plan']:>8.1f} "
              f"{sum(median.values()):>9.1f} {last['candidates']:>5} {last['path']:>5} "
              f"{last['relocated']:>9} {last['prefilled']:>9}")


if __name__ == "__main__":
    main()
