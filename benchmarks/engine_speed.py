"""Engine speed against transformers on the same weights, in one process.

    python benchmarks/engine_speed.py [--model DIR] [--prompt-len 2048] [--decode-tokens 32]

Measures, on the default model unless --model is given:
  prefill: tokens/s of one 2,048-token prompt, kvsplice forward vs transformers forward;
  decode:  tokens/s at 1 and 8 concurrent requests (kvsplice continuous batching) vs
           transformers' generate() one request at a time;
  MFU:     prefill FLOPs/s (FlopsModel) against this CPU's measured fp32 matmul peak.
Prints a table and writes JSON (--out). Figures are ratios against the baseline run here.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.layers.forward_batch import ForwardBatch
from kvsplice.models.default_model import resolve_model
from kvsplice.reuse.accounting import FlopsModel
from kvsplice.sampling_params import SamplingParams


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of `repeats` calls (the least disturbed run)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """This CPU's fp32 peak as torch sees it: the best n x n x n matmul rate."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = best_of(lambda: a @ b, repeats)
    return 2 * n ** 3 / seconds


def prefill(llm: LLM, hf_model, prompt: list[int], repeats: int) -> dict:
    engine = llm.engine
    pool, model = engine.runner.pool, engine.runner.model
    n = len(prompt)
    slots = torch.arange(n)

    def ours():
        batch = ForwardBatch.single(torch.tensor(prompt), torch.arange(n), slots, slots, torch.arange(n))
        model(batch, pool)

    def theirs():
        with torch.inference_mode():
            hf_model(torch.tensor([prompt]), use_cache=False, logits_to_keep=1)

    ours_s, theirs_s = best_of(ours, repeats), best_of(theirs, repeats)
    cfg = engine.model_config
    flops = FlopsModel(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim,
                       cfg.num_params_non_embedding, cfg.vocab_size).prefill_flops(n, [(0, n)])
    return {"tokens": n, "kvsplice_tok_s": n / ours_s, "transformers_tok_s": n / theirs_s,
            "ratio": theirs_s / ours_s, "flops": flops, "kvsplice_flops_s": flops / ours_s}


def decode(llm: LLM, hf_model, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for batch in (1, len(prompts)):
        llm.engine.flush_cache()
        start = time.perf_counter()
        llm.generate(prompts[:batch], params)
        results[f"kvsplice_{batch}way_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    for prompt in prompts:
        with torch.inference_mode():
            hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
    results["transformers_1way_tok_s"] = len(prompts) * new_tokens / (time.perf_counter() - start)
    results["ratio_1way"] = results["kvsplice_1way_tok_s"] / results["transformers_1way_tok_s"]
    results[f"ratio_{len(prompts)}way_vs_transformers_1way"] = (
        results[f"kvsplice_{len(prompts)}way_tok_s"] / results["transformers_1way_tok_s"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    model_dir = resolve_model(args.model)
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir, prefix_cache=False)))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
    prompts = [torch.randint(100, vocab, (64,), generator=gen).tolist() for _ in range(args.concurrency)]

    peak = matmul_peak_flops()
    pre = prefill(llm, hf_model, prompt, args.repeats)
    pre["mfu"] = pre["kvsplice_flops_s"] / peak
    dec = decode(llm, hf_model, prompts, args.decode_tokens)
    report = {"model": model_dir, "threads": torch.get_num_threads(), "cpu_fp32_peak_flops": peak,
              "prefill": pre, "decode": dec}
    print(f"CPU fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    print(f"prefill {pre['tokens']} tokens: kvsplice {pre['kvsplice_tok_s']:.0f} tok/s, transformers "
          f"{pre['transformers_tok_s']:.0f} tok/s, ratio {pre['ratio']:.2f}x, MFU {pre['mfu']:.1%}")
    for key, value in dec.items():
        print(f"decode {key}: {value:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
