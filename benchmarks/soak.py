"""Soak test of `kvsplice serve`: one server, mixed hostile and ordinary traffic for a fixed time, then
checks that nothing answered 5xx and nothing leaked.

    python benchmarks/soak.py [--duration 900] [--model M | --tiny] [--clients 4] [--seed 0] [--out soak.json]

The server runs as a subprocess (`kvsplice serve`, two API keys: two tenants). Each client loops until
the time is up, drawing one action at a time (seeded):

    turn        the next turn of its agent conversation (kvsplice.bench.workload: appends, deleted tool
                results, replaced results, rewritten notes, stripped reasoning), streamed or not
    abort       the next turn, streamed, dropped after a few chunks
    disconnect  the next turn, not streamed, the client giving up after 0.05-0.5 s
    bad         a hostile request (malformed JSON, lone surrogates, invalid UTF-8, NaN, a huge body, deep
                nesting, no or a wrong key, GET on an admin route, ...): must be a 4xx

At the end the server must be idle with no slot held beyond idle SCR sessions' private K/V: those are
counted (slots in use while idle), then /flush_cache drops the sessions and the radix tree, after which
every slot must be free. Prints requests by action and status, 5xx, RSS (at start, after warm-up, at the
end, its growth per 1,000 requests after warm-up, and RSS at ten times after it), the idle slot figures
and a verdict; exit status 1 on any 5xx, unexpected status, leak, server death, or RSS growth above
--max-rss-growth-mb per 1,000 requests over the second half of the run, net of the decode arena (the
kernel code of new shapes and the allocator's high-water mark fill in the first minutes and then stay,
the arena grows up to its configured bound; a leak keeps growing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvsplice.bench.machine import cpu_line
from kvsplice.bench.replay import request_body
from kvsplice.bench.scale_out import start_replica
from kvsplice.bench.trace import Conversation
from kvsplice.bench.workload import generate_traces

KEYS = ("sk-soak-tenant-a-5f2b9c1e7d", "sk-soak-tenant-b-08a4e6c3f1")
ADMIN_KEY = "sk-soak-operator-3c9d1a7e52"  # flushes every tenant's cache; a tenant key flushes only its own
ACTIONS = (("turn", 0.55), ("abort", 0.12), ("disconnect", 0.12), ("bad", 0.21))
MAX_NEW_TOKENS = 12
# Below this many requests after the warm-up, RSS growth per 1,000 requests is allocator noise, not a
# trend: it is reported as n/a and not judged.
MIN_REQUESTS_FOR_GROWTH = 200
OVERSIZE_BODY = b'{"prompt": "' + b"w" * (2 << 20) + b'"}'  # over the default body limit of any small model
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def _bad_requests() -> list[tuple[str, str, str, Any]]:
    """(method, path, key kind: key | none | wrong, body: dict -> JSON, bytes as they are, None: no body)."""
    return [
        ("POST", CHAT, "key", b"{not json"),
        ("POST", CHAT, "key", '{"messages": [{"role": "user", "content": "\\ud800"}]}'.encode()),
        ("POST", CHAT, "key", b'{"messages": [{"role": "user", "content": "\xff"}]}'),
        ("POST", "/v1/completions", "key", b'{"prompt": "hi", "temperature": NaN}'),
        ("POST", CHAT, "key", {"messages": HI, "max_tokens": 10**30}),
        ("POST", CHAT, "key", {"messages": HI, "stop": [""]}),
        ("POST", CHAT, "key", {"messages": HI, "session_id": "s" * 300}),
        ("POST", CHAT, "key", b"[" * 50_000 + b"]" * 50_000),
        ("POST", "/v1/completions", "key", OVERSIZE_BODY),
        ("POST", "/generate", "key", {"text": "", "sampling_params": {"max_new_tokens": 2}}),
        ("POST", CHAT, "none", {"messages": HI}),
        ("POST", CHAT, "wrong", {"messages": HI}),
        ("GET", "/flush_cache", "key", None),
        ("GET", "/get_server_info", "none", None),
        ("POST", "/no/such/route", "key", {}),
        ("POST", CHAT, "key", {"messages": HI, "n": 17}),
        ("POST", CHAT, "key", {"messages": HI, "tool_choice": "required"}),
    ]


@dataclass
class Tally:
    """Requests by (action, status); a status is an HTTP code or 'gave_up' / 'transport_error'."""

    counts: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    def add(self, action: str, status: Any, expected: bool, detail: str = "") -> None:
        self.counts[(action, str(status))] += 1
        if not expected and len(self.unexpected) < 20:
            self.unexpected.append(f"{action} -> {status}: {detail[:300]}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.counts.items() if status.isdigit() and int(status) >= 500)


class ConversationQueue:
    """An endless supply of agent turns for one client: (conversation id, cache_salt, key, turn)."""

    def __init__(self, traces: list[Conversation], client: int, keys: tuple[str, ...]):
        self.traces, self.client, self.keys = traces, client, keys
        self.cycle, self.index, self.turn = 0, client % len(traces), 0

    def next(self) -> tuple[Conversation, Any, str]:
        conversation = self.traces[self.index]
        if self.turn >= len(conversation.turns):
            self.index, self.turn = (self.index + 1) % len(self.traces), 0
            self.cycle += 1
            conversation = self.traces[self.index]
        turn = conversation.turns[self.turn]
        self.turn += 1
        salt = f"salt-{self.index % 3}" if self.index % 3 == 0 else None
        renamed = Conversation(f"{conversation.id}-c{self.client}-r{self.cycle}", salt, conversation.turns)
        return renamed, turn, self.keys[self.index % len(self.keys)]


def _turn_body(conversation: Conversation, turn, stream: bool) -> dict[str, Any]:
    body = request_body(conversation, turn, model=None, scr=None, send_session_id=True)
    body["max_tokens"] = min(turn.max_tokens, MAX_NEW_TOKENS)
    body["stream"] = stream
    if not stream:
        body.pop("stream_options")
    return body


async def _turn(http: httpx.AsyncClient, url: str, tally: Tally, body: dict, key: str, action: str,
                rng: random.Random) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    if action == "disconnect":
        try:
            response = await http.post(f"{url}{CHAT}", json=body, headers=headers, timeout=rng.uniform(0.05, 0.5))
            tally.add(action, response.status_code, response.status_code == 200, response.text)
        except httpx.TimeoutException:
            tally.add(action, "gave_up", True)
        return
    async with http.stream("POST", f"{url}{CHAT}", json=body, headers=headers, timeout=600) as response:
        if response.status_code != 200 or not body["stream"]:
            text = (await response.aread()).decode(errors="replace")
            tally.add(action, response.status_code, response.status_code == 200, text)
            return
        lines, failed = 0, None
        async for line in response.aiter_lines():
            lines += 1
            if line.startswith("data: {") and '"error"' in line[:20]:
                failed = line
            if action == "abort" and lines >= 3:
                break
        tally.add(action, "error_event" if failed else 200, failed is None, failed or "")


async def _bad(http: httpx.AsyncClient, url: str, tally: Tally, rng: random.Random) -> None:
    method, path, key_kind, body = rng.choice(_bad_requests())
    headers = {"content-type": "application/json"}
    if key_kind != "none":
        headers["Authorization"] = f"Bearer {KEYS[0] if key_kind == 'key' else 'sk-wrong'}"
    content = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    response = await http.request(method, f"{url}{path}", content=content, headers=headers, timeout=120)
    expected = 400 <= response.status_code < 500 and "error" in response.json()
    tally.add("bad", response.status_code, expected, f"{method} {path}: {response.text}")


async def _client(url: str, client: int, traces: list[Conversation], deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(f"soak:{seed}:{client}")
    queue = ConversationQueue(traces, client, KEYS)
    kinds, weights = zip(*ACTIONS)
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            action = rng.choices(kinds, weights=weights)[0]
            try:
                if action == "bad":
                    await _bad(http, url, tally, rng)
                    continue
                conversation, turn, key = queue.next()
                body = _turn_body(conversation, turn, stream=action == "abort" or rng.random() < 0.5)
                await _turn(http, url, tally, body, key, action, rng)
            except httpx.HTTPError as exc:
                tally.add(action, "transport_error", False, repr(exc))


def rss_mb(pid: int) -> float:
    """Resident set size of process `pid` in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(url: str) -> dict[str, float]:
    """Gauges and counters from GET /metrics that carry no label but the model's name."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if set(sample.labels) <= {"model_name"}:
                values[sample.name] = sample.value
    return values


def idle_report(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait for the server to go idle; slots in use then (SCR sessions' private K/V) and after /flush_cache."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = gauges(url)
        if now["kvsplice_num_requests_running"] + now["kvsplice_num_requests_waiting"] == 0:
            break
        if time.monotonic() > deadline:
            return {"idle": False, "running": now["kvsplice_num_requests_running"],
                    "waiting": now["kvsplice_num_requests_waiting"]}
        time.sleep(0.2)
    flushed = httpx.post(f"{url}/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    after = gauges(url)
    return {"idle": True, "slots_total": int(now["kvsplice_kv_slots_capacity"]),
            "slots_in_use_idle": int(now["kvsplice_kv_slots_in_use"]),
            "flush_status": flushed.status_code,
            "slots_in_use_after_flush": int(after["kvsplice_kv_slots_in_use"]),
            "slots_free_after_flush": int(after["kvsplice_kv_slots_free"])}


def memory_sample(url: str, pid: int, seconds: float, requests: int) -> list[float]:
    """[seconds, requests so far, RSS MiB, decode arena MiB (from /metrics)] of the server now."""
    arena_mb = gauges(url).get("kvsplice_decode_arena_bytes", 0.0) / 2**20
    return [round(seconds, 1), requests, round(rss_mb(pid), 1), round(arena_mb, 1)]


async def run_traffic(url: str, pid: int, traces: list[Conversation], args) -> tuple[Tally, dict[str, float]]:
    """All clients until `args.duration` s have passed; RSS sampled after the warm-up."""
    tally, rss = Tally(), {}
    start = time.monotonic()
    deadline = start + args.duration

    async def sample() -> list[float]:
        return await asyncio.to_thread(memory_sample, url, pid, time.monotonic() - start, tally.total)

    async def sample_after_warmup() -> None:
        """The baseline after the warm-up, then nine more samples evenly spaced (rss["timeline"]), so
        a reader sees whether growth levels off."""
        await asyncio.sleep(args.warmup)
        rss["warm"], rss["warm_requests"] = rss_mb(pid), tally.total
        rss["timeline"] = [await sample()]
        every = (args.duration - args.warmup) / 10
        while True:
            await asyncio.sleep(every)
            rss["timeline"].append(await sample())

    warmup = asyncio.create_task(sample_after_warmup())
    await asyncio.gather(*(_client(url, c, traces, deadline, args.seed, tally) for c in range(args.clients)))
    warmup.cancel()  # (a run shorter than its warm-up has no "warm" sample: growth is then from the start)
    rss["elapsed_s"] = time.monotonic() - start
    return tally, rss


def late_growth(timeline: list[list[float]]) -> Optional[float]:
    """Growth of RSS net of the decode arena, in MiB per 1,000 requests, over the second half of the
    sampled run: from the middle sample of `timeline` ([seconds, requests, RSS MiB, arena MiB] after
    the warm-up) to the last. Kernel code for new shapes and the allocator's high-water mark fill in
    the first minutes and then stay, and the decode arena grows with the longest contexts decoding
    together up to its bound (--decode-arena-tokens, reported by /metrics); a leak keeps growing, so
    it shows here. None with fewer than MIN_REQUESTS_FOR_GROWTH requests in that half."""
    if len(timeline) < 2:
        return None
    _, mid_requests, mid_mb, mid_arena = timeline[len(timeline) // 2]
    _, end_requests, end_mb, end_arena = timeline[-1]
    if end_requests - mid_requests < MIN_REQUESTS_FOR_GROWTH:
        return None
    return ((end_mb - end_arena) - (mid_mb - mid_arena)) / (end_requests - mid_requests) * 1000


def verdict(tally: Tally, rss: dict[str, float], idle: dict[str, Any], alive: bool, health: int,
            max_growth_mb: float) -> list[str]:
    """Every reason the soak failed (empty: it passed)."""
    reasons = []
    if tally.server_errors:
        reasons.append(f"{tally.server_errors} responses were 5xx")
    if tally.unexpected:
        reasons.append(f"{len(tally.unexpected)} unexpected answers (first: {tally.unexpected[0]})")
    if not alive or health != 200:
        reasons.append(f"the server is {'alive' if alive else 'dead'}, /health {health}")
    if not idle.get("idle"):
        reasons.append(f"the server did not go idle: {idle}")
    elif idle["slots_in_use_after_flush"] or idle["slots_free_after_flush"] != idle["slots_total"]:
        reasons.append(f"slots leaked: {idle['slots_in_use_after_flush']} in use after /flush_cache, "
                       f"{idle['slots_total'] - idle['slots_free_after_flush']} not free")
    growth = rss.get("late_growth_mb_per_1k", rss.get("growth_mb_per_1k", 0.0))
    if growth > max_growth_mb:
        reasons.append(f"RSS net of the decode arena grew {growth:.1f} MiB per 1,000 requests in the second half "
                       f"of the run (limit {max_growth_mb})")
    return reasons


def _growth(rss: dict[str, float]) -> str:
    if "growth_mb_per_1k" not in rss:
        return (f"n/a ({rss['requests_after_warmup']} requests after the warm-up, fewer than "
                f"{MIN_REQUESTS_FOR_GROWTH})")
    return f"{rss['growth_mb_per_1k']:.2f} MiB per 1,000 requests ({rss['requests_after_warmup']} requests)"


def _late(rss: dict[str, Any]) -> str:
    late = (f"{rss['late_growth_mb_per_1k']:.2f} MiB per 1,000 requests" if "late_growth_mb_per_1k" in rss
            else "n/a (too few requests)")
    peak = max((mb for _, _, mb, _ in rss.get("timeline", [])), default=rss["end"])
    return f"{late}; peak of the samples {peak:.0f} MiB"


def report(tally: Tally, rss: dict[str, float], idle: dict[str, Any], reasons: list[str], args, model: str) -> str:
    lines = [f"soak: {model}, {args.duration:.0f} s, {args.clients} clients, seed {args.seed}",
             f"cpu: {cpu_line()}", f"requests: {tally.total} ({tally.total / rss['elapsed_s']:.2f}/s)",
             "requests by action and status:"]
    lines += [f"  {action:<11} {status:<15} {count}" for (action, status), count in sorted(tally.counts.items())]
    lines += [f"5xx: {tally.server_errors}",
              f"RSS MiB: start {rss['start']:.1f}, after warm-up ({args.warmup:.0f} s, {rss['warm_requests']} "
              f"requests) {rss['warm']:.1f}, end {rss['end']:.1f} (after /flush_cache {rss['after_flush']:.1f}); "
              f"growth after warm-up: {_growth(rss)}",
              f"RSS growth net of the decode arena in the second half of the run: {_late(rss)}",
              "RSS over time (s, requests, RSS MiB, of it decode arena MiB): "
              + ", ".join(f"{t:.0f} {n} {m:.0f} {a:.0f}" for t, n, m, a in rss.get("timeline", [])),
              f"idle: slots in use {idle.get('slots_in_use_idle')} of {idle.get('slots_total')} (idle SCR sessions' "
              f"private K/V); after /flush_cache {idle.get('slots_in_use_after_flush')} in use, "
              f"{idle.get('slots_free_after_flush')} free (leaked: "
              f"{(idle.get('slots_total') or 0) - (idle.get('slots_free_after_flush') or 0)})",
              "verdict: " + ("PASS" if not reasons else "FAIL: " + "; ".join(reasons))]
    return "\n".join(lines)


def _model_and_traces(args, work: Path) -> tuple[str, list[str], list[Conversation]]:
    """The model to serve, its engine flags and the agent conversations sized for it."""
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.tiny_model import make_tiny_model_dir

        model = str(make_tiny_model_dir(work / "tiny"))
        traces = generate_traces(8, args.seed, min_tokens=150, max_tokens=500, min_turns=4, max_turns=12,
                                 max_output_tokens=16)
        return model, ["--num-slots", "32768", "--max-model-len", "4096"], traces
    traces = generate_traces(8, args.seed, min_tokens=800, max_tokens=3000, min_turns=4, max_turns=16,
                             max_output_tokens=16)
    if args.model is None:
        from kvsplice.models.default_model import pull_default_model

        return str(pull_default_model(progress=False)), [], traces
    return args.model, [], traces


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=900.0, help="seconds of traffic (default 900)")
    parser.add_argument("--model", default=None, help="model to serve (default: the default model)")
    parser.add_argument("--tiny", action="store_true", help="serve the tiny random test model instead (quick runs)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the RSS baseline (default: a fifth of the duration, at most 120)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=20.0,
                        help="fail above this RSS growth per 1,000 requests after the warm-up (default 20)")
    parser.add_argument("--out", default="soak.json")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.duration <= 0 or args.clients < 1:
        print("soak: --duration must be > 0 and --clients >= 1", file=sys.stderr)
        return 2
    args.warmup = min(120.0, args.duration / 5) if args.warmup is None else args.warmup
    work = Path(tempfile.mkdtemp(prefix="soak_"))
    model, engine_args, traces = _model_and_traces(args, work)
    os.environ["KVSPLICE_API_KEY"] = ",".join(KEYS)  # the server's two tenants (inherited by the subprocess)
    server = start_replica(model, "soak", engine_args=[*engine_args, "--admin-api-key", ADMIN_KEY],
                           log_path=work / "server.log")
    try:
        rss = {"start": rss_mb(server.process.pid)}
        tally, sampled = asyncio.run(run_traffic(server.url, server.process.pid, traces, args))
        sampled.setdefault("timeline", []).append(  # the last sample: when the traffic has ended
            memory_sample(server.url, server.process.pid, sampled["elapsed_s"], tally.total))
        rss.update(sampled)
        rss["end"] = rss_mb(server.process.pid)
        idle = idle_report(server.url)
        rss["after_flush"] = rss_mb(server.process.pid)
        rss.setdefault("warm", rss["start"])
        rss.setdefault("warm_requests", 0)
        after_warmup = tally.total - int(rss["warm_requests"])
        rss["requests_after_warmup"] = after_warmup
        if after_warmup >= MIN_REQUESTS_FOR_GROWTH:
            rss["growth_mb_per_1k"] = (rss["end"] - rss["warm"]) / after_warmup * 1000
        late = late_growth(rss.get("timeline", []))
        if late is not None:
            rss["late_growth_mb_per_1k"] = late
        health = httpx.get(f"{server.url}/health", timeout=30).status_code
        alive = server.alive()
    finally:
        server.stop()
    log_text = (work / "server.log").read_text(errors="replace")
    reasons = verdict(tally, rss, idle, alive, health, args.max_rss_growth_mb)
    if "Traceback" in log_text:
        reasons.append(f"the server log has {log_text.count('Traceback')} tracebacks ({work / 'server.log'})")
    name = "the tiny random test model" if args.tiny else model
    print(report(tally, rss, idle, reasons, args, name))
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "model": model, "counts": {f"{a} {s}": n for (a, s), n in tally.counts.items()},
        "server_errors": tally.server_errors, "unexpected": tally.unexpected, "rss_mb": rss, "idle": idle,
        "failures": reasons}, indent=2))
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
