"""Two tenants, one flooding: tenant A's returning turns' hit rate with and without tenant B's flood,
with and without --tenant-kv-share, in one run.

    python benchmarks/tenant_flood.py [--num-slots 2000] [--share 0.5] [--turns 4] [--model M]

Tenant A (its own API-key owner) holds one conversation: a `--history`-token first prompt, then
`--turns` returning turns, each its previous prompt + the reply + `--turn-tokens` new tokens. Between
two of A's turns, tenant B sends `--flood` new prompts of `--flood-tokens` tokens each (never
repeated): together more than the pool, so by plain LRU they push A's history out. The hit rate of
A's returning turns is the share of their prompt tokens served from cache (prefix + relocated).
Four runs, each on a flushed cache: without the flood (the baseline) and with it, at share 1 (plain
LRU) and at `--share`. Done when: with the flood and the share, A keeps its hit rate within 10% of
the baseline. The default model at `--dtype auto`, in process (no server); random token ids.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.engine.llm import LLM
from kvsplice.sampling_params import SamplingParams

REPLY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def random_ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(1000, 40000, (n,), generator=generator).tolist()


def run(llm: LLM, args: argparse.Namespace, flood: bool) -> tuple[float, float]:
    """A's hit rate over its returning turns, and the run's wall seconds (cache flushed first)."""
    llm.engine.flush_cache()
    generator = torch.Generator().manual_seed(args.seed)
    prompt = random_ids(args.history, generator)
    reused = total = 0
    started = time.perf_counter()
    for turn in range(args.turns + 1):
        [reply] = llm.generate([prompt], REPLY, owner="tenant-a")
        if turn:
            reused += reply.reuse.prefix_tokens + reply.reuse.relocated_tokens
            total += len(prompt)
        if flood:
            for _ in range(args.flood):
                llm.generate([random_ids(args.flood_tokens, generator)], REPLY, owner="tenant-b")
        prompt = prompt + list(reply.token_ids) + random_ids(args.turn_tokens, generator)
    llm.engine.check_integrity()
    return reused / total, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-slots", type=int, default=2000)
    parser.add_argument("--share", type=float, default=0.5)
    parser.add_argument("--history", type=int, default=300)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--flood", type=int, default=3)
    parser.add_argument("--flood-tokens", type=int, default=700)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(cpu_line())
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"pool {args.num_slots} slots; A: {args.history}-token history, {args.turns} returning turns of "
          f"+{args.turn_tokens} tokens; B: {args.flood} x {args.flood_tokens}-token new prompts between A's turns")
    rows = []
    for share in (1.0, args.share):
        llm = LLM(model=args.model, dtype=args.dtype, num_slots=args.num_slots, tenant_kv_share=share)
        for flood in (False, True):
            hit, wall_s = run(llm, args, flood)
            rows.append((share, flood, hit, wall_s))
        llm.engine.close()
        del llm
    baseline = rows[0][2]
    print(f"{'tenant share':>12s} {'B floods':>9s} {'A hit rate':>11s} {'vs no flood':>12s} {'wall s':>7s}")
    for share, flood, hit, wall_s in rows:
        print(f"{share:12g} {'yes' if flood else 'no':>9s} {hit:11.1%} {hit / baseline:11.2f}x {wall_s:7.1f}")
    shared_flood = rows[3][2]
    verdict = "met" if shared_flood >= 0.9 * baseline else "NOT met"
    print(f"goal (flood + share {args.share:g} within 10% of no flood): {verdict} "
          f"({shared_flood:.1%} against {baseline:.1%}; plain LRU under the flood: {rows[1][2]:.1%})")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
