"""Start-up of `kvsplice serve` at its defaults: time to /health ready, time to the compiled decode
step, and the requests answered meanwhile, with an empty compile cache and then a warm one.

    python benchmarks/startup.py [--requests-tokens 32] [--timeout-s 480]

Each run starts a fresh `kvsplice serve` (no flags but the port) under a kvsplice cache directory
of its own (KVSPLICE_CACHE, a temporary directory whose `models` links to the converted models of
the user's cache, so the model is converted already and the compile cache starts empty;
TORCHINDUCTOR_CACHE_DIR unset). The second run reuses the first one's directory: a warm compile
cache. From the moment /health answers, one client streams greedy completions back to back until
`compiled_decode` leaves "building" / "measuring" (the switch, or the verdict that eager stays),
then three more. Printed per run: seconds to /health ready (wall, and CPU seconds of the server
process, which other load on the machine inflates less), the log's own start-up times (engine
built, warm-up, graphs built), seconds to the switch, the requests during the build (count,
refused, median and worst latency, worst gap between two streamed tokens) and the decode tokens/s
of one stream during the build and after the switch. The machine is shared: the load average is
printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

from kvsplice.bench.machine import cpu_line
from kvsplice.models.default_model import cache_dir
from kvsplice.server.launch import free_port

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SETTLED = ("active", "eager", "failed")
LOG_TIMES = {"engine built": r"engine built in ([\d.]+) s", "warm-up": r"warm-up: .* in ([\d.]+) s",
             "graphs built": r"graphs built in ([\d.]+) s"}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_once(url: str, tokens: int) -> dict:
    """One streamed greedy completion: status, latency, time to first token, worst gap, tokens/s after the first."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    arrivals: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            return {"status": response.status_code, "latency_s": time.perf_counter() - started}
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"] or not arrivals:
                    arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    decode_s = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else float("nan")
    return {"status": 200, "latency_s": time.perf_counter() - started, "ttft_s": arrivals[0] - started,
            "max_gap_s": max(gaps, default=0.0), "decode_tok_s": (len(arrivals) - 1) / decode_s}


def health(url: str) -> Optional[dict]:
    try:
        response = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def one_start(root: Path, tokens: int, timeout_s: float) -> dict:
    """Start `kvsplice serve` under cache root `root`, measure, stop it."""
    env = {**os.environ, "KVSPLICE_CACHE": str(root)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    port = free_port()
    log_path = root / f"serve-{port}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "kvsplice.cli", "serve", "--port", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        state = None
        while (state := health(url)) is None:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
            if time.perf_counter() - started > timeout_s:
                return {"ready_s": None, "ready_cpu_s": cpu_seconds(server.pid), "log": _log_times(log_path)}
            time.sleep(0.1)
        result = {"ready_s": time.perf_counter() - started, "ready_cpu_s": cpu_seconds(server.pid)}
        during, after, switched = [], [], None
        while len(after) < 3 and time.perf_counter() - started < timeout_s:
            compiled = state.get("compiled_decode")
            if switched is None and compiled not in ("building", "measuring"):
                switched = (time.perf_counter() - started, compiled or "off")
            (after if switched else during).append(stream_once(url, tokens))
            state = health(url) or {}
        result.update(switched=switched, during=during, after=after)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    text = log_path.read_text()
    result["log"] = _log_times(log_path)
    result["verdict"] = next((line.split("compiled decode: ", 1)[1] for line in text.splitlines()
                              if "measured on the live model" in line or "--compile-decode" in line
                              or "auto: eager" in line), "")
    return result


def _log_times(log_path: Path) -> dict[str, float]:
    """The start-up times the server's log states (LOG_TIMES), by name."""
    text = log_path.read_text()
    return {name: float(m.group(1)) for name, pattern in LOG_TIMES.items() if (m := re.search(pattern, text))}


def report(name: str, run: dict) -> list[str]:
    if run["ready_s"] is None:
        return [f"{name}: /health not ready within the timeout (server CPU {run['ready_cpu_s']:.1f} s); log: "
                + ", ".join(f"{k} {v:.1f} s" for k, v in run["log"].items())]
    lines = [f"{name}: /health ready {run['ready_s']:.1f} s (server CPU {run['ready_cpu_s']:.1f} s); log: "
             + ", ".join(f"{k} {v:.1f} s" for k, v in run["log"].items())]
    switched = run["switched"]
    lines.append(f"{name}: compiled decode settled at {switched[0]:.1f} s: {switched[1]}" if switched
                 else f"{name}: compiled decode not settled within the timeout")
    for label, requests in (("during the build", run["during"]), ("after it", run["after"])):
        ok = [r for r in requests if r["status"] == 200]
        if not requests:
            lines.append(f"{name}: requests {label}: none")
            continue
        lines.append(f"{name}: requests {label}: {len(requests)}, refused {len(requests) - len(ok)}, latency median "
                     f"{statistics.median(r['latency_s'] for r in ok):.2f} s max {max(r['latency_s'] for r in ok):.2f} s, "
                     f"worst token gap {max(r['max_gap_s'] for r in ok):.2f} s, decode "
                     f"{statistics.median(r['decode_tok_s'] for r in ok):.1f} tok/s (median)")
    if run["during"] and run["after"]:
        before = statistics.median(r["decode_tok_s"] for r in run["during"] if r["status"] == 200)
        later = statistics.median(r["decode_tok_s"] for r in run["after"] if r["status"] == 200)
        lines.append(f"{name}: decode after the switch / during the build: {later / before:.2f}x")
    lines.append(f"{name}: {run['verdict']}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-tokens", type=int, default=32, help="max_tokens of each client request")
    parser.add_argument("--timeout-s", type=float, default=480, help="per start, until the compiled step settles")
    args = parser.parse_args(argv)
    models = cache_dir() / "models"
    if not models.is_dir():
        print(f"no converted model under {models}: run `kvsplice pull` first", file=sys.stderr)
        return 2
    print(cpu_line())
    print(f"load average at start: {load()}")
    with tempfile.TemporaryDirectory(prefix="kvsplice-startup-") as tmp:
        root = Path(tmp)
        (root / "models").symlink_to(models)
        for name in ("empty cache", "warm cache"):
            for line in report(name, one_start(root, args.requests_tokens, args.timeout_s)):
                print(line, flush=True)
    print(f"load average at end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
