"""The disk tier through the server: `usage.reuse.disk_tokens`, the `kvsplice_kv_disk_*` series of
/metrics, POST /flush_cache emptying it, and the `--kv-disk-dir` / `--kv-disk-gb` flags."""

from __future__ import annotations

import httpx
import pytest
import torch

from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.cli import BAD_INPUT, build_parser, engine_config_from_args, main
from tests.server.conftest import engine_call, start_server

PROMPT_TOKENS = 140


def prompt_ids(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (PROMPT_TOKENS,), generator=generator).tolist()


@pytest.fixture(scope="module")
def tier_server(tiny_model_dir, tmp_path_factory):
    tier = DiskTierConfig(tmp_path_factory.mktemp("tier"), budget_bytes=50_000_000, write_queue_size=256)
    running = start_server(tiny_model_dir, num_slots=320, max_batch_tokens=512, disk_tier=tier)
    yield running
    running.thread.stop()


def complete(server, prompt: list[int]) -> dict:
    body = {"model": server.model_dir.name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def evict(server) -> None:
    for seed in (201, 202):
        complete(server, prompt_ids(seed))
    engine = server.state.engine
    engine_call(server, lambda: engine.cache.tier.wait_writes())


def test_a_returning_prompt_is_loaded_from_disk_and_counted(tier_server):
    prompt = prompt_ids(1)
    first = complete(tier_server, prompt)
    assert first["usage"]["reuse"]["disk_tokens"] == 0
    evict(tier_server)
    assert tier_server.metric("kvsplice_kv_disk_writes_total") >= 1
    assert tier_server.metric("kvsplice_kv_disk_entries") >= 1
    assert tier_server.metric("kvsplice_kv_disk_bytes_used") > 0
    again = complete(tier_server, prompt)
    reuse = again["usage"]["reuse"]
    assert reuse["disk_tokens"] > 0 and reuse["prefix_tokens"] >= reuse["disk_tokens"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert tier_server.metric("kvsplice_kv_disk_hits_total") >= 1
    assert tier_server.metric("kvsplice_kv_disk_loads_total") >= 1
    assert tier_server.metric("kvsplice_kv_disk_load_seconds_total") > 0
    assert tier_server.metric("kvsplice_disk_tokens_total") >= reuse["disk_tokens"]
    assert tier_server.metric("kvsplice_kv_disk_write_errors_total") == 0


def test_flush_cache_empties_the_tier(tier_server):
    complete(tier_server, prompt_ids(2))
    evict(tier_server)
    assert tier_server.metric("kvsplice_kv_disk_entries") >= 1
    assert httpx.post(f"{tier_server.url}/flush_cache", timeout=10).status_code == 200
    engine = tier_server.state.engine
    engine_call(tier_server, lambda: engine.cache.tier.wait_writes())
    assert tier_server.metric("kvsplice_kv_disk_entries") == 0
    assert complete(tier_server, prompt_ids(2))["usage"]["reuse"]["disk_tokens"] == 0


def test_the_tier_series_are_zero_without_a_tier(server):
    assert server.metric("kvsplice_kv_disk_hits_total") == 0
    assert server.metric("kvsplice_kv_disk_entries") == 0


def test_the_flags_make_a_disk_tier_config(tmp_path):
    args = build_parser().parse_args(["serve", "--kv-disk-dir", str(tmp_path / "t"), "--kv-disk-gb", "2.5"])
    tier = engine_config_from_args(args, {}).disk_tier
    assert tier.dir == tmp_path / "t" and tier.budget_bytes == 2_500_000_000 and tier.dir.is_dir()
    assert engine_config_from_args(build_parser().parse_args(["serve"]), {}).disk_tier is None


def test_the_flags_are_in_serve_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--kv-disk-dir DIR" in out and "--kv-disk-gb F" in out
    assert "--decode-arena-tokens" not in out and "--num-state-slots" not in out


@pytest.mark.parametrize("make_argv, needle", [
    (lambda d: ["--kv-disk-dir", str(d / "a-file")], "not a directory"),
    (lambda d: ["--kv-disk-dir", str(d / "a-file" / "below")], "cannot write"),
    (lambda d: ["--kv-disk-gb", "4"], "--kv-disk-dir"),
    (lambda d: ["--kv-disk-dir", str(d / "t"), "--kv-disk-gb", "0"], "--kv-disk-gb"),
    (lambda d: ["--kv-disk-dir", str(d / "t"), "--kv-disk-gb", "lots"], "--kv-disk-gb"),
])
def test_a_bad_tier_directory_or_budget_exits_2(make_argv, needle, tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a directory")
    assert main(["serve", *make_argv(tmp_path)]) == BAD_INPUT
    assert needle in capsys.readouterr().err


def test_a_directory_another_server_holds_exits_2(tiny_model_dir, tmp_path):
    """The tier's lock is taken when the engine is built: a second server on the same directory
    stops at start with status 2 and says why."""
    import subprocess
    import sys

    from kvsplice.cache.disk_tier import DiskTier
    from tests.cache.tier_helpers import identity

    with DiskTier(DiskTierConfig(tmp_path / "tier", 10**6), identity()):
        done = subprocess.run([sys.executable, "-m", "kvsplice.cli", "serve", "--model", str(tiny_model_dir),
                               "--kv-disk-dir", str(tmp_path / "tier"), "--port", "0"],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == BAD_INPUT
    assert "--kv-disk-dir" in done.stderr and "in use by another server" in done.stderr
