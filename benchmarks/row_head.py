"""One decode row's lm_head: the checkpoint's Q8_0 blocks (the row head) against the bf16 head.

    python benchmarks/row_head.py [--calls 300] [--threads 1,2]

On the default model (its tied embedding is Q8_0 in the GGUF), as `kvsplice serve --compile-decode`
uses them: the bf16 head as `FastDecoder` holds it (prepacked for oneDNN where bf16 is native) and
`BlockInt8Head` on `Checkpoint.head_blocks` (kvsplice.layers.block_int8_head). Prints, per thread
count, the median time of one row's logits on each and their ratio (both timed in the same loop,
alternating), with the weights in cache and with a 256 MB buffer rewritten before every call (the
weights then come from memory, as in a decode step); and, on the final hidden rows of the built-in edit cases' last 32 prompt positions
(taken from the reference model's lm_head input), KL(exact head || each head) in nats, where the
exact head is the checkpoint's own weights in float64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsplice.bench.edit_cases import builtin_cases, fill_reply  # noqa: E402
from kvsplice.bench.machine import cpu_line  # noqa: E402
from kvsplice.config import EngineConfig  # noqa: E402
from kvsplice.engine.llm import LLM, build_engine  # noqa: E402
from kvsplice.layers.block_int8_head import BlockInt8Head  # noqa: E402
from kvsplice.layers.quant_linear import PackedLinear  # noqa: E402
from kvsplice.models.default_model import find_default_gguf, pull_default_model  # noqa: E402
from kvsplice.models.loader import load_checkpoint  # noqa: E402
from kvsplice.sampling_params import SamplingParams  # noqa: E402

POSITIONS = 32
FLUSH_BYTES = 256 * 2 ** 20   # rewritten between timed calls: more than the last-level cache holds


def head_inputs(llm: LLM) -> torch.Tensor:
    """The bf16 rows the reference model's lm_head takes at the last POSITIONS prompt positions of
    every built-in edit case (turn 2, whole prompt computed), collected by a forward hook."""
    rows = []
    hook = llm.engine.runner.model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0]))
    try:
        for case in builtin_cases():
            ids = llm.tokenizer.apply_chat_template(fill_reply(case.turn2, "I will read the next file now."),
                                                    add_generation_prompt=True)
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0), keep_last_logits=POSITIONS)
    finally:
        hook.remove()
    return torch.cat(rows)


def kl(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """KL(softmax(exact) || softmax(approx)) per row, in float64."""
    log_p, log_q = exact.double().log_softmax(-1), approx.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def timed(heads: dict, row: torch.Tensor, calls: int, flush: torch.Tensor | None) -> dict[str, float]:
    """Median ms of one call of each head, calls alternating between them; with `flush`, that
    buffer is rewritten before every call, so the head's weights come from memory, as they do
    in a decode step (where the model's other weights pass through the caches between heads)."""
    times = {name: [] for name in heads}
    for _ in range(calls):
        for name, head in heads.items():
            if flush is not None:
                flush.add_(1)
            started = time.perf_counter()
            head(row)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    model = str(find_default_gguf() or pull_default_model(progress=False))
    print(f"cpu: {cpu_line()}; torch {torch.__version__}")
    llm = LLM(engine=build_engine(EngineConfig(model=model, dtype="bfloat16", weight_format="auto",
                                               fast_path=False, prefix_cache=False, num_slots=8192)))
    decoder = llm.engine.runner.model
    blocks = load_checkpoint(model, torch.bfloat16, head_blocks=True).head_blocks
    if blocks is None:
        print("the model's lm_head is not stored as int8 blocks: no row head")
        return 0
    dense = PackedLinear.build([decoder.lm_head.weight], [None], "dense")
    thread_counts = tuple(int(t) for t in args.threads.split(","))
    row_head = BlockInt8Head(blocks, torch.bfloat16, thread_counts)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    with torch.inference_mode():
        rows = head_inputs(llm)
        exact = rows.double() @ blocks.dequantize().double().t()
        bf16_kl = kl(exact, dense(rows).float())
        row_kl = torch.cat([kl(exact[i:i + 1], row_head(rows[i:i + 1])) for i in range(rows.shape[0])])
        print(f"{rows.shape[0]} head rows (the built-in edit cases' last {POSITIONS} prompt positions); "
              f"KL(exact head || head), nats:")
        for name, values in (("bf16 head", bf16_kl), ("row head (Q8_0 blocks)", row_kl)):
            print(f"  {name:24s} mean {values.mean():.2e}  max {values.max():.2e}")
        row = rows[-1:].contiguous()
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for label, buffer in (("weights in cache", None), ("weights from memory", flush)):
                ms = timed({"bf16": dense, "row": row_head}, row, args.calls, buffer)
                print(f"threads {threads}, {label}: one row's logits, bf16 head {ms['bf16']:.2f} ms, "
                      f"row head {ms['row']:.2f} ms (bf16 / row {ms['bf16'] / ms['row']:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
