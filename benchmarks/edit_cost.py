"""What an edited turn costs against the tokens it computes: time to first token of SCR's turn 2 on
the built-in edit cases, as a multiple of a cold prefill of as many tokens plus one decode step.

    python benchmarks/edit_cost.py [--model M] [--repeats 3]

One engine at the defaults (`--dtype auto`, `--weight-format auto`, `--fused-relocation auto`, SCR at
its defaults), in this
process, no HTTP. Per case (`kvsplice.bench.edit_cases.builtin_cases`) and repeat: turn 1 in a
session of its own (a 16-token greedy reply), then turn 2 timed from `add_request` to its first
token and to its second (one decode step at turn 2's context); then a cold prompt of as many
tokens as SCR computed for turn 2 (fresh token ids, a cache namespace of its own) timed to its
first token. ratio = edited TTFT / (cold TTFT of the computed tokens + the decode step), the
median of the repeats; the goal is at most 1.5. One more run of each case under cProfile splits
turn 2's time to its second token (the first token and the decode step): SCR admission (session match, diff, plan) without the relocation,
the relocation (K/V copied, keys turned), the forward (the prefill step's model call) and the rest
(scheduling, sampling, bookkeeping). Times are CPU seconds of this process (`--threads 1` by
default, so that they are not a second thread spinning while it waits): on a machine other
processes share they are inflated far less than wall time; the ratio is taken within one repeat,
and the load average is printed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from kvsplice.bench.edit_cases import builtin_cases
from kvsplice.bench.fidelity import turn1_prompt, turn2_prompt
from kvsplice.bench.machine import cpu_line
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

TURN1_REPLY = 16
# CPU seconds of this process: other processes on a shared machine inflate them far less than wall time
CLOCK = time.process_time
# the profiled functions of each phase: (file's tail, function name)
PHASES = {"admission": ("reuse_manager.py", "_admit_scr"), "relocation": ("relocate.py", "relocate_spans"),
          "forward": ("runner.py", "_forward")}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def token_times(engine, ids: list[int], **request) -> tuple[list[float], object]:
    """CPU seconds of this process (the clock: `CLOCK`) from add_request to each of the first two
    tokens, and the last output."""
    started = CLOCK()
    rid = engine.add_request(ids, greedy(2), **request)
    times = []
    while True:
        for out in engine.step():
            if out.rid != rid:
                continue
            if out.new_token_ids:
                times.append(CLOCK() - started)
            if out.finished:
                return times, out


def edited_turn(llm: LLM, case, session: str, profile: Optional[cProfile.Profile] = None) -> tuple[list[float], object, int]:
    """Turn 1 of `case` in `session`, then turn 2 timed (under `profile` when given); the engine is
    flushed afterwards. Returns turn 2's token times, its last output and its prompt length."""
    engine = llm.engine
    first = llm.generate([turn1_prompt(engine.tokenizer, case)], greedy(TURN1_REPLY), session_id=session)[0]
    ids = turn2_prompt(engine.tokenizer, case, first.text)
    if profile is not None:
        profile.enable()
    times, out = token_times(engine, ids, session_id=session)
    if profile is not None:
        profile.disable()
    engine.flush_cache()
    return times, out, len(ids)


def cold_ttft(engine, tokens: int, salt: str) -> float:
    rng = random.Random(salt)
    times, _ = token_times(engine, [rng.randrange(1000, 40000) for _ in range(tokens)], cache_salt=salt)
    return times[0]


def phases(profile: cProfile.Profile, ttft: float) -> dict[str, float]:
    """Seconds of each PHASES function (cumulative) and the rest of `ttft`; admission without relocation."""
    found = {name: 0.0 for name in PHASES}
    for (path, _, function), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
        for name, (tail, wanted) in PHASES.items():
            if path.endswith(tail) and function == wanted:
                found[name] += cumulative
    found["admission"] -= found["relocation"]
    found["other"] = max(0.0, ttft - sum(found.values()))
    return found


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--fused-relocation", default="auto", choices=("auto", "on", "off"),
                        help="as `kvsplice serve --fused-relocation` (default auto, the server's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"load average at start: {load()}")
    # the cases before the engine: their texts are docstrings of the standard library's module namespaces
    # (kvsplice.bench.workload.load_corpus), which the fused relocation's compile adds submodules to
    cases = builtin_cases()
    llm = LLM(engine=build_engine(EngineConfig(model=args.model, dtype="auto", num_slots=32_768,
                                               fused_relocation=args.fused_relocation)))
    engine = llm.engine
    cold_ttft(engine, 256, "warm")   # first shapes of a prefill, before anything is timed
    print(f"{engine.runner.weight_format.describe()}, {engine.config.dtype}, SCR defaults, "
          f"fused relocation {engine.config.fused_relocation}, "
          f"{torch.get_num_threads()} thread(s), CPU seconds")
    print("| edit | prompt | computed | edited TTFT s | cold prefill s | decode step s | ratio | "
          "admission s | relocation s | forward s | other s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for case in cases:
        runs = []
        for repeat in range(args.repeats):
            times, out, prompt = edited_turn(llm, case, f"{case.name}/{repeat}")
            computed = out.reuse.prefilled_tokens
            cold = cold_ttft(engine, computed, f"cold/{case.name}/{repeat}")
            step = times[1] - times[0]
            runs.append((times[0] / (cold + step), times[0], cold, step))
        ratio, ttft, cold, step = sorted(runs)[len(runs) // 2]
        ratios.append(ratio)
        profile = cProfile.Profile(CLOCK)
        times, _, _ = edited_turn(llm, case, f"{case.name}/profiled", profile)
        split = phases(profile, times[1])
        print(f"| {case.name} | {prompt} | {computed} | {ttft:.3f} | {cold:.3f} | {step:.3f} | {ratio:.2f} | "
              + " | ".join(f"{split[name]:.3f}" for name in ("admission", "relocation", "forward", "other"))
              + " |", flush=True)
    print(f"ratio edited TTFT / (cold prefill of its computed tokens + one decode step): "
          f"median {statistics.median(ratios):.2f}, max {max(ratios):.2f} (goal: at most 1.5)")
    print(f"load average at end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
