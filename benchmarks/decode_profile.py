"""Where a decode step's time goes: the engine alone (no HTTP) on the default model, as served.

    python benchmarks/decode_profile.py [--streams 1,8] [--threads 1,2] [--tokens 160]

For each thread count and number of streams it decodes `--tokens` greedy tokens per stream and
prints the median step time, then splits one profiled run of 50 steps (torch.profiler, self CPU
time) into the int4 / int8 projection kernels, dense matmuls (the lm_head, and projections above
the packed kernels' row limit), attention, and everything else (the per-op cost of the ~20 small
ops per layer: norms, RoPE, cache writes, adds). The model is loaded as `kvsplice serve` loads it
(`--dtype auto`, `--weight-format auto`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsplice.bench.machine import cpu_line  # noqa: E402
from kvsplice.config import EngineConfig  # noqa: E402
from kvsplice.engine.llm import build_engine  # noqa: E402
from kvsplice.models.default_model import find_default_gguf, pull_default_model  # noqa: E402
from kvsplice.sampling_params import SamplingParams  # noqa: E402

GROUPS = (  # (label, profiler op names)
    ("packed int4/int8 matmuls", ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")),
    ("dense matmuls (lm_head)", ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")),
    ("attention (SDPA)", ("aten::_scaled_dot_product_flash_attention_for_cpu",)),
)


def add_streams(engine, streams: int, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(engine.tokenizer.encode(f"Once upon a time, story {i}:"), params)


def step_times(engine, streams: int, tokens: int) -> list[float]:
    """Wall time of every step of `streams` greedy requests of `tokens` tokens each."""
    add_streams(engine, streams, tokens)
    times = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def split(engine, streams: int, steps: int = 50) -> dict[str, float]:
    """Self CPU ms per step by GROUPS (and "other ops") over `steps` decode steps."""
    add_streams(engine, streams, steps + 20)
    for _ in range(10):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_work():
        engine.step()
    by_name = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    out = {label: sum(by_name.get(n, 0.0) for n in names) for label, names in GROUPS}
    out["other ops"] = sum(by_name.values()) - sum(out.values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=160)
    args = parser.parse_args()
    model = find_default_gguf() or pull_default_model(progress=False)
    print(f"cpu: {cpu_line()}; torch {torch.__version__}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        engine = build_engine(EngineConfig(model=str(model), dtype="auto", weight_format="auto"))
        fmt = engine.runner.weight_format
        for streams in [int(s) for s in args.streams.split(",")]:
            step_times(engine, streams, 16)   # warm-up
            median = statistics.median(step_times(engine, streams, args.tokens)[5:]) * 1e3
            parts = split(engine, streams)
            shares = ", ".join(f"{label} {ms:.1f}" for label, ms in parts.items())
            print(f"threads {threads}, streams {streams} ({fmt.projections} projections, {fmt.lm_head} lm_head): "
                  f"step {median:.1f} ms ({median / streams:.2f} ms per token); profiled ms per step: {shares}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
