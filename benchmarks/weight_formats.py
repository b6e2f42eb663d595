"""Fidelity of each dtype / weight format against the fp32 dense model, on the SCR edit cases.

    python benchmarks/weight_formats.py [--model M] [--formats float32:dense,bfloat16:dense,...]

For each built-in edit case (`kvsplice.bench.edit_cases`, 1.5K-4K-token agent chats; turn 2 with a
fixed reply), each format computes the whole prompt (no cache) and 32 greedy tokens; against the
fp32 dense engine: KL(fp32 || format) in nats over the last 32 prompt positions (mean, p90, max;
`kvsplice.bench.fidelity.kl_per_position`), top-1 agreement there, and the fraction of the 32
greedy tokens equal before the first divergence. The formats are what `--dtype` / `--weight-format`
select (`kvsplice.models.quantize`). SCR's own figures for comparison: mean KL 0.00145 at K=6,
tail=16 without selective recompute, 0.00055 at its defaults (docs/BENCHMARKS.md, SCR fidelity and
the fidelity front).
"""

from __future__ import annotations

import argparse
import gc
import time

from kvsplice.bench.edit_cases import builtin_cases, fill_reply
from kvsplice.bench.fidelity import greedy_prefix_fraction, kl_per_position, percentile, top1_agreement
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

DEFAULT_FORMATS = "float32:dense,bfloat16:dense,bfloat16:auto,bfloat16:int8,bfloat16:int4"
POSITIONS, GEN_TOKENS = 32, 32


def run_format(model, dtype: str, fmt: str, prompts: list[list[int]]):
    llm = LLM(engine=build_engine(EngineConfig(model=model, dtype=dtype, weight_format=fmt, prefix_cache=False,
                                               num_slots=8192)))
    params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    results = [llm.generate([p], params, keep_last_logits=POSITIONS)[0] for p in prompts]
    return results, llm.engine.runner.weight_format.describe(), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma list of dtype:weight_format")
    args = parser.parse_args()
    formats = [tuple(item.split(":")) for item in args.formats.split(",")]

    tokenizer = build_engine(EngineConfig(model=args.model, num_slots=64)).tokenizer
    prompts = [tokenizer.apply_chat_template(fill_reply(case.turn2, "I will read the next file now."),
                                             add_generation_prompt=True) for case in builtin_cases()]
    reference, _, _ = run_format(args.model, "float32", "dense", prompts)
    gc.collect()
    print(f"{len(prompts)} edit cases, {sum(map(len, prompts))} prompt tokens; KL(fp32 dense || format) over the "
          f"last {POSITIONS} prompt positions, greedy agreement over {GEN_TOKENS} tokens\n")
    print(f"{'dtype':10s} {'--weight-format':16s} {'resolved':22s} {'KL mean':>9s} {'KL p90':>9s} {'KL max':>9s} "
          f"{'top-1':>6s} {'greedy':>7s} {'run s':>6s}")
    for dtype, fmt in formats:
        results, resolved, seconds = run_format(args.model, dtype, fmt, prompts)
        kls = [kl for ref, res in zip(reference, results)
               for kl in kl_per_position(ref.prompt_logits, res.prompt_logits).values()]
        top1 = sum(top1_agreement(ref.prompt_logits, res.prompt_logits) for ref, res in zip(reference, results))
        greedy = sum(greedy_prefix_fraction(ref.token_ids, res.token_ids) for ref, res in zip(reference, results))
        print(f"{dtype:10s} {fmt:16s} {resolved:22s} {sum(kls) / len(kls):9.5f} {percentile(kls, 0.9):9.5f} "
              f"{max(kls):9.5f} {top1 / len(results):6.1%} {greedy / len(results):7.1%} {seconds:6.1f}", flush=True)
        del results
        gc.collect()


if __name__ == "__main__":
    main()
