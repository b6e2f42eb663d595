"""The hit rate is the workload: sweep the number of concurrent agent conversations against one
server (whose KV pool is fixed when it starts) and watch where eviction starts to cost.

For each count N: flush the server's cache (POST /flush_cache, so every point starts cold), replay
the first N conversations of the trace with concurrency N, and measure the prefix hit rate (share
of prompt tokens served from the radix cache), the relocated share, the prefilled share and TTFT.
As N grows past what the pool holds, each conversation's previous turn is evicted before its next
turn arrives and the hit rate falls.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import httpx

from kvsplice.bench.replay import RequestRecord, api_base, replay
from kvsplice.bench.trace import Conversation


@dataclass(frozen=True)
class SweepPoint:
    """Totals of one replay with `conversations` sessions in flight."""

    conversations: int
    requests: int
    errors: int
    prompt_tokens: int
    prefix_tokens: int
    relocated_tokens: int
    prefilled_tokens: int
    ttft_p50_s: Optional[float]
    ttft_p90_s: Optional[float]

    @property
    def prefix_share(self) -> float:
        return self.prefix_tokens / max(self.prompt_tokens, 1)

    @property
    def relocated_share(self) -> float:
        return self.relocated_tokens / max(self.prompt_tokens, 1)

    @property
    def prefilled_share(self) -> float:
        return self.prefilled_tokens / max(self.prompt_tokens, 1)


def _percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def summarize(count: int, records: list[RequestRecord]) -> SweepPoint:
    """Sum one replay's records (turns after the first of each conversation only: a first turn
    can never hit, so counting it would blur the curve)."""
    later = [r for r in records if r.turn > 0 and r.error is None and r.usage]
    totals = {"prompt": 0, "prefix": 0, "relocated": 0, "prefilled": 0}
    for record in later:
        usage = record.usage
        reuse = usage.get("reuse") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        totals["prompt"] += usage["prompt_tokens"]
        totals["prefix"] += reuse.get("prefix_tokens", cached)
        totals["relocated"] += reuse.get("relocated_tokens", 0)
        totals["prefilled"] += reuse.get("prefilled_tokens", usage["prompt_tokens"] - cached)
    ttfts = [r.ttft_s for r in later if r.ttft_s is not None]
    return SweepPoint(count, len(records), sum(r.error is not None for r in records), totals["prompt"],
                      totals["prefix"], totals["relocated"], totals["prefilled"],
                      _percentile(ttfts, 50), _percentile(ttfts, 90))


def flush(url: str) -> None:
    """POST /flush_cache on a kvsplice (or SGLang) server; raises on failure."""
    root = api_base(url).removesuffix("/v1")
    httpx.post(f"{root}/flush_cache", timeout=60).raise_for_status()


def sweep(url: str, conversations: list[Conversation], counts: list[int], *,
          send_session_id: bool = True, progress: bool = False) -> list[SweepPoint]:
    """One point per count in `counts` (each <= len(conversations)), cache flushed before each."""
    if any(not 1 <= n <= len(conversations) for n in counts):
        raise ValueError(f"every count must be in [1, {len(conversations)}] (the trace's conversations)")
    points = []
    for count in counts:
        flush(url)
        records = replay(url, conversations[:count], concurrency=count, progress=progress,
                         send_session_id=send_session_id)
        points.append(summarize(count, records))
    return points


def write_sweep(points: list[SweepPoint], out_dir: Path) -> list[Path]:
    """sweep.json, sweep.md and sweep.png (hit rate / relocated share / TTFT against count)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{**asdict(p), "prefix_share": p.prefix_share, "relocated_share": p.relocated_share,
             "prefilled_share": p.prefilled_share} for p in points]
    (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2))
    (out_dir / "sweep.md").write_text(format_sweep(points))
    counts = [p.conversations for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(counts, [p.prefix_share for p in points], marker="o", label="prefix hit rate")
    left.plot(counts, [p.relocated_share for p in points], marker="o", label="relocated share")
    left.plot(counts, [p.prefilled_share for p in points], marker="o", label="prefilled share")
    left.set_xlabel("concurrent conversations")
    left.set_ylabel("share of prompt tokens (turns after the first)")
    left.legend()
    right.plot(counts, [p.ttft_p50_s or 0 for p in points], marker="o", label="TTFT p50")
    right.plot(counts, [p.ttft_p90_s or 0 for p in points], marker="o", label="TTFT p90")
    right.set_xlabel("concurrent conversations")
    right.set_ylabel("seconds")
    right.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "sweep.png", dpi=100)
    plt.close(fig)
    return [out_dir / "sweep.json", out_dir / "sweep.md", out_dir / "sweep.png"]


def format_sweep(points: list[SweepPoint]) -> str:
    lines = ["| conversations | requests | errors | prefix hit rate | relocated | prefilled | TTFT p50 s | TTFT p90 s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        ttft50 = "-" if p.ttft_p50_s is None else f"{p.ttft_p50_s:.3f}"
        ttft90 = "-" if p.ttft_p90_s is None else f"{p.ttft_p90_s:.3f}"
        lines.append(f"| {p.conversations} | {p.requests} | {p.errors} | {p.prefix_share:.1%} | "
                     f"{p.relocated_share:.1%} | {p.prefilled_share:.1%} | {ttft50} | {ttft90} |")
    return "\n".join(lines) + "\n"
