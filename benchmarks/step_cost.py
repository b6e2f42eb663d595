"""What a step costs when prefill tokens ride along with decode rows: the measurement behind the
step-budget defaults (--step-budget-ratio, --min-prefill-tokens).

    python benchmarks/step_cost.py [--model M] [--dtype auto] [--weight-format auto] [--decoders 1]

One engine on the default model: `--decoders` requests decode (2,000-token contexts) while one
more request prefills; for each prefill share p (tokens in the step) it times the step (best of
5, CPU seconds of this process, so other processes on the machine count less) and prints it as a
multiple of a decode-only step. The share at which a step reaches k times a decode-only step is
what `--step-budget-ratio k` lets through.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import build_engine
from kvsplice.sampling_params import SamplingParams

SHARES = (0, 4, 8, 16, 32, 64, 128, 256)


def step_cpu_s(engine, chunks) -> float:
    """Best of 5 runs of the same step (it rewrites the same slots; the arena is told so)."""
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        engine.runner.run(chunks)
        best = min(best, time.process_time() - started)
        arena = engine.runner.arena
        if arena is not None:
            arena.lengths = [length - 1 for length in arena.lengths]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument("--context", type=int, default=2000)
    args = parser.parse_args()
    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, weight_format=args.weight_format,
                                       prefix_cache=False, num_slots=32_768))
    gen = torch.Generator().manual_seed(0)
    def prompt(n):
        return torch.randint(1000, 40000, (n,), generator=gen).tolist()
    for _ in range(args.decoders):
        engine.add_request(prompt(args.context), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    decode_chunks, _ = engine.scheduler.schedule_decodes()
    engine.add_request(prompt(max(SHARES) + 1), SamplingParams(max_tokens=1, temperature=0.0))
    waiting = engine.scheduler.waiting.popleft()
    assert engine._admit(waiting)
    print(f"{engine.runner.weight_format.describe()}, {next(engine.runner.model.parameters()).dtype}, "
          f"{args.decoders} decoding request(s) at {args.context} tokens, {torch.get_num_threads()} threads")
    print(f"{'prefill tokens':>15s} {'step CPU ms':>12s} {'x decode-only':>14s}")
    from kvsplice.engine.scheduler import Chunk
    base = None
    for share in SHARES:
        chunks = decode_chunks + ([Chunk(waiting, waiting.pending[:share])] if share else [])
        seconds = step_cpu_s(engine, chunks)
        base = base or seconds
        print(f"{share:15d} {seconds * 1000:12.1f} {seconds / base:14.2f}", flush=True)


if __name__ == "__main__":
    main()
