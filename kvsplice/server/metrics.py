"""Prometheus metrics for one server app, in its own CollectorRegistry (no global registry, so several
apps can live in one process, e.g. in tests).

Two sources:
- per-request events the server observes (requests by endpoint and finish reason, time to first token,
  end-to-end latency, SCR fallbacks by reason): prometheus_client Counters / Histograms;
- the engine's cumulative counters and pool state, read as an `EngineSnapshot` taken on the engine thread
  just before each scrape (`take_snapshot`), exported by a custom collector.

Reuse counters carry their unit in the name (`kvsplice_prefix_tokens_total`, `..._relocated_spans_total`).
The prefix cache hit rate is prefix_tokens / prompt_tokens; `kvsplice_cache_hit_rate` also counts relocated
(SCR) tokens as served from cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Engine counters exported as Prometheus counters: (EngineCounters field, metric name without _total, help).
_ENGINE_COUNTERS = (
    ("prompt_tokens", "kvsplice_prompt_tokens", "prompt tokens admitted"),
    ("generation_tokens", "kvsplice_generation_tokens", "tokens generated"),
    ("prefix_tokens", "kvsplice_prefix_tokens", "prompt tokens served by the radix (prefix) cache"),
    ("relocated_tokens", "kvsplice_relocated_tokens", "prompt tokens whose K/V was relocated by SCR"),
    ("prefilled_tokens", "kvsplice_prefilled_tokens", "prompt tokens computed by prefill"),
    ("relocated_spans", "kvsplice_relocated_spans", "spans relocated by SCR"),
    ("preemptions", "kvsplice_preemptions", "requests preempted for lack of KV slots"),
    ("forward_steps", "kvsplice_forward_steps", "model forward passes"),
    ("requests_finished", "kvsplice_engine_requests_finished", "requests finished by the engine"),
    ("requests_aborted", "kvsplice_engine_requests_aborted", "requests aborted in the engine"),
)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state at one instant: cumulative counters (EngineCounters fields) and pool / queue gauges."""

    counters: dict[str, int]
    num_running: int
    num_waiting: int
    slots_total: int
    slots_in_use: int
    slots_free: int
    slots_cached: int


def take_snapshot(engine) -> EngineSnapshot:
    """Read `engine`'s counters and pool state. Call it on the engine thread (AsyncEngine.call): the
    radix tree and queues are not safe to read while a step runs."""
    return EngineSnapshot(
        counters=dataclasses.asdict(engine.counters),
        num_running=engine.num_running(),
        num_waiting=engine.num_waiting(),
        slots_total=engine.config.num_slots,
        slots_in_use=engine.slots_in_use(),
        slots_free=engine.cache.allocator.num_free,
        slots_cached=engine.cache.radix.cached_size(),
    )


class _EngineCollector:
    """Exports the most recent EngineSnapshot (nothing before the first one)."""

    def __init__(self) -> None:
        self.snapshot: Optional[EngineSnapshot] = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        for field_name, name, help_text in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, help_text, value=snap.counters.get(field_name, 0))
        gauges = (
            ("kvsplice_num_requests_running", "requests being run", snap.num_running),
            ("kvsplice_num_requests_waiting", "requests waiting for admission", snap.num_waiting),
            ("kvsplice_kv_slots_total", "KV pool size in slots (tokens)", snap.slots_total),
            ("kvsplice_kv_slots_in_use", "KV slots held by running requests and SCR sessions", snap.slots_in_use),
            ("kvsplice_kv_slots_free", "KV slots free", snap.slots_free),
            ("kvsplice_kv_slots_cached", "KV slots held by the radix cache", snap.slots_cached),
            ("kvsplice_kv_pool_usage_ratio", "share of KV slots in use (not free, not cache)",
             snap.slots_in_use / snap.slots_total if snap.slots_total else 0.0),
        )
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(name, help_text, value=value)
        prompt = snap.counters.get("prompt_tokens", 0)
        prefix = snap.counters.get("prefix_tokens", 0)
        relocated = snap.counters.get("relocated_tokens", 0)
        yield GaugeMetricFamily("kvsplice_prefix_cache_hit_rate",
                                "share of prompt tokens served by the prefix cache (prefix_tokens / prompt_tokens)",
                                value=prefix / prompt if prompt else 0.0)
        yield GaugeMetricFamily("kvsplice_cache_hit_rate",
                                "share of prompt tokens not prefilled ((prefix + relocated) / prompt_tokens)",
                                value=(prefix + relocated) / prompt if prompt else 0.0)


class ServerMetrics:
    """The metrics of one app. `registry` is private to it; `render()` gives the exposition text."""

    def __init__(self, replica_name: Optional[str] = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # one constant series naming the replica, so a fleet's scrapes can be told apart
        self.replica = Gauge("kvsplice_replica_info", "this server's replica name (value is always 1)",
                             ("replica",), registry=self.registry)
        self.replica.labels(replica_name or "").set(1)
        self.requests = Counter("kvsplice_requests", "requests answered, by endpoint and finish reason",
                                ("endpoint", "finish_reason"), registry=self.registry)
        self.request_errors = Counter("kvsplice_request_errors", "requests refused or failed, by HTTP status",
                                      ("status",), registry=self.registry)
        self.ttft = Histogram("kvsplice_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvsplice_e2e_request_latency_seconds", "time from arrival to the last token",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.fallbacks = Counter("kvsplice_scr_fallbacks", "requests whose SCR relocation fell back, by reason",
                                 ("reason",), registry=self.registry)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

    def observe_request(self, endpoint: str, finish_reason: Optional[str], ttft_s: Optional[float],
                        e2e_s: float, fallback: Optional[str]) -> None:
        """Record one finished (or aborted) request."""
        self.requests.labels(endpoint, finish_reason or "unknown").inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if fallback:
            self.fallbacks.labels(fallback).inc()

    def observe_error(self, status: int) -> None:
        """Record one request answered with an HTTP error status."""
        self.request_errors.labels(str(status)).inc()

    def render(self, snapshot: Optional[EngineSnapshot]) -> bytes:
        """The Prometheus text exposition; `snapshot` (if given) replaces the engine figures."""
        if snapshot is not None:
            self._engine.snapshot = snapshot
        return generate_latest(self.registry)
