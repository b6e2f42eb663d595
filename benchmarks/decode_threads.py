"""Decode threads in the server: streamed inter-token latency and 8-stream throughput of
`kvsplice serve` with each `--decode-threads` value, alternating, in one run.

    python benchmarks/decode_threads.py [--threads 1,2] [--repeats 2] [--tokens 200]

Each setting starts its own server on the default model (its GGUF, the server's defaults
otherwise), streams one completion of `--tokens` tokens (median gap between chunks), then 8 at
once (tokens per second between the first and the last chunk). Settings alternate `--repeats`
times, so a change in the machine's load hits each of them alike; the table has the median of
the repeats and each setting's ratio to the first one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_llamacpp import free_port  # noqa: E402
from kvsplice.bench.machine import cpu_line  # noqa: E402
from kvsplice.models.default_model import find_default_gguf  # noqa: E402


def stream_stamps(url: str, tokens: int, tag: int) -> list[float]:
    """Arrival times of the data chunks of one streamed, greedy completion (EOS ignored)."""
    body = {"prompt": f"Once upon a time, story {tag}:", "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return stamps


def measure(decode_threads: str, tokens: int) -> dict:
    """One server with `--decode-threads decode_threads`: 1-stream ITL p50, 8-stream tok/s."""
    port = free_port()
    argv = [sys.executable, "-m", "kvsplice.cli", "serve", "--model", find_default_gguf(), "--port", str(port),
            "--decode-threads", decode_threads]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        stream_stamps(url, 16, 0)   # warm-up: kernels for the shapes used
        single = stream_stamps(url, tokens, 1)
        itl = statistics.median(b - a for a, b in zip(single, single[1:]))
        streams: list[list[float]] = []
        threads = [threading.Thread(target=lambda i=i: streams.append(stream_stamps(url, tokens, 10 + i)))
                   for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first, last = min(s[0] for s in streams), max(s[-1] for s in streams)
        return {"itl_p50_ms": itl * 1000, "tok_s_8": sum(len(s) - 1 for s in streams) / (last - first)}
    finally:
        server.terminate()
        server.wait()


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="--decode-threads values, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    settings = args.threads.split(",")
    print(f"CPU: {cpu_line()}; load average before: {tuple(round(x, 2) for x in os.getloadavg())}")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for repeat in range(args.repeats):
        for setting in settings:
            runs[setting].append(measure(setting, args.tokens))
            print(f"  repeat {repeat + 1}, --decode-threads {setting}: {runs[setting][-1]}", flush=True)
    print(f"load average after: {tuple(round(x, 2) for x in os.getloadavg())}")
    print("--decode-threads  ITL p50 ms  x first  8-stream tok/s  x first")
    base = {key: statistics.median(r[key] for r in runs[settings[0]]) for key in ("itl_p50_ms", "tok_s_8")}
    for setting in settings:
        itl = statistics.median(r["itl_p50_ms"] for r in runs[setting])
        rate = statistics.median(r["tok_s_8"] for r in runs[setting])
        print(f"{setting:>16}  {itl:10.2f}  {itl / base['itl_p50_ms']:7.2f}  {rate:14.1f}  {rate / base['tok_s_8']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
