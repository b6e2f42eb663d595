"""Sessions across a SIGKILL, and tier files gone bad: what comes back from the disk tier.

    python benchmarks/tier_restart.py [--conversations 12] [--dtype float32] [--dir /var/tmp]

One `kvsplice serve --kv-disk-dir DIR` (a subprocess) runs the first two turns of every synthetic
agent conversation (session ids sent, 4 at a time); once the tier has written what they left (a
finished request's exact K/V is written as well as evicted K/V), the server is SIGKILLed and a new
one started on DIR: every conversation's third turn is sent, and counted as reusing its history when
part of its prompt came from the cache (usage.reuse prefix or relocated tokens: after the restart
only the tier can hold them). Then that server is SIGKILLed too, a third of the tier's entry files
get a byte flipped mid-file and another third are cut to half their length, a third server starts on
DIR and the third turns are sent again, one at a time, without session ids and with SCR off (the
tier alone), and so are they to a server without prefix cache (exact recompute): the greedy replies
must be equal. Every status >= 500 is counted.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvsplice.bench.machine import cpu_line
from kvsplice.bench.replay import replay
from kvsplice.bench.trace import Conversation
from kvsplice.bench.workload import generate_traces


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`kvsplice serve` in a subprocess, up once /health answers."""

    def __init__(self, args, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvsplice.cli", "serve", "--port", str(self.port), "--dtype", args.dtype,
                   *(["--model", args.model] if args.model else []), *extra]
        self.log = open(Path(args.out) / f"server-{self.port}.log", "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(1)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def wait_writes(self) -> None:
        """Until the tier's write counter has not moved for two seconds."""
        last = -1.0
        while (now := self.metric("kvsplice_kv_disk_writes")) != last:
            last = now
            time.sleep(2)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


def turn_of(conversations: list[Conversation], index: int) -> list[Conversation]:
    return [Conversation(c.id, c.cache_salt, (c.turns[index],)) for c in conversations]


def server_errors(records) -> int:
    return sum(r.error is not None and r.error.startswith("HTTP 5") for r in records)


def damage(files: list[Path]) -> tuple[int, int]:
    """Flip a byte mid-file in every third file, cut every third (from the second) to half."""
    flipped = cut = 0
    for number, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if number % 3 == 0:
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            flipped += 1
        elif number % 3 == 1:
            path.write_bytes(bytes(data[: len(data) // 2]))
            cut += 1
    return flipped, cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--min-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=900)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--out", default="runs/tier_restart")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_line()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    conversations = generate_traces(args.conversations, 5, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                    min_turns=3, max_turns=3, max_output_tokens=16)
    with tempfile.TemporaryDirectory(dir=args.dir) as tier_dir:
        tier = ("--kv-disk-dir", tier_dir)
        first = Server(args, *tier)
        try:
            history = [Conversation(c.id, c.cache_salt, c.turns[:2]) for c in conversations]
            before = replay(first.url, history, concurrency=4, progress=False, send_session_id=True)
            first.wait_writes()
            written = first.metric("kvsplice_kv_disk_writes")
        finally:
            first.kill()
        print(f"{args.conversations} conversations, 2 turns each, {args.dtype}: {int(written)} tier entries "
              f"written, {server_errors(before)} 5xx; SIGKILL")
        second = Server(args, *tier)
        try:
            after = replay(second.url, turn_of(conversations, 2), concurrency=4, progress=False, send_session_id=True)
            second.wait_writes()
        finally:
            second.kill()
        reused = [r for r in after if r.usage and ((r.usage.get("reuse") or {}).get("prefix_tokens", 0)
                                                   + (r.usage.get("reuse") or {}).get("relocated_tokens", 0)) > 0]
        disk = sum((r.usage.get("reuse") or {}).get("disk_tokens", 0) for r in after if r.usage)
        prompt = sum(r.usage["prompt_tokens"] for r in after if r.usage)
        print(f"after the SIGKILL and a restart: {len(reused)} of {len(after)} next turns reuse their history "
              f"({len(reused) / len(after):.0%}); {disk} of {prompt} prompt tokens from the tier; "
              f"{server_errors(after)} 5xx; SIGKILL")
        files = sorted(Path(tier_dir, "entries").rglob("*.kvt"))
        flipped, cut = damage(files)
        third = Server(args, *tier)
        try:
            served = replay(third.url, turn_of(conversations, 2), concurrency=1, progress=False, scr="off")
            dropped = third.metric("kvsplice_kv_disk_corrupt_dropped")
        finally:
            third.stop()
    exact_server = Server(args, "--no-prefix-cache")
    try:
        exact = replay(exact_server.url, turn_of(conversations, 2), concurrency=1, progress=False, scr="off")
    finally:
        exact_server.stop()
    equal = sum(a.output_text == b.output_text and a.error is None for a, b in zip(served, exact))
    disk = sum((r.usage.get("reuse") or {}).get("disk_tokens", 0) for r in served if r.usage)
    print(f"{len(files)} tier files: {flipped} with a flipped byte, {cut} cut to half; {int(dropped)} found "
          f"corrupt and dropped; {disk} prompt tokens still from the tier")
    print(f"replies equal to exact recompute: {equal} of {len(served)}; "
          f"{server_errors(served) + server_errors(exact)} 5xx")
    print(f"5xx in the whole run: {sum(server_errors(r) for r in (before, after, served, exact))}")
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
