"""Cold prefill of 2,048 tokens at the defaults with the batch-invariant 32-row bf16 calls on and off.

    python benchmarks/row_tile_cost.py

One engine at the defaults (compiled decode off, so only prefill is timed). Every PackedLinear's
`row_tile` is switched between 32 (the default: products above 8 rows in calls of at most 32 rows,
so a row's bits do not depend on its batch) and None (one call per product), alternating, and the
fastest of three fresh random 2,048-token prompts is printed for each setting, with the ratio.
"""
import random
import time

import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.engine.llm import LLM
from kvsplice.layers.quant_linear import PackedLinear
from kvsplice.sampling_params import SamplingParams

PROMPT_TOKENS, REPEATS = 2048, 3


def packed_linears(llm: LLM) -> list[PackedLinear]:
    """Every PackedLinear the engine's model holds (found through its modules and attributes)."""
    found, seen = {}, set()

    def walk(obj, depth: int) -> None:
        if id(obj) in seen or depth > 6 or isinstance(obj, (torch.Tensor, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, PackedLinear):
            found[id(obj)] = obj
            return
        children = list(getattr(obj, "__dict__", {}).values())
        if isinstance(obj, torch.nn.Module):
            children += list(obj.modules())[1:]
        for child in children:
            for item in (child if isinstance(child, (list, tuple)) else [child]):
                if hasattr(item, "__dict__"):
                    walk(item, depth + 1)

    walk(llm.engine, 0)
    return list(found.values())


def fastest_prefill(llm: LLM, linears: list[PackedLinear], tile) -> float:
    """Seconds of the fastest of REPEATS fresh prompts (one output token) with `row_tile` = tile."""
    for linear in linears:
        linear.row_tile = tile
    params, times = SamplingParams(max_tokens=1, temperature=0.0), []
    for _ in range(REPEATS):
        ids = [random.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
        start = time.perf_counter()
        llm.generate(ids, params, cache_salt=f"fresh-{random.random()}")
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    print(cpu_line())
    llm = LLM(compile_decode="off")
    linears = packed_linears(llm)
    print(f"packed linears: {len(linears)}")
    results = {32: [], None: []}
    for tile in (32, None, 32, None):
        results[tile].append(fastest_prefill(llm, linears, tile))
        print(f"row_tile {tile}: cold prefill {PROMPT_TOKENS} tokens {results[tile][-1]:.3f} s")
    print(f"32-row calls / one call: {min(results[32]) / min(results[None]):.3f}x")


if __name__ == "__main__":
    main()
