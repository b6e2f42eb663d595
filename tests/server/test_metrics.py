"""The Prometheus exposition: what each observation records, and that operators' tools accept it
(`promtool check metrics` when promtool is installed, and always an equivalent parser check)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvsplice.server.metrics import EngineSnapshot, RequestObservation, ServerMetrics, token_count_buckets

SNAPSHOT = EngineSnapshot(counters={"prompt_tokens": 10, "prefix_tokens": 4, "relocated_tokens": 2},
                          num_running=1, num_waiting=0, slots_total=100, slots_in_use=7, slots_free=90, slots_cached=3)
# promtool's unit lints: abbreviations and non-base units in metric names
ABBREVIATED_UNIT = re.compile(r"_(ms|sec|secs|us|ns|min|mins|kb|mb|gb|pct|perc)(_|$)")
NON_BASE_UNIT = re.compile(r"_(milliseconds|microseconds|nanoseconds|minutes|hours|days|kilobytes|megabytes|"
                           r"gigabytes|percent)(_|$)")
SNAKE_CASE = re.compile(r"^[a-z_][a-z0-9_]*$")


def lint_exposition(text: str, label: str = "model_name") -> list[str]:
    """promtool's `check metrics` rules (help text, counter/_total naming, reserved suffixes, units, snake
    case), plus: no `_created` series, histogram buckets cumulative and ending in +Inf == _count, and a
    `label` label on every series. Returns the problems found (empty: clean)."""
    problems = []
    for family in text_string_to_metric_families(text):
        name, kind = family.name, family.type
        if not family.documentation:
            problems.append(f"{name}: no help text")
        if not SNAKE_CASE.match(name):
            problems.append(f"{name}: not snake_case")
        if ABBREVIATED_UNIT.search(name) or NON_BASE_UNIT.search(name):
            problems.append(f"{name}: abbreviated or non-base unit")
        if kind == "histogram" and not name.endswith(("_seconds", "_tokens")):
            problems.append(f"{name}: a histogram without its unit (seconds, tokens)")
        for sample in family.samples:
            problems += _sample_problems(sample, kind, label)
        if kind == "histogram":
            problems += _histogram_problems(family)
    return problems


def _sample_problems(sample, kind: str, label: str) -> list[str]:
    problems = []
    if sample.name.endswith("_created"):
        problems.append(f"{sample.name}: a _created series")
    if kind == "counter" and not sample.name.endswith("_total"):
        problems.append(f"{sample.name}: a counter without the _total suffix")
    if kind != "counter" and sample.name.endswith("_total"):
        problems.append(f"{sample.name}: a {kind} named like a counter (_total)")
    if kind not in ("histogram", "summary") and sample.name.endswith(("_bucket", "_count", "_sum")):
        problems.append(f"{sample.name}: a {kind} with a histogram suffix")
    if label not in sample.labels:
        problems.append(f"{sample.name}{sample.labels}: no {label} label")
    return problems


def _histogram_problems(family) -> list[str]:
    buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
    counts = [s.value for s in family.samples if s.name.endswith("_count")]
    if not buckets or not counts or not any(s.name.endswith("_sum") for s in family.samples):
        return [f"{family.name}: a histogram without buckets, _count or _sum"]
    problems = []
    if any(later < earlier for (_, earlier), (_, later) in zip(buckets, buckets[1:])):
        problems.append(f"{family.name}: bucket counts are not cumulative")
    if not math.isinf(buckets[-1][0]) or buckets[-1][1] != counts[0]:
        problems.append(f"{family.name}: the +Inf bucket is missing or differs from _count")
    return problems


def samples_of(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def promtool_problems(text: str) -> str | None:
    """promtool's complaints (None when clean); skips the test when promtool is not installed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else (done.stdout + done.stderr).strip()


def observed_metrics() -> ServerMetrics:
    metrics = ServerMetrics("tiny", "r0", max_model_len=1000)
    metrics.observe_request(RequestObservation("chat", "stop", e2e_s=0.5, ttft_s=0.2, queue_s=0.05,
                                               token_times_s=(10.0, 10.25, 10.75), prompt_tokens=10,
                                               generation_tokens=3, fallback="no_spans"))
    metrics.observe_error(404)
    return metrics


def test_one_request_fills_every_histogram_and_counter():
    values = samples_of(observed_metrics().render(SNAPSHOT).decode())
    assert values[("kvsplice_requests_total", (("endpoint", "chat"), ("finish_reason", "stop")))] == 1
    assert values[("kvsplice_request_errors_total", (("status", "404"),))] == 1
    assert values[("kvsplice_scr_fallbacks_total", (("reason", "no_spans"),))] == 1
    # inter-token latency: one observation per gap (0.25 s and 0.5 s); time per output token: their mean
    assert values[("kvsplice_inter_token_latency_seconds_count", ())] == 2
    assert values[("kvsplice_inter_token_latency_seconds_sum", ())] == pytest.approx(0.75)
    assert values[("kvsplice_time_per_output_token_seconds_count", ())] == 1
    assert values[("kvsplice_time_per_output_token_seconds_sum", ())] == pytest.approx(0.375)
    assert values[("kvsplice_request_queue_time_seconds_sum", ())] == pytest.approx(0.05)
    assert values[("kvsplice_request_prefill_time_seconds_sum", ())] == pytest.approx(0.15)
    assert values[("kvsplice_request_decode_time_seconds_sum", ())] == pytest.approx(0.75)
    assert values[("kvsplice_time_to_first_token_seconds_sum", ())] == pytest.approx(0.2)
    assert values[("kvsplice_e2e_request_latency_seconds_sum", ())] == pytest.approx(0.5)
    assert values[("kvsplice_request_prompt_tokens_sum", ())] == 10
    assert values[("kvsplice_request_generation_tokens_sum", ())] == 3
    assert values[("kvsplice_prompt_tokens_total", ())] == 10
    assert values[("kvsplice_prefix_cache_hit_ratio", ())] == pytest.approx(0.4)
    assert values[("kvsplice_cache_hit_ratio", ())] == pytest.approx(0.6)
    assert values[("kvsplice_kv_slots_capacity", ())] == 100 and values[("kvsplice_kv_slots_in_use", ())] == 7
    assert values[("kvsplice_replica_info", (("replica", "r0"),))] == 1


def test_a_request_without_tokens_records_no_token_latencies():
    metrics = ServerMetrics("tiny")
    metrics.observe_request(RequestObservation("chat", "abort", e2e_s=0.1))
    values = samples_of(metrics.render(None).decode())
    assert values[("kvsplice_requests_total", (("endpoint", "chat"), ("finish_reason", "abort")))] == 1
    for name in ("inter_token_latency", "time_per_output_token", "time_to_first_token", "request_queue_time"):
        assert values[(f"kvsplice_{name}_seconds_count", ())] == 0
    assert values[("kvsplice_request_prompt_tokens_count", ())] == 0


def test_every_series_is_labelled_with_the_model_name():
    text = observed_metrics().render(SNAPSHOT).decode()
    names = {s.labels.get("model_name") for f in text_string_to_metric_families(text) for s in f.samples}
    assert names == {"tiny"}


def test_exposition_is_lint_clean_and_the_lint_catches_what_promtool_rejects():
    assert lint_exposition(observed_metrics().render(SNAPSHOT).decode()) == []
    bad = ("# HELP kv_slots_total pool size\n# TYPE kv_slots_total gauge\nkv_slots_total 5\n"
           "# HELP reqs requests\n# TYPE reqs counter\nreqs_total 1\nreqs_created 1.7e9\n")
    problems = lint_exposition(bad)
    assert any("named like a counter" in p for p in problems)
    assert any("_created" in p for p in problems)
    assert any("no model_name label" in p for p in problems)


def test_promtool_accepts_the_exposition():
    assert promtool_problems(observed_metrics().render(SNAPSHOT).decode()) is None
    # the same check fails where it should (so a clean result means something)
    assert "non-counter metrics should not have" in promtool_problems(
        "# HELP kv_slots_total pool size\n# TYPE kv_slots_total gauge\nkv_slots_total 5\n")


def test_created_series_are_dropped_for_this_app_only():
    text = observed_metrics().render(SNAPSHOT).decode()
    assert "_created" not in text
    other = CollectorRegistry()
    Counter("other_events", "events", registry=other).inc()
    assert "other_events_created" in generate_latest(other).decode()


def test_registries_are_per_instance():
    assert "kvsplice_requests_total{" in observed_metrics().render(None).decode()
    assert "kvsplice_requests_total{" not in ServerMetrics("tiny").render(None).decode()


def test_token_count_buckets_follow_1_2_5_up_to_the_context():
    assert token_count_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_count_buckets(8192)[-1] == 5000


def test_live_server_metrics_after_a_streamed_request(server, client):
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="metrics please",
                                       max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for _ in stream) >= 1
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert lint_exposition(text) == []
    values = samples_of(text)
    assert values[("kvsplice_inter_token_latency_seconds_count", ())] >= 3
    assert values[("kvsplice_request_queue_time_seconds_count", ())] >= 1
    assert values[("kvsplice_generation_tokens_total", ())] >= 4
    names = {s.labels["model_name"] for f in text_string_to_metric_families(text) for s in f.samples}
    assert names == {server.state.model_name}
    if shutil.which("promtool"):
        assert promtool_problems(text) is None
