"""The disk tier's two costs, in one run: loading a 4K-token history against prefilling it, and a
decode stream's inter-token latency while the tier writes.

    python benchmarks/disk_tier.py [--tokens 4096] [--dir /var/tmp] [--repeats 5] [--model M]
                                   [--stream-tokens 200] [--flood-tokens 384]

Load: the K/V shape is the model's (read from its config.json: the default SmolLM2-135M-Instruct
has 30 layers, 3 KV heads of 64) in the engine's dtype ("auto": bf16 where the CPU has it). One
entry of `--tokens` tokens is written to a tier under `--dir`, then loaded back and copied into a KV
pool's slots (what an engine does on a tier hit), `--repeats` times from the page cache ("warm")
and with the file's pages dropped first ("cold": posix_fadvise DONTNEED, so the read goes to the
disk), alternately. Then an engine prefills a prompt of `--tokens` random tokens (max_tokens=1,
prefix cache off), after a short warm-up prefill. Wall-clock and CPU seconds of this process (CPU
time counts less of what other processes on the machine take), median of the repeats.

Decode while the tier writes: an in-process server with a pool of 4 x --flood-tokens slots streams
one completion of --stream-tokens tokens while a second client sends prompts of --flood-tokens
fresh random tokens one after the other, so the pool evicts all the time; once without a disk tier
and once with one (which then writes every finished prompt and every evicted run). The stream's
inter-token gaps: p50 and p99, the tier's against none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.cache.disk_tier import DiskTier, DiskTierConfig, kv_into_pool
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.tier_format import EntryKey, TierEntry, TierIdentity, dtype_name
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, resolve_auto_dtype
from kvsplice.models.config import ModelConfig
from kvsplice.models.default_model import resolve_model
from kvsplice.sampling_params import SamplingParams
from kvsplice.server.api import ServerSettings
from kvsplice.server.launch import ServerThread, build_app
from kvsplice.server.request_log import RequestLog


def model_identity(model: str | None, dtype: torch.dtype) -> TierIdentity:
    path = resolve_model(model)
    config = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    return TierIdentity(model=str(path), dtype=dtype_name(dtype), weight_format="auto",
                        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_load(tier: DiskTier, entry: TierEntry, pool: KVPool, cold: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one get() + copying the K/V into pool slots."""
    if cold:
        drop_page_cache(next(tier.config.dir.glob("entries/*/*.kvt")))
    slots = torch.arange(entry.num_tokens)
    started, started_cpu = time.perf_counter(), time.process_time()
    loaded = tier.get(entry.key, token_ids=entry.token_ids)
    kv_into_pool(pool, slots, loaded.kv)
    wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    assert torch.equal(pool.k[:, slots], entry.kv[:, 0])
    return wall, cpu


def measure_loads(args, identity: TierIdentity, dtype: torch.dtype, token_ids: torch.Tensor):
    """(entry MiB, write seconds, {"warm": [(wall, cpu)], "cold": [...]})."""
    kv = torch.randn(identity.num_layers, 2, args.tokens, identity.num_kv_heads, identity.head_dim).to(dtype)
    entry = TierEntry(EntryKey.for_prefix("bench", token_ids), token_ids, 0, kv)
    pool = KVPool(args.tokens, identity.num_layers, identity.num_kv_heads, identity.head_dim, dtype=dtype)
    pool.k.fill_(1.0)
    pool.v.fill_(1.0)                   # the pool's pages touched, as a serving engine's are
    times = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        with DiskTier(DiskTierConfig(Path(directory), budget_bytes=1 << 31), identity) as tier:
            started = time.perf_counter()
            tier.put(entry)
            tier.wait_writes()
            write_s = time.perf_counter() - started
            for _ in range(args.repeats):
                for kind in times:
                    times[kind].append(time_load(tier, entry, pool, cold=kind == "cold"))
            size = tier.stats().bytes_used
    return size / 2**20, write_s, times


def measure_prefill(args, token_ids: torch.Tensor) -> tuple[float, float]:
    llm = LLM(model=args.model, dtype=args.dtype, prefix_cache=False, num_slots=args.tokens + 64)
    try:
        warm_up = torch.randint(1000, 40000, (min(args.tokens, 128),)).tolist()
        llm.generate(warm_up, SamplingParams(max_tokens=1, temperature=0.0))    # kernels picked, caches warm
        started, started_cpu = time.perf_counter(), time.process_time()
        llm.generate(token_ids.tolist(), SamplingParams(max_tokens=1, temperature=0.0))
        return time.perf_counter() - started, time.process_time() - started_cpu
    finally:
        llm.engine.close()


def stream_gaps(url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds between the streamed tokens of one completion (the first token's wait left out)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]


def flood(url: str, tokens: int, stop: threading.Event, counts: list[int]) -> None:
    """Fresh prompts one after the other until `stop`: each evicts an earlier one from the pool."""
    generator = torch.Generator().manual_seed(7)
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            prompt = torch.randint(1000, 40000, (tokens,), generator=generator).tolist()
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
            client.post(f"{url}/v1/completions", json=body).raise_for_status()
            counts[0] += 1


def measure_decode(args, tier_dir: str | None) -> tuple[list[float], int, str]:
    """The stream's inter-token gaps with the flood running, (gaps, flood prompts, tier line)."""
    tier = DiskTierConfig.from_gb(tier_dir, 4.0, write_queue_size=4096) if tier_dir else None
    config = EngineConfig(model=args.model, dtype=args.dtype, num_slots=4 * args.flood_tokens + args.stream_tokens + 64,
                          disk_tier=tier)
    quiet = open(os.devnull, "w")                               # no request log lines in the output
    app = build_app(config, ServerSettings(model_path=args.model), RequestLog(quiet))
    server = ServerThread(app)
    server.start(timeout_s=300)
    stop, counts = threading.Event(), [0]
    try:
        prompt = torch.randint(1000, 40000, (64,), generator=torch.Generator().manual_seed(3)).tolist()
        stream_gaps(server.url, prompt, 8)                      # warm-up
        flooder = threading.Thread(target=flood, args=(server.url, args.flood_tokens, stop, counts))
        flooder.start()
        time.sleep(1.0)                                         # the flood under way (evicting) first
        gaps = stream_gaps(server.url, prompt, args.stream_tokens)
        stop.set()
        flooder.join()
    finally:
        stop.set()
        server.stop()
        quiet.close()
    engine = app.state.kvsplice.engine
    line = ""
    if engine.cache.tier is not None:
        stats = engine.cache.tier.stats()
        line = f"; tier: {stats.writes} writes, {stats.bytes_used / 2**20:.0f} MiB, {stats.dropped_queue_full} dropped"
    return gaps, counts[0], line


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--flood-tokens", type=int, default=384)
    parser.add_argument("--skip-decode", action="store_true", help="the load against prefill only")
    args = parser.parse_args()
    dtype = resolve_auto_dtype(args.dtype)
    identity = model_identity(args.model, dtype)
    print(f"CPU: {cpu_line()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    token_ids = torch.randint(1000, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    size_mib, write_s, loads = measure_loads(args, identity, dtype, token_ids)
    prefill_s, prefill_cpu_s = measure_prefill(args, token_ids)
    print(f"{identity.num_layers} layers x {identity.num_kv_heads} KV heads x {identity.head_dim}, {dtype}, "
          f"{args.tokens} tokens: entry {size_mib:.1f} MiB, {torch.get_num_threads()} threads")
    print(f"{'':18s} {'wall ms':>10s} {'CPU ms':>10s} {'prefill/this (wall, CPU)':>26s}")
    print(f"{'write (background)':18s} {write_s * 1000:10.1f}")
    for kind, samples in loads.items():
        wall_s = statistics.median(wall for wall, _ in samples)
        cpu_s = statistics.median(cpu for _, cpu in samples)
        print(f"{'load ' + kind + ' + copy':18s} {wall_s * 1000:10.1f} {cpu_s * 1000:10.1f} "
              f"{prefill_s / wall_s:12.1f}x {prefill_cpu_s / max(cpu_s, 1e-9):12.1f}x")
    print(f"{'prefill':18s} {prefill_s * 1000:10.1f} {prefill_cpu_s * 1000:10.1f}")
    if args.skip_decode:
        return
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tier_dir:
        for name, directory in (("no tier", None), ("disk tier", tier_dir)):
            gaps, prompts, line = measure_decode(args, directory)
            results[name] = gaps
            print(f"decode, {name}: {len(gaps)} gaps, p50 {percentile(gaps, 50) * 1000:.1f} ms, "
                  f"p99 {percentile(gaps, 99) * 1000:.1f} ms; {prompts} flood prompts of {args.flood_tokens} tokens{line}")
    ratio = percentile(results["disk tier"], 99) / percentile(results["no tier"], 99)
    print(f"decode p99 with the tier writing: {ratio:.2f}x without (p50 "
          f"{percentile(results['disk tier'], 50) / percentile(results['no tier'], 50):.2f}x)")
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
