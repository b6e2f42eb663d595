"""Routing policies of sglang-router in front of 3 kvsplice replicas, on an edited-conversation workload.

For each policy: start N fresh replicas (`kvsplice serve`, cold caches) and sglang-router with that
policy, replay the same multi-session context-editing workload (kvsplice.bench.workload) through the
router, and record per policy the prompt tokens served from the prefix cache, relocated by SCR and
prefilled, time to first token (p50 / p90), failures, and how many replicas each conversation touched.

Every request carries the header X-SMG-Routing-Key: <conversation id> (the only header the router
forwards): the `manual` policy pins each key to one replica (the session-key policy sglang-router 0.3.2
has; `consistent_hashing` came later), the other policies ignore it.

    python benchmarks/router_policies.py --out /tmp/router_policies.json --markdown /tmp/router_results.md

Without --model it builds the tiny random model of tests/tiny_model.py (run from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import httpx

from kvsplice.bench.replay import RequestRecord, _run_turn, api_base, discover_model
from kvsplice.bench.scale_out import (ROUTING_KEY_HEADER, ManagedProcess, RouterOptions, router_available,
                                      start_replica, start_router)
from kvsplice.bench.trace import Conversation
from kvsplice.bench.workload import generate_traces

POLICIES = ("round_robin", "cache_aware", "manual")


async def _replay_with_keys(router_url: str, conversations: list[Conversation], concurrency: int,
                            timeout_s: float) -> list[RequestRecord]:
    """Replay like kvsplice.bench.replay, with one client per conversation that sends its routing key."""
    base = api_base(router_url)
    slots = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(timeout=timeout_s) as probe:
        model = await discover_model(probe, base)

    async def run(conversation: Conversation) -> None:
        async with slots, httpx.AsyncClient(timeout=timeout_s,
                                            headers={ROUTING_KEY_HEADER: conversation.id}) as client:
            for turn_offset in range(len(conversation.turns)):
                records.append(await _run_turn(client, base, conversation, turn_offset, model, None, True))

    await asyncio.gather(*(run(conversation) for conversation in conversations))
    return records


def _replicas_touched(replicas: list[ManagedProcess], records: list[RequestRecord]) -> dict[str, int]:
    """Per conversation id, how many replicas served one of its requests. The router passes no replica name
    back and RequestRecord keeps no response id, so a request is matched to the replica whose request log
    has its (prompt_tokens, completion_tokens) pair (a collision between conversations can only raise it)."""
    logged: list[set[tuple[int, int]]] = []
    for replica in replicas:
        pairs = set()
        for line in replica.log_text().splitlines():
            if line.startswith("kvsplice.request "):
                entry = json.loads(line.split(" ", 1)[1])
                pairs.add((entry["prompt_tokens"], entry["completion_tokens"]))
        logged.append(pairs)
    per_conversation: dict[str, set[int]] = defaultdict(set)
    for record in records:
        if record.usage is None:
            continue
        key = (record.usage["prompt_tokens"], record.usage["completion_tokens"])
        per_conversation[record.conversation_id] |= {offset for offset, pairs in enumerate(logged) if key in pairs}
    return {conversation_id: len(owners) for conversation_id, owners in per_conversation.items()}


def _percentile(values: list[float], fraction: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def summarize(policy: str, records: list[RequestRecord], touched: dict[str, int], wall_s: float) -> dict[str, Any]:
    """Token totals, shares, TTFT percentiles and failures of one policy's run."""
    done = [r for r in records if r.error is None and r.usage is not None]
    prompt = sum(r.usage["prompt_tokens"] for r in done)
    reuse = [r.usage.get("reuse") or {} for r in done]
    prefix = sum(u.get("prefix_tokens", 0) for u in reuse)
    relocated = sum(u.get("relocated_tokens", 0) for u in reuse)
    prefilled = sum(u.get("prefilled_tokens", 0) for u in reuse)
    later = [r for r in done if r.turn > 0]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    ttft_later = [r.ttft_s for r in later if r.ttft_s is not None]
    return {
        "policy": policy, "requests": len(records), "failed": len(records) - len(done), "wall_s": round(wall_s, 1),
        "prompt_tokens": prompt, "prefix_tokens": prefix, "relocated_tokens": relocated,
        "prefilled_tokens": prefilled,
        "prefix_share": prefix / prompt if prompt else 0.0, "relocated_share": relocated / prompt if prompt else 0.0,
        "prefilled_share": prefilled / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * _percentile(ttft, 0.5) if ttft else None,
        "ttft_p90_ms": 1000 * _percentile(ttft, 0.9) if ttft else None,
        "later_turn_ttft_p50_ms": 1000 * _percentile(ttft_later, 0.5) if ttft_later else None,
        "replicas_per_conversation": statistics.mean(touched.values()) if touched else None,
        "sessions_matched": sum(1 for u in reuse if u.get("session") == "matched"),
    }


def run_policy(policy: str, model: str, n_replicas: int, engine_args: list[str], conversations: list[Conversation],
               concurrency: int, log_dir: Path) -> dict[str, Any]:
    """Fresh replicas + router for `policy`, one replay, then everything stopped; returns `summarize`."""
    replicas: list[ManagedProcess] = []
    router: Optional[ManagedProcess] = None
    try:
        with ThreadPoolExecutor(n_replicas) as pool:
            futures = [pool.submit(start_replica, model, f"r{n}", engine_args=engine_args,
                                   log_path=log_dir / f"{policy}-r{n}.log") for n in range(n_replicas)]
            replicas = [future.result() for future in futures]
        router = start_router([r.url for r in replicas], RouterOptions(policy=policy),
                              log_path=log_dir / f"{policy}-router.log")
        started = time.perf_counter()
        records = asyncio.run(_replay_with_keys(router.url, conversations, concurrency, timeout_s=300))
        wall_s = time.perf_counter() - started
        return summarize(policy, records, _replicas_touched(replicas, records), wall_s)
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def markdown(results: list[dict[str, Any]], command: str, setup: str) -> str:
    """The results section: setup, command, and one row per policy."""
    def ms(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = [
        "## Scale-out: routing policies of sglang-router over 3 kvsplice replicas", "",
        setup, "", f"Command: `{command}`", "",
        "| policy | requests (failed) | prefix share | relocated share | prefilled tokens | TTFT p50 / p90 ms "
        "| later-turn TTFT p50 ms | replicas per conversation | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['policy']} | {r['requests']} ({r['failed']}) | {r['prefix_share']:.1%} | "
                     f"{r['relocated_share']:.1%} | {r['prefilled_tokens']} of {r['prompt_tokens']} | "
                     f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p90_ms'])} | {ms(r['later_turn_ttft_p50_ms'])} | "
                     f"{r['replicas_per_conversation']:.2f} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """Run every policy in --policies and write the JSON results and the markdown section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir for the replicas (default: the tiny test model)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--concurrency", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=400, help="workload peak context, estimated tokens")
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--out", default="router_policies.json")
    parser.add_argument("--markdown", default=None, help="also write the results section here")
    args = parser.parse_args(argv)
    if not router_available():
        print("sglang-router is not installed: pip install sglang-router==0.3.2", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="router_policies_"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.tiny_model import make_tiny_model_dir

        model = str(make_tiny_model_dir(work / "tiny"))
    conversations = generate_traces(args.conversations, args.seed, min_tokens=args.min_tokens,
                                    max_tokens=args.max_tokens, min_turns=6, max_turns=8, max_output_tokens=8)
    engine_args = ["--num-slots", "32768", "--max-model-len", "4096"]
    results = []
    for policy in args.policies:
        results.append(run_policy(policy, model, args.replicas, engine_args, conversations, args.concurrency, work))
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "model": model, "results": results}, indent=2))
    setup = (f"{args.replicas} replicas (`kvsplice serve {' '.join(engine_args)}`, fresh per policy) of "
             f"{'the tiny random test model (tests/tiny_model.py)' if args.model is None else args.model}; "
             f"sglang-router 0.3.2; workload: {args.conversations} edited conversations "
             f"(generate_traces seed {args.seed}, {args.min_tokens}-{args.max_tokens} est. tokens, 6-8 turns), "
             f"concurrency {args.concurrency}, header X-SMG-Routing-Key = conversation id. Logs: {work}")
    text = markdown(results, "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                    setup)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
