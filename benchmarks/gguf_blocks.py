"""GGUFLinear (GGUF blocks kept packed) against dense bf16 / fp32 matmuls of the dequantized weight.

    python benchmarks/gguf_blocks.py [--rows 1,64] [--repeats 5] [--no-head] [--threads 1]

Gemma 3 270M's matrices, in the block formats its Q4_K_M GGUF stores them in (attn_output Q4_K,
ffn_up Q5_0, ffn_down Q6_K, the tied embedding / lm_head Q8_0), filled with random blocks (finite
fp16 scales), so no model file is needed. For each and each row count: the fastest time of the
packed product (`GGUFLinear.__call__`: the int4 planes up to `small_batch_rows` rows, else row
blocks; Q6_K always row blocks) against F.linear with the dense bf16 copy, both with bf16
activations, and against the dense fp32 copy, both with fp32 activations, as ratios to the packed
one; and the bytes each holds.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch
from torch.nn import functional as F

from kvsplice.bench.machine import cpu_line
from kvsplice.layers.gguf_blocks import BLOCK_FORMATS
from kvsplice.layers.gguf_linear import GGUFLinear

# (name, GGUF type, out features, in features), as gemma-3-270m-q4_k_m.gguf has them
MATRICES = [("attn_output", "Q4_K", 640, 1024), ("ffn_up", "Q5_0", 2048, 640),
            ("ffn_down", "Q6_K", 640, 2048)]
HEAD = ("lm_head", "Q8_0", 262144, 640)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int) -> torch.Tensor:
    """GGUF bytes of a [rows, cols] weight: random bytes with finite fp16 scales."""
    fmt = BLOCK_FORMATS[type_name]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for start in FP16_FIELDS[type_name]:
        halves = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def fastest_ms(call, repeats: int) -> float:
    """The fastest of `repeats` calls (after one warm-up): on a shared machine a median measures
    the neighbours' load as much as the call."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def bench_matrix(name: str, type_name: str, rows: int, cols: int, row_counts: list[int], repeats: int) -> None:
    linear = GGUFLinear.from_blocks(random_blocks(type_name, rows, cols), type_name, cols)
    dense32 = linear.dequantized()
    dense16 = dense32.bfloat16()
    sizes = (linear.nbytes(), dense16.numel() * 2, dense32.numel() * 4)
    print(f"{name} {type_name} [{rows}, {cols}]  bytes: packed {sizes[0] / 2**20:.1f} MiB, "
          f"bf16 x{sizes[1] / sizes[0]:.2f}, fp32 x{sizes[2] / sizes[0]:.2f}")
    for m in row_counts:
        x = torch.randn(m, cols)
        x16 = x.bfloat16()
        packed16 = fastest_ms(lambda: linear(x16), repeats)
        packed32 = fastest_ms(lambda: linear(x), repeats)
        bf16 = fastest_ms(lambda: F.linear(x16, dense16), repeats)
        fp32 = fastest_ms(lambda: F.linear(x, dense32), repeats)
        print(f"  {m:3d} rows  bf16 x: packed {packed16:8.3f} ms, dense {bf16:8.3f} ms (x{bf16 / packed16:.2f})   "
              f"fp32 x: packed {packed32:8.3f} ms, dense {fp32:8.3f} ms (x{fp32 / packed32:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64", help="comma list of activation row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-head", action="store_true", help="skip the [262144, 640] lm_head")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1 by default: on a shared machine, more threads time "
                             "each other's waits)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    row_counts = [int(n) for n in args.rows.split(",")]
    print(cpu_line(), f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("ratios: dense time / packed time (above 1: packed faster), dense bytes / packed bytes")
    for matrix in MATRICES + ([] if args.no_head else [HEAD]):
        bench_matrix(*matrix, row_counts, args.repeats)
        gc.collect()         # the head's dense copies (1 GB) go before the next matrix


if __name__ == "__main__":
    main()
