"""Sessions across a SIGKILL, and tier files gone bad: what comes back from the disk tier.

    python benchmarks/tier_restart.py [--conversations 12] [--dtype float32] [--dir /var/tmp]

One `kvsplice serve --kv-disk-dir DIR` (a subprocess: `kvsplice.bench.scale_out.start_replica`)
runs the first two turns of every synthetic agent conversation (session ids sent, 4 at a time);
once the tier has written what they left (a finished request's exact K/V is written as well as
evicted K/V, and a named session's own K/V), the directory is copied aside and every
conversation's third turn sent to that server (the control: the reuse without a restart); the
server is SIGKILLed, the directory put back as the copy has it, and a new server started on DIR:
every conversation's third turn is sent, and counted as reusing its history when part of its
prompt came from the cache (usage.reuse prefix or relocated tokens: after the restart only the
tier can hold them); the reused tokens are compared with the control's. Then that server is
SIGKILLed too, a third of the tier's entry files get a byte flipped mid-file and another third are
cut to half their length, a third server starts on DIR and the third turns are sent again, one at a time, without session ids and with SCR off (the
tier alone), and so are they to a server without prefix cache (exact recompute): the greedy replies
must be equal. Every status >= 500 is counted.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from kvsplice.bench.machine import cpu_line
from kvsplice.bench.replay import replay
from kvsplice.bench.scale_out import ManagedProcess, start_replica
from kvsplice.bench.trace import Conversation
from kvsplice.bench.workload import generate_traces
from kvsplice.models.default_model import DEFAULT_MODEL


def serve(args, *extra: str) -> ManagedProcess:
    """`kvsplice serve` in a subprocess (`kvsplice.bench.scale_out.start_replica`), once ready."""
    replica = f"tier-{len(list(Path(args.out).glob('server-*.log')))}"
    return start_replica(args.model or DEFAULT_MODEL, replica, engine_args=("--dtype", args.dtype, *extra),
                         log_path=Path(args.out) / f"server-{replica}.log", ready_timeout_s=600)


def metric(server: ManagedProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_writes(server: ManagedProcess) -> None:
    """Until the tier's write counter has not moved for two seconds."""
    last = -1.0
    while (now := metric(server, "kvsplice_kv_disk_writes")) != last:
        last = now
        time.sleep(2)


def sigkill(server: ManagedProcess) -> None:
    server.kill()
    server.stop()           # only closes its log now


def reuse_sum(records, field: str) -> int:
    return sum((r.usage.get("reuse") or {}).get(field, 0) for r in records if r.usage)


def prompt_sum(records) -> int:
    return sum(r.usage["prompt_tokens"] for r in records if r.usage)


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
        first = serve(args, *tier)
        try:
            history = [Conversation(c.id, c.cache_salt, c.turns[:2]) for c in conversations]
            before = replay(first.url, history, concurrency=4, progress=False, send_session_id=True)
            wait_writes(first)
            written = metric(first, "kvsplice_kv_disk_writes")
            snapshot = Path(tempfile.mkdtemp(dir=args.dir))
            shutil.copytree(tier_dir, snapshot / "tier")        # the tier as the SIGKILL leaves it
            control = replay(first.url, turn_of(conversations, 2), concurrency=4, progress=False, send_session_id=True)
        finally:
            sigkill(first)
        shutil.rmtree(tier_dir)                                  # what the control turns wrote: gone
        shutil.move(snapshot / "tier", tier_dir)
        snapshot.rmdir()
        print(f"{args.conversations} conversations, 2 turns each, {args.dtype}: {int(written)} tier entries "
              f"written, {server_errors(before)} 5xx")
        control_reused = reuse_sum(control, "prefix_tokens") + reuse_sum(control, "relocated_tokens")
        print(f"without a restart (the same server, third turns): of {prompt_sum(control)} prompt tokens "
              f"{reuse_sum(control, 'prefix_tokens')} cached prefix and {reuse_sum(control, 'relocated_tokens')} "
              f"relocated; SIGKILL, the tier directory put back as it was before these turns")
        second = serve(args, *tier)
        try:
            after = replay(second.url, turn_of(conversations, 2), concurrency=4, progress=False, send_session_id=True)
            wait_writes(second)
        finally:
            sigkill(second)
        reused = [r for r in after if r.usage and ((r.usage.get("reuse") or {}).get("prefix_tokens", 0)
                                                   + (r.usage.get("reuse") or {}).get("relocated_tokens", 0)) > 0]
        disk, prompt = reuse_sum(after, "disk_tokens"), prompt_sum(after)
        prefix, relocated = reuse_sum(after, "prefix_tokens"), reuse_sum(after, "relocated_tokens")
        print(f"after the SIGKILL and a restart: {len(reused)} of {len(after)} next turns reuse their history "
              f"({len(reused) / len(after):.0%}); of {prompt} prompt tokens {prefix} cached prefix ({disk} of them "
              f"loaded from the tier) and {relocated} relocated (only the tier can hold them after the restart): "
              f"{(prefix + relocated) / max(1, control_reused):.0%} of the reuse without a restart; "
              f"{server_errors(after)} 5xx; SIGKILL")
        files = sorted(Path(tier_dir, "entries").rglob("*.kvt"))
        flipped, cut = damage(files)
        third = serve(args, *tier)
        try:
            served = replay(third.url, turn_of(conversations, 2), concurrency=1, progress=False, scr="off")
            dropped = metric(third, "kvsplice_kv_disk_corrupt_dropped")
        finally:
            third.stop()
    exact_server = serve(args, "--no-prefix-cache")
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
    print(f"5xx in the whole run: {sum(server_errors(r) for r in (before, control, after, served, exact))}")
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
