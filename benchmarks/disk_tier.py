"""Loading a 4K-token history from the disk tier vs prefilling it: the ratio, in one run.

    python benchmarks/disk_tier.py [--tokens 4096] [--dir /var/tmp] [--repeats 3] [--model M]

The K/V shape is the model's (read from its config.json: the default SmolLM2-135M-Instruct has
30 layers, 3 KV heads of 64) in the engine's dtype ("auto": bf16 where the CPU has it). One entry
of `--tokens` tokens is written to a tier under `--dir`, then loaded back and copied into a KV
pool's slots (what an engine does on a tier hit), `--repeats` times from the page cache ("warm")
and with the file's pages dropped first ("cold": posix_fadvise DONTNEED, so the read goes to the
disk). The same engine prefills a prompt of `--tokens` random tokens (max_tokens=1, prefix cache
off), after a short warm-up prefill. Wall-clock and CPU seconds of this process (CPU time counts
less of what other processes on the machine take), median of the repeats for loads; prefill runs
once (it is the slow part).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvsplice.cache.disk_tier import DiskTier, DiskTierConfig, kv_into_pool
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.tier_format import EntryKey, TierEntry, TierIdentity, dtype_name
from kvsplice.engine.llm import LLM, resolve_auto_dtype
from kvsplice.models.config import ModelConfig
from kvsplice.models.default_model import resolve_model
from kvsplice.sampling_params import SamplingParams


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


def time_loads(tier: DiskTier, entry: TierEntry, pool: KVPool, repeats: int, cold: bool) -> tuple[float, float]:
    """Median wall and CPU seconds of get() + copying the K/V into pool slots."""
    path = next(tier.config.dir.glob("entries/*/*.kvt"))
    slots = torch.arange(entry.num_tokens)
    wall, cpu = [], []
    for _ in range(repeats):
        if cold:
            drop_page_cache(path)
        started, started_cpu = time.perf_counter(), time.process_time()
        loaded = tier.get(entry.key, token_ids=entry.token_ids)
        kv_into_pool(pool, slots, loaded.kv)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    assert torch.equal(pool.k[:, slots], entry.kv[:, 0])
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = resolve_auto_dtype(args.dtype)
    identity = model_identity(args.model, dtype)
    token_ids = torch.randint(1000, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    kv = torch.randn(identity.num_layers, 2, args.tokens, identity.num_kv_heads, identity.head_dim).to(dtype)
    entry = TierEntry(EntryKey.for_prefix("bench", token_ids), token_ids, 0, kv)
    pool = KVPool(args.tokens, identity.num_layers, identity.num_kv_heads, identity.head_dim, dtype=dtype)
    llm = LLM(model=args.model, dtype=args.dtype, prefix_cache=False, num_slots=args.tokens + 64)
    warm_up = torch.randint(1000, 40000, (min(args.tokens, 128),)).tolist()
    llm.generate(warm_up, SamplingParams(max_tokens=1, temperature=0.0))    # kernels picked, caches warm
    started, started_cpu = time.perf_counter(), time.process_time()
    llm.generate(token_ids.tolist(), SamplingParams(max_tokens=1, temperature=0.0))
    prefill_s, prefill_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    del llm
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        with DiskTier(DiskTierConfig(Path(directory), budget_bytes=1 << 31), identity) as tier:
            started = time.perf_counter()
            tier.put(entry)
            tier.wait_writes()
            write_s = time.perf_counter() - started
            warm = time_loads(tier, entry, pool, args.repeats, cold=False)
            cold = time_loads(tier, entry, pool, args.repeats, cold=True)
            size = tier.stats().bytes_used
    print(f"{identity.num_layers} layers x {identity.num_kv_heads} KV heads x {identity.head_dim}, {dtype}, "
          f"{args.tokens} tokens: entry {size / 2**20:.1f} MiB, {torch.get_num_threads()} threads")
    print(f"{'':18s} {'wall ms':>10s} {'CPU ms':>10s} {'prefill/this (wall, CPU)':>26s}")
    print(f"{'write (background)':18s} {write_s * 1000:10.1f}")
    for name, (wall_s, cpu_s) in (("load warm + copy", warm), ("load cold + copy", cold)):
        print(f"{name:18s} {wall_s * 1000:10.1f} {cpu_s * 1000:10.1f} "
              f"{prefill_s / wall_s:12.1f}x {prefill_cpu_s / max(cpu_s, 1e-9):12.1f}x")
    print(f"{'prefill':18s} {prefill_s * 1000:10.1f} {prefill_cpu_s * 1000:10.1f}")


if __name__ == "__main__":
    main()
