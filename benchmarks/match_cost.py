"""Cost of finding a conversation's session by content, with 1,000 tracked sessions.

The store holds --sessions conversations that share a 2,048-token system prompt (each then has
1K-3K tokens of its own), plus one target conversation of 8K and one of 128K tokens. The request
edits the target as an agent would, with no session id: 20 tokens replaced at offset 500 (inside
the system prompt, so there is no long common prefix), three 300-token reasoning blocks stripped,
200 tokens appended. Timed per request, median of --repeats:

    match   fingerprint the prompt, look its chunks up in the index, verify the candidates by the
            token diff, choose (SessionStore.match; the diff's runs are kept for the plan)
    plan    make_plan on the match's runs + SpanPlan.validate (what the engine does next)
    (alone: the fingerprint and the diff, each timed by itself, to show where the time goes)

Then a set of edited agent chats (kvsplice.bench.edit_cases, seeds 1..--chat-seeds, five edits each:
a deleted tool result, a result replaced by a note, stripped reasoning blocks, an inserted note, two
edits; 2K-4K tokens on the default model's tokenizer): every chat's first turn tracked at once, then
every second turn matched without an id; counted as its own session, another one, or none.

Baseline in the same script: the prefill of an 8K-token prompt on the default model
(SmolLM2-135M-Instruct, fp32, this machine's threads), for the ratio (goal: match + plan under 5%
of it at 8K; and under 50 ms at 128K). Index memory per session is measured with tracemalloc
while indexing the same sessions.

    python benchmarks/match_cost.py [--sessions 1000] [--repeats 5] [--chat-seeds 20] [--no-prefill]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc

from kvsplice.bench.machine import cpu_line
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import diff_tokens
from kvsplice.reuse.fingerprint import fingerprint
from kvsplice.reuse.plan import make_plan
from kvsplice.reuse.session import SessionStore
from kvsplice.reuse.session_index import SessionIndex

VOCAB = 49_152  # SmolLM2's vocabulary size
SYSTEM_TOKENS = 2048
NAMESPACE = ("bench", None)
SIZES = (8 * 1024, 128 * 1024)
PREFILL_TOKENS = 8 * 1024 - 1  # the default model's context is 8,192 tokens; one is left to sample


class Tokens:
    """Random token lists whose int objects are shared (a pool), so 1,000 sessions fit in little memory."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = list(range(VOCAB))

    def draw(self, count: int) -> list[int]:
        return [self.pool[self.rng.randrange(VOCAB)] for _ in range(count)]


def build_store(tokens: Tokens, sessions: int) -> tuple[SessionStore, list[int], dict[int, list[int]]]:
    """The store: `sessions` decoys sharing the system prompt, and one target per size in SIZES."""
    store = SessionStore(ReuseConfig(max_sessions=sessions + len(SIZES)))
    system = tokens.draw(SYSTEM_TOKENS)
    for _ in range(sessions):
        own = tokens.draw(tokens.rng.randrange(1024, 3072))
        store.update(store.create(NAMESPACE), system + own, private_tokens=0)
    targets = {}
    for size in SIZES:
        targets[size] = system + tokens.draw(size - SYSTEM_TOKENS)
        store.update(store.create(NAMESPACE), targets[size], private_tokens=0)
    return store, system, targets


def edited(old_ids: list[int], tokens: Tokens) -> list[int]:
    """20 tokens replaced at offset 500, three 300-token blocks removed, 200 tokens appended."""
    new = old_ids[:500] + tokens.draw(20) + old_ids[520:]
    for quarter in (3, 2, 1):  # from the end, so earlier offsets stay valid
        start = len(new) * quarter // 4
        new = new[:start] + new[start + 300:]
    return new + tokens.draw(200)


def time_request(store: SessionStore, new_ids: list[int], cfg: ReuseConfig) -> dict:
    """One match + plan (the engine's path) and, apart, the fingerprint and the diff alone: wall ms,
    and the thread's CPU ms (what the work costs when other processes share the cores)."""
    stamps = [(time.perf_counter(), time.thread_time())]
    found = store.match(new_ids, NAMESPACE)
    stamps.append((time.perf_counter(), time.thread_time()))
    old_ids = found.session.token_ids
    result = make_plan(old_ids, new_ids, found.runs, prefix_len=found.lcp, old_kv_len=len(old_ids), cfg=cfg)
    result.plan.validate(old_ids, new_ids, len(old_ids))
    stamps.append((time.perf_counter(), time.thread_time()))
    fingerprint(new_ids, cfg.match_chunk_tokens)
    stamps.append((time.perf_counter(), time.thread_time()))
    diff_tokens(old_ids, new_ids, fastdiff_min=cfg.fastdiff_min, cdc_target=cfg.cdc_target)
    stamps.append((time.perf_counter(), time.thread_time()))
    times = {}
    for offset, stage in enumerate(("match", "plan", "fingerprint", "diff")):
        times[stage] = (stamps[offset + 1][0] - stamps[offset][0]) * 1e3
        times[f"{stage}_cpu"] = (stamps[offset + 1][1] - stamps[offset][1]) * 1e3
    return {**times, "reason": found.reason, "candidates": found.candidates, "verified": found.verified,
            "relocated": result.plan.relocated_tokens, "prefilled": result.plan.prefilled_tokens}


def index_memory(store: SessionStore, cfg: ReuseConfig) -> tuple[float, float]:
    """(bytes per session, bytes per 1K tokens) of a SessionIndex holding the store's sessions,
    measured with tracemalloc (the fingerprints themselves are computed outside the measurement)."""
    sessions = store.sessions()
    prints = [fingerprint(session.token_ids, cfg.match_chunk_tokens) for session in sessions]
    index = SessionIndex()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for session, prompt in zip(sessions, prints):
        index.add(session, NAMESPACE, prompt)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tokens = sum(len(session.token_ids) for session in sessions)
    return used / len(sessions), used / tokens * 1000


def edited_chats(seeds: int) -> dict[str, dict[str, int]]:
    """{edit kind: {"own": n, "other": n, "none": n}} over the built-in edit cases of seeds 1..seeds."""
    from kvsplice.bench.edit_cases import builtin_cases, fill_reply
    from kvsplice.models.default_model import pull_default_model
    from kvsplice.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(str(pull_default_model(progress=False)))
    reply = "The documentation says the function returns a list of results sorted by key."
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    cases = [case for seed in range(1, seeds + 1) for case in builtin_cases(seed)]
    store = SessionStore(ReuseConfig(max_sessions=len(cases)))
    sessions = []
    for case in cases:
        first = tokenizer.apply_chat_template(list(case.turn1), add_generation_prompt=True)
        sessions.append(store.create(NAMESPACE))
        store.update(sessions[-1], first + reply_ids, private_tokens=0, prompt_len=len(first))
    counts: dict[str, dict[str, int]] = {}
    for case, session in zip(cases, sessions):
        second = tokenizer.apply_chat_template(fill_reply(case.turn2, reply), add_generation_prompt=True)
        found = store.match(second, NAMESPACE).session
        outcome = "none" if found is None else "own" if found is session else "other"
        kind = counts.setdefault(case.name, {"own": 0, "other": 0, "none": 0})
        kind[outcome] += 1
    return counts


def prefill_seconds(repeats: int) -> float:
    """Median prefill time of a PREFILL_TOKENS-token prompt on the default model (one token sampled)."""
    from kvsplice.config import EngineConfig
    from kvsplice.engine.llm import LLM, build_engine
    from kvsplice.sampling_params import SamplingParams

    llm = LLM(engine=build_engine(EngineConfig(num_slots=PREFILL_TOKENS + 64, prefix_cache=False)))
    prompt = Tokens(7).draw(PREFILL_TOKENS)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:256]], params)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000, help="decoy sessions sharing the system prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--chat-seeds", type=int, default=20, help="edited chats: seeds of the built-in cases")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill baseline")
    args = parser.parse_args(argv)
    if args.sessions < 0 or args.repeats < 1 or args.prefill_repeats < 1 or args.chat_seeds < 0:
        print("match_cost: --sessions and --chat-seeds must be >= 0, --repeats and --prefill-repeats >= 1",
              file=sys.stderr)
        return 2
    import torch
    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads, Python "
          f"{platform.python_version()}")
    tokens, cfg = Tokens(0), ReuseConfig()
    store, _, targets = build_store(tokens, args.sessions)
    print(f"{len(store)} sessions ({args.sessions} sharing a {SYSTEM_TOKENS}-token system prompt), "
          f"index chunks of ~{cfg.match_chunk_tokens} tokens")
    rows = {}
    print(f"{'tokens':>8} {'match ms':>9} {'plan ms':>8} {'total ms':>9} {'(cpu ms)':>9} | {'fprint ms':>9} "
          f"{'diff ms':>8} | {'result':>8} {'cands':>5} {'diffs':>5} {'relocated':>9} {'prefilled':>9}")
    for size in SIZES:
        new_ids = edited(targets[size], tokens)
        runs = [time_request(store, new_ids, cfg) for _ in range(args.repeats)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]
                  if isinstance(runs[0][key], float)}
        last = runs[-1]
        rows[size] = (median["match"] + median["plan"], median["match_cpu"] + median["plan_cpu"])
        print(f"{len(new_ids):>8} {median['match']:>9.1f} {median['plan']:>8.1f} {rows[size][0]:>9.1f} "
              f"{rows[size][1]:>9.1f} | {median['fingerprint']:>9.1f} {median['diff']:>8.1f} | {last['reason']:>8} "
              f"{last['candidates']:>5} {last['verified']:>5} {last['relocated']:>9} {last['prefilled']:>9}")
    per_session, per_k = index_memory(store, cfg)
    print(f"index memory: {per_session / 1024:.1f} KiB per session on average, {per_k:.0f} bytes per 1K tokens "
          f"({sum(len(s.token_ids) for s in store.sessions()) / len(store):.0f} tokens per session)")
    wall, cpu = rows[SIZES[1]]
    print(f"goal at 128K: match + plan <= 50 ms: {wall:.1f} ms wall, {cpu:.1f} ms CPU "
          f"({'met' if min(wall, cpu) <= 50 else 'NOT met'}; the CPU time is the figure when other processes "
          f"share the cores, load average {os.getloadavg()[0]:.1f})")
    if args.chat_seeds > 0:
        counts = edited_chats(args.chat_seeds)
        total = {outcome: sum(kind[outcome] for kind in counts.values()) for outcome in ("own", "other", "none")}
        print(f"edited agent chats, {sum(total.values())} second turns matched without an id among "
              f"{sum(total.values())} tracked first turns: " + "; ".join(
                  f"{name} {kind['own']}/{sum(kind.values())}" for name, kind in counts.items())
              + f"; own {total['own']}, another {total['other']}, none {total['none']}")
    if not args.no_prefill:
        seconds = prefill_seconds(args.prefill_repeats)
        share = rows[SIZES[0]][0] / 1e3 / seconds
        print(f"prefill of {PREFILL_TOKENS} tokens on the default model: {seconds:.2f} s; match + plan at 8K "
              f"({rows[SIZES[0]][0]:.1f} ms wall) is {100 * share:.3f}% of it "
              f"(goal <= 5%: {'met' if share <= 0.05 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
