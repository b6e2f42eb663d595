"""Shape buckets: the row counts bf16 / fp16 kernels are run at, so that their number stays bounded.

On CPU, oneDNN matmuls and the brgemm kernels of `scaled_dot_product_attention` in bf16 / fp16
are generated for each shape they see, and their code is kept for the life of the process
(docs/BENCHMARKS_HISTORY.md, "Soak: hostile and ordinary traffic against one server"). A server
sees any row count up to --max-batch-tokens and any context length, so without rounding its
memory grows with every new shape for hours. Callers pad to `bucket(n)` (zero rows, or keys masked out) and slice the result:

    n          1  2  3  4  5..8  9..16  ...  33..64   65..128  129..192  ...
    bucket(n)  1  2  4  4  8     16          64       128      192        (multiples of BUCKET)

Small counts round to a power of two: a product of a few rows is bound by reading its weight, so 5
rows cost what 8 do. Above BUCKET the padding is at most BUCKET - 1 rows. fp32 kernels do not keep
per-shape code this way (measured over the same sweep), so they are not padded.
"""

from __future__ import annotations

import torch

BUCKET = 64
PADDED_DTYPES = (torch.bfloat16, torch.float16)


def bucket(n: int) -> int:
    """`n` (>= 1) rounded up: to a power of two up to BUCKET, above it to a multiple of BUCKET."""
    if n <= BUCKET:
        return 1 << (n - 1).bit_length()
    return -(-n // BUCKET) * BUCKET
