"""The lm_head of a few decode rows: the checkpoint's Q8_0 blocks on the C kernel (the row head)
against the bf16 head.

    python benchmarks/row_head.py [--model PATH] [--rows 1,2,4,8] [--calls 200] [--threads 1,2]

On the default model (its tied embedding is Q8_0 in the GGUF) or `--model` (Gemma 3 270M's GGUF),
as `kvsplice serve` uses them: the bf16 head as `FastDecoder` holds it (prepacked for oneDNN where
bf16 is native) and `BlockInt8Head` on `Checkpoint.head_blocks` (kvsplice.layers.block_int8_head).
Prints, per thread count and row count, the median time of the logits on each and their ratio
(both timed in the same loop, alternating), with the weights in cache and with a 256 MB buffer
rewritten before every call (the weights then come from memory, as in a decode step); the time to
read the int8 weights once (their max: the machine's read bandwidth); and,
on the final hidden rows of the built-in edit cases' last 32 prompt positions (taken from the
reference model's lm_head input), KL(exact head || each head) in nats, where the exact head is the
checkpoint's own weights in float64.
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
FLUSH_BYTES = 256 * 2 ** 20   # rewritten between timed calls: more than this machine's caches hold of it


def head_inputs(llm: LLM) -> torch.Tensor:
    """The bf16 rows the reference model's lm_head takes at the last POSITIONS prompt positions of
    every built-in edit case (turn 2, whole prompt computed; without a chat template, its messages'
    texts one per line), collected by a forward hook."""
    rows = []
    hook = llm.engine.runner.model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0]))
    try:
        for case in builtin_cases():
            messages = fill_reply(case.turn2, "I will read the next file now.")
            if llm.tokenizer.has_chat_template:
                ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            else:
                ids = llm.tokenizer.encode("\n".join(str(m["content"]) for m in messages))
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0), keep_last_logits=POSITIONS)
    finally:
        hook.remove()
    return torch.cat(rows)


def kl(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """KL(softmax(exact) || softmax(approx)) per row, in float64."""
    log_p, log_q = exact.double().log_softmax(-1), approx.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def timed(heads: dict, rows: torch.Tensor, calls: int, flush: torch.Tensor | None) -> dict[str, float]:
    """Median ms of one call of each head, calls alternating between them; with `flush`, that
    buffer is rewritten before every call, so the head's weights come from memory, as they do
    in a decode step (where the model's other weights pass through the caches between heads)."""
    times = {name: [] for name in heads}
    for _ in range(calls):
        for name, head in heads.items():
            if flush is not None:
                flush.add_(1)
            started = time.perf_counter()
            head(rows)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def report_kl(llm: LLM, dense: PackedLinear, row_head: BlockInt8Head, blocks) -> None:
    """KL of the bf16 head and of the row head against the exact head, on the edit cases' rows."""
    rows = head_inputs(llm)
    exact = rows.double() @ blocks.dequantize().double().t()
    bf16_kl = kl(exact, dense(rows).float())
    row_kl = torch.cat([kl(exact[i:i + 8], row_head(rows[i:i + 8])) for i in range(0, rows.shape[0], 8)])
    print(f"{rows.shape[0]} head rows (the built-in edit cases' last {POSITIONS} prompt positions); "
          f"KL(exact head || head), nats:")
    for name, values in (("bf16 head", bf16_kl), ("row head (Q8_0 blocks)", row_kl)):
        print(f"  {name:24s} mean {values.mean():.2e}  max {values.max():.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF or model directory (default: the default model)")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    model = args.model or str(find_default_gguf() or pull_default_model(progress=False))
    print(f"cpu: {cpu_line()}; torch {torch.__version__}; model {Path(model).name}")
    llm = LLM(engine=build_engine(EngineConfig(model=model, dtype="bfloat16", weight_format="dense",
                                               fast_path=False, prefix_cache=False, num_slots=8192)))
    decoder = llm.engine.runner.model
    blocks = load_checkpoint(model, torch.bfloat16, head_blocks=True).head_blocks
    if blocks is None:
        print("the model's lm_head is not stored as int8 blocks: no row head")
        return 0
    dense = PackedLinear.build([decoder.lm_head.weight], [None], "dense")
    row_head = BlockInt8Head(blocks, torch.bfloat16)
    print(f"row head: {blocks.out_features} x {blocks.in_features}, kernel path {row_head.code_path}; "
          f"int8 {blocks.values.numel() / 2 ** 20:.0f} MiB, bf16 {dense.out_features * blocks.in_features / 2 ** 19:.0f} MiB")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    with torch.inference_mode():
        report_kl(llm, dense, row_head, blocks)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            read = timed({"max": lambda _: blocks.values.max()}, None, args.calls // 4, flush)["max"]
            print(f"threads {threads}: reading the int8 weights once (their max, from memory) {read:.2f} ms")
            for count in (int(r) for r in args.rows.split(",")):
                rows = torch.randn(count, blocks.in_features).bfloat16()
                for label, buffer in (("weights in cache", None), ("weights from memory", flush)):
                    ms = timed({"bf16": dense, "row": row_head}, rows, args.calls, buffer)
                    print(f"threads {threads}, {count} row(s), {label}: bf16 head {ms['bf16']:.2f} ms, "
                          f"row head {ms['row']:.2f} ms (bf16 / row {ms['bf16'] / ms['row']:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
