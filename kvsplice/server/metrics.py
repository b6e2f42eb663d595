"""Prometheus metrics for one server app, in registries private to it (no global registry, so several apps
can live in one process, e.g. in tests).

Two sources:
- per-request observations the server makes when a request ends (`RequestObservation`: endpoint, finish
  reason, latencies, token counts, SCR fallback): prometheus_client Counters and Histograms;
- the engine's cumulative counters and pool state, read as an `EngineSnapshot` taken on the engine thread
  just before each scrape (`take_snapshot`), exported by a custom collector.

    ServerMetrics.render(snapshot)
        exposition registry ─┬─ _WithoutCreated(request registry)   Counters / Histograms / info Gauge
                             └─ _EngineCollector(snapshot)          engine counters and gauges

Every series carries a `model_name` label (the served name), as vLLM's do, so a dashboard can filter by
model. No series ends in `_created`: prometheus_client adds one to every Counter and Histogram unless
disabled process-wide (`disable_created_metrics()`); `_WithoutCreated` drops them for this app only.
The exposition passes `promtool check metrics` (tests/server/test_metrics.py runs it when promtool is
installed, and an equivalent parser check always). docs/METRICS.md lists every series and its vLLM name.

Latencies (seconds, `time.perf_counter` differences):
    queue time       engine arrival -> first admission (the request got its KV slots)
    TTFT             engine arrival -> first token sampled
    prefill time     first admission -> first token
    inter-token      between two consecutive outputs carrying tokens, as the server received them
    time per output  one request's (last token - first token) / (outputs with tokens - 1)
    decode time      first token -> last token, as the server received them
    e2e              the server's start of the request -> its end
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvsplice.cache.disk_tier import TierStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005) + E2E_BUCKETS
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                         2.5, 5.0, 10.0)
MODEL_LABEL = "model_name"

# Engine counters exported as Prometheus counters: (EngineCounters field, metric name without _total, help).
_ENGINE_COUNTERS = (
    ("prompt_tokens", "kvsplice_prompt_tokens", "prompt tokens admitted"),
    ("generation_tokens", "kvsplice_generation_tokens", "tokens generated"),
    ("prefix_tokens", "kvsplice_prefix_tokens", "prompt tokens served by the radix (prefix) cache"),
    ("relocated_tokens", "kvsplice_relocated_tokens", "prompt tokens whose K/V was relocated by SCR"),
    ("prefilled_tokens", "kvsplice_prefilled_tokens", "prompt tokens computed by prefill"),
    ("relocated_spans", "kvsplice_relocated_spans", "spans relocated by SCR"),
    ("disk_tokens", "kvsplice_disk_tokens", "prompt tokens whose K/V was loaded from the disk tier (within prefix_tokens)"),
    ("window_relocated", "kvsplice_window_relocated_tokens",
     "relocated tokens whose K/V was also moved in the sliding-window layers (within relocated_tokens)"),
    ("window_recomputed", "kvsplice_window_recomputed_tokens",
     "relocated tokens computed instead because a sliding layer's old window was gone (within prefilled_tokens)"),
    ("preemptions", "kvsplice_preemptions", "requests preempted for lack of KV slots"),
    ("forward_steps", "kvsplice_forward_steps", "model forward passes"),
    ("requests_finished", "kvsplice_engine_requests_finished", "requests finished by the engine"),
    ("requests_aborted", "kvsplice_engine_requests_aborted", "requests aborted in the engine"),
    ("requests_failed", "kvsplice_engine_requests_failed", "requests that failed inside the engine (an unexpected error; the engine served on)"),
    ("compiled_decode_steps", "kvsplice_compiled_decode_steps", "decode steps run on the compiled graphs (--compile-decode)"),
    ("compiled_decode_fallbacks", "kvsplice_compiled_decode_fallbacks",
     "decode steps the compiled graphs' guards refused, run eagerly instead of recompiling (--compile-decode)"),
)

# The disk tier's TierStats fields (--kv-disk-dir; all 0 without it): (field, help); bytes_used and
# entries are gauges, the rest counters. Exported as kvsplice_kv_disk_<field>.
_TIER_SERIES = (
    ("hits", "loads from the disk tier that returned verified K/V"),
    ("misses", "disk tier lookups that returned nothing (gone, corrupt, another namespace's): recomputed"),
    ("loads", "disk tier entry files read and verified"),
    ("load_seconds", "seconds spent reading and verifying disk tier entries (mean latency: / loads)"),
    ("writes", "entries written to the disk tier"),
    ("write_errors", "disk tier writes that failed (ENOSPC, EIO; the entry is dropped)"),
    ("read_errors", "disk tier reads that failed with an I/O error"),
    ("dropped_queue_full", "evicted entries not written: the disk tier's writer queue was full"),
    ("dropped_over_budget", "evicted entries not written: larger than the disk tier's budget or share"),
    ("evictions", "disk tier entries evicted (least recently used) to stay within --kv-disk-gb"),
    ("corrupt_dropped", "disk tier files found torn or corrupt and removed (never loaded)"),
    ("temp_files_removed", "partial disk tier writes (a killed process's) removed at start"),
    ("ignored_at_start", "disk tier entries of another model identity removed unread at start"),
)
_TIER_GAUGES = (
    ("bytes_used", "bytes the disk tier's files and writes in flight take (at most --kv-disk-gb)"),
    ("entries", "entries stored in the disk tier"),
)
TIER_PREFIX = "kvsplice_kv_disk_"


def token_count_buckets(max_model_len: int) -> tuple[float, ...]:
    """1-2-5 buckets up to max_model_len (1, 2, 5, 10, 20, 50, ...), as vLLM's request length histograms."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(float(b) for b in buckets)
            buckets.append(mantissa * scale)
        scale *= 10


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
    decode_arena_bytes: int = 0
    tier: TierStats = TierStats()      # the disk tier's counters (zeros without one)


def take_snapshot(engine) -> EngineSnapshot:
    """Read `engine`'s counters and pool state. Call it on the engine thread (AsyncEngine.call): the
    radix tree and queues are not safe to read while a step runs."""
    compiled = engine.runner.fast.compiled if engine.runner.fast is not None else None
    return EngineSnapshot(
        counters={**dataclasses.asdict(engine.counters),
                  "compiled_decode_steps": compiled.compiled_steps if compiled is not None else 0,
                  "compiled_decode_fallbacks": compiled.fallbacks if compiled is not None else 0},
        num_running=engine.num_running(),
        num_waiting=engine.num_waiting(),
        slots_total=engine.config.num_slots,
        slots_in_use=engine.slots_in_use(),
        slots_free=engine.cache.allocator.num_free,
        slots_cached=engine.cache.radix.cached_size(),
        decode_arena_bytes=engine.runner.arena.nbytes if engine.runner.arena is not None else 0,
        tier=engine.cache.tier.stats() if engine.cache.tier is not None else TierStats(),
    )


@dataclass(frozen=True)
class RequestObservation:
    """What the server saw of one finished (or aborted) request. `token_times_s`: the perf_counter time
    at which each output carrying tokens reached the server (kvsplice emits one token per output);
    `ttft_s` and `queue_s` are the engine's (from arrival); None when the request never got there."""

    endpoint: str
    finish_reason: Optional[str]
    e2e_s: float
    ttft_s: Optional[float] = None
    queue_s: Optional[float] = None
    token_times_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    generation_tokens: int = 0
    fallback: Optional[str] = None

    @property
    def inter_token_latencies_s(self) -> tuple[float, ...]:
        times = self.token_times_s
        return tuple(later - earlier for earlier, later in zip(times, times[1:]))

    @property
    def decode_s(self) -> Optional[float]:
        """First token -> last token (None without tokens)."""
        return self.token_times_s[-1] - self.token_times_s[0] if self.token_times_s else None

    @property
    def time_per_output_token_s(self) -> Optional[float]:
        """Mean gap between tokens after the first (vLLM's request time per output token); None with
        fewer than two outputs carrying tokens."""
        gaps = len(self.token_times_s) - 1
        return self.decode_s / gaps if gaps > 0 else None

    @property
    def prefill_s(self) -> Optional[float]:
        """First admission -> first token."""
        if self.ttft_s is None or self.queue_s is None:
            return None
        return max(0.0, self.ttft_s - self.queue_s)


class _WithoutCreated:
    """A collector exporting `registry`'s metrics without their `_created` samples. prometheus_client
    builds fresh Metric objects on every collect, so filtering them changes nothing shared."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class _EngineCollector:
    """Exports the most recent EngineSnapshot (nothing before the first one), labelled with the model."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: Optional[EngineSnapshot] = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        for field_name, name, help_text in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=(MODEL_LABEL,))
            family.add_metric((self.model_name,), snap.counters.get(field_name, 0))
            yield family
        for name, help_text, value in _engine_gauges(snap):
            family = GaugeMetricFamily(name, help_text, labels=(MODEL_LABEL,))
            family.add_metric((self.model_name,), value)
            yield family
        for series, kind in ((_TIER_SERIES, CounterMetricFamily), (_TIER_GAUGES, GaugeMetricFamily)):
            for field_name, help_text in series:
                family = kind(TIER_PREFIX + field_name, help_text, labels=(MODEL_LABEL,))
                family.add_metric((self.model_name,), getattr(snap.tier, field_name))
                yield family


def _engine_gauges(snap: EngineSnapshot) -> tuple[tuple[str, str, float], ...]:
    """(name, help, value) of every engine gauge."""
    prompt = snap.counters.get("prompt_tokens", 0)
    prefix = snap.counters.get("prefix_tokens", 0)
    relocated = snap.counters.get("relocated_tokens", 0)
    return (
        ("kvsplice_num_requests_running", "requests being run", snap.num_running),
        ("kvsplice_num_requests_waiting", "requests waiting for admission", snap.num_waiting),
        ("kvsplice_kv_slots_capacity", "KV pool size in slots (one slot holds one token's K/V)", snap.slots_total),
        ("kvsplice_kv_slots_in_use", "KV slots held by running requests and SCR sessions", snap.slots_in_use),
        ("kvsplice_kv_slots_free", "KV slots free", snap.slots_free),
        ("kvsplice_kv_slots_cached", "KV slots held by the radix cache", snap.slots_cached),
        ("kvsplice_decode_arena_bytes", "bytes held by the decode arena (contiguous copies of decoding "
         "requests' K/V; grows with use up to --decode-arena-tokens tokens' worth, never beyond)",
         snap.decode_arena_bytes),
        ("kvsplice_kv_pool_usage_ratio", "share of KV slots in use (not free, not cache)",
         snap.slots_in_use / snap.slots_total if snap.slots_total else 0.0),
        ("kvsplice_prefix_cache_hit_ratio",
         "share of prompt tokens served by the prefix cache (prefix_tokens / prompt_tokens)",
         prefix / prompt if prompt else 0.0),
        ("kvsplice_cache_hit_ratio", "share of prompt tokens not prefilled ((prefix + relocated) / prompt_tokens)",
         (prefix + relocated) / prompt if prompt else 0.0),
    )


class ServerMetrics:
    """The metrics of one app, every series labelled `model_name=model_name`. `render()` gives the
    exposition text. `max_model_len` bounds the request-length histograms' buckets."""

    def __init__(self, model_name: str, replica_name: Optional[str] = None, max_model_len: int = 8192) -> None:
        self.model_name = model_name
        self.requests_registry = CollectorRegistry()
        self._define_request_metrics(token_count_buckets(max_model_len))
        self._engine = _EngineCollector(model_name)
        self.registry = CollectorRegistry()
        self.registry.register(_WithoutCreated(self.requests_registry))
        self.registry.register(self._engine)
        # one constant series naming the replica, so a fleet's scrapes can be told apart
        self.replica.labels(model_name, replica_name or "").set(1)

    def _define_request_metrics(self, length_buckets: tuple[float, ...]) -> None:
        registry, model = self.requests_registry, (MODEL_LABEL,)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]):
            return Histogram(name, help_text, model, buckets=buckets, registry=registry).labels(self.model_name)

        self.replica = Gauge("kvsplice_replica_info", "this server's replica name (value is always 1)",
                             model + ("replica",), registry=registry)
        self.requests = Counter("kvsplice_requests", "requests answered, by endpoint and finish reason",
                                model + ("endpoint", "finish_reason"), registry=registry)
        self.request_errors = Counter("kvsplice_request_errors", "requests refused or failed, by HTTP status",
                                      model + ("status",), registry=registry)
        self.fallbacks = Counter("kvsplice_scr_fallbacks", "requests whose SCR relocation fell back, by reason",
                                 model + ("reason",), registry=registry)
        self.ttft = histogram("kvsplice_time_to_first_token_seconds", "time from arrival to the first token",
                              TTFT_BUCKETS)
        self.itl = histogram("kvsplice_inter_token_latency_seconds", "time between two consecutive tokens",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("kvsplice_time_per_output_token_seconds",
                              "one request's mean time per output token after the first", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("kvsplice_e2e_request_latency_seconds", "time from arrival to the last token",
                             E2E_BUCKETS)
        self.queue = histogram("kvsplice_request_queue_time_seconds", "time from arrival to admission",
                               QUEUE_BUCKETS)
        self.prefill = histogram("kvsplice_request_prefill_time_seconds", "time from admission to the first token",
                                 E2E_BUCKETS)
        self.decode = histogram("kvsplice_request_decode_time_seconds", "time from the first to the last token",
                                E2E_BUCKETS)
        self.prompt_len = histogram("kvsplice_request_prompt_tokens", "prompt tokens per request", length_buckets)
        self.generation_len = histogram("kvsplice_request_generation_tokens", "generated tokens per request",
                                        length_buckets)

    def observe_request(self, obs: RequestObservation) -> None:
        """Record one finished (or aborted) request."""
        self.requests.labels(self.model_name, obs.endpoint, obs.finish_reason or "unknown").inc()
        self.e2e.observe(obs.e2e_s)
        for histogram, value in ((self.ttft, obs.ttft_s), (self.queue, obs.queue_s), (self.prefill, obs.prefill_s),
                                 (self.decode, obs.decode_s), (self.tpot, obs.time_per_output_token_s)):
            if value is not None:
                histogram.observe(value)
        for gap in obs.inter_token_latencies_s:
            self.itl.observe(gap)
        if obs.prompt_tokens:  # it reached the engine (prompts are never empty): its lengths are known
            self.prompt_len.observe(obs.prompt_tokens)
            self.generation_len.observe(obs.generation_tokens)
        if obs.fallback:
            self.fallbacks.labels(self.model_name, obs.fallback).inc()

    def observe_error(self, status: int) -> None:
        """Record one request answered with an HTTP error status."""
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self, snapshot: Optional[EngineSnapshot]) -> bytes:
        """The Prometheus text exposition; `snapshot` (if given) replaces the engine figures."""
        if snapshot is not None:
            self._engine.snapshot = snapshot
        return generate_latest(self.registry)
