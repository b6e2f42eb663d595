"""Load test of `kvsplice serve`: N concurrent clients, each holding a conversation of T turns.

Starts the server in this process (default model unless --model), then every client sends its turns one
after another through the streaming chat endpoint, appending its question and the previous answer each
turn (so later turns hit the prefix cache). Records per request TTFT (first content chunk), latency, tokens
and errors; prints a table and writes JSON.

    python benchmarks/serve_load.py [--model DIR] [--clients 32] [--turns 4] [--max-tokens 16] [--out serve_load.json]

Exit status 1 if any request failed (the figures are still written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import httpx

TOPICS = ["the radix cache", "RoPE re-rotation", "a tool result", "chunked prefill", "the KV pool",
          "session matching", "span tails", "the scheduler"]


@dataclass
class Sample:
    """One request's measurements."""

    client: int
    turn: int
    ttft_s: Optional[float]
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: Optional[str]


async def _one_turn(http: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                    client: int, turn: int) -> tuple[Sample, str]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": f"client-{client}"}
    start = time.perf_counter()
    ttft, text, usage, error = None, "", None, None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = json.dumps(chunk["error"])[:200]
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content") or ""
                        if piece and ttft is None:
                            ttft = time.perf_counter() - start
                        text += piece
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        error = repr(exc)
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    sample = Sample(client, turn, ttft, time.perf_counter() - start, usage.get("prompt_tokens", 0),
                    usage.get("completion_tokens", 0), cached, error)
    return sample, text


async def _client(http: httpx.AsyncClient, url: str, client: int, turns: int, max_tokens: int) -> list[Sample]:
    messages = [{"role": "system", "content": "You are a concise assistant for an LLM serving engine."}]
    samples = []
    for turn in range(turns):
        topic = TOPICS[(client + turn) % len(TOPICS)]
        messages.append({"role": "user", "content": f"Turn {turn}: explain {topic} in one sentence."})
        sample, text = await _one_turn(http, url, messages, max_tokens, client, turn)
        samples.append(sample)
        messages.append({"role": "assistant", "content": text})
    return samples


async def run_load(url: str, clients: int, turns: int, max_tokens: int) -> tuple[list[Sample], float]:
    """Run every client to the end; returns the samples and the wall time in seconds."""
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(_client(http, url, c, turns, max_tokens) for c in range(clients)))
        return [s for samples in results for s in samples], time.perf_counter() - start


def _percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(samples: list[Sample], wall_s: float) -> dict:
    """Throughput, TTFT p50/p99, latency p50, cache share of prompt tokens, error count."""
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": sum(s.completion_tokens for s in ok) / wall_s if wall_s else 0.0,
        "prompt_tokens_per_s": prompt / wall_s if wall_s else 0.0,
        "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "latency_p50_s": statistics.median([s.latency_s for s in ok]) if ok else None,
        "cached_share": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
    }


def _table(summary: dict) -> str:
    rows = [(key, f"{value:.4g}" if isinstance(value, float) else str(value)) for key, value in summary.items()]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-slots", type=int, default=65_536)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="serve_load.json")
    args = parser.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        from kvsplice.config import EngineConfig
        from kvsplice.server.api import ServerSettings
        from kvsplice.server.launch import ServerThread, build_app
        from kvsplice.server.request_log import RequestLog

        config = EngineConfig(model=args.model, num_slots=args.num_slots, device=args.device)
        app = build_app(config, ServerSettings(model_path=args.model), RequestLog(open("/dev/null", "w")))
        server = ServerThread(app)
        server.start()
        url = server.url
    try:
        samples, wall_s = asyncio.run(run_load(url, args.clients, args.turns, args.max_tokens))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(samples, wall_s)
    summary.update(clients=args.clients, turns=args.turns, max_tokens=args.max_tokens, model=args.model or "default")
    print(_table(summary))
    with open(args.out, "w") as handle:
        json.dump({"summary": summary, "samples": [asdict(s) for s in samples]}, handle, indent=1)
    print(f"wrote {args.out}")
    for sample in [s for s in samples if s.error][:5]:
        print(f"client {sample.client} turn {sample.turn}: {sample.error}", file=sys.stderr)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
