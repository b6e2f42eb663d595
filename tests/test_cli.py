"""The `kvsplice` command: argument parsing, exit codes, precedence of SCR settings, generate and serve."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from kvsplice.cli import (build_parser, engine_config_from_args, main, resolve_prefill_lane_threads,
                          reuse_config_from_args)
from kvsplice.server.launch import free_port
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli_tiny"))


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_help_exits_zero(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--scr-max-spans" in out and "--no-scr" in out and "--replica-name" in out
    assert "--tool-call-parser" in out and "--chat-template" in out


@pytest.mark.parametrize("argv", [
    [], ["frobnicate"], ["serve", "--num-slots", "many"], ["serve", "--scr-tail", "x"],
    ["serve", "--scr-tail", "0"], ["serve", "--num-slots", "0"], ["serve", "--model", "/does/not/exist"],
    ["serve", "--port", "70000"], ["generate"], ["report", "/does/not/exist.jsonl"],
    ["serve", "--tool-call-parser", "pythonic"], ["serve", "--chat-template", "/no/such/template.jinja"],
    ["serve", "--chat-template", "{% for m in messages %}"], ["serve", "--decode-threads", "0"],
    ["serve", "--decode-threads", "some"], ["serve", "--prefill-lane-threads", "-1"],
    ["serve", "--prefill-lane-threads", "one"],
])
def test_bad_input_exits_2_with_a_message(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip()


def test_scr_precedence_flag_over_env_over_default():
    env = {"KVREUSE_MAX_BLOCKS": "3", "KVREUSE_V6_MIN_EXTEND": "4"}
    config = reuse_config_from_args(_serve_args("--scr-max-spans", "5"), env)
    assert (config.max_spans, config.tail) == (5, 4)
    assert config.min_span == reuse_config_from_args(_serve_args(), {}).min_span
    assert reuse_config_from_args(_serve_args("--no-scr"), {}).enabled is False
    assert reuse_config_from_args(_serve_args("--scr-enabled", "0"), {"KVREUSE_ENABLED": "1"}).enabled is False


def test_engine_flags_and_model_path_alias():
    args = _serve_args("--model-path", "m", "--num-slots", "128", "--max-batch-tokens", "64", "--max-running", "2",
                       "--max-waiting", "3", "--max-model-len", "100", "--dtype", "bfloat16", "--no-prefix-cache")
    config = engine_config_from_args(args, {})
    assert (config.model, config.num_slots, config.max_batch_tokens, config.max_running, config.max_waiting,
            config.max_model_len, config.dtype, config.prefix_cache) == ("m", 128, 64, 2, 3, 100, "bfloat16", False)


def test_prefill_lane_threads_auto_is_one_thread_where_there_are_two():
    assert resolve_prefill_lane_threads("auto", 2) == 1 and resolve_prefill_lane_threads("auto", 16) == 1
    assert resolve_prefill_lane_threads("auto", 1) == 0 and resolve_prefill_lane_threads(0, 8) == 0
    assert engine_config_from_args(_serve_args("--prefill-lane-threads", "3"), {}).prefill_lane_threads == 3


def test_compile_decode_flag():
    assert engine_config_from_args(_serve_args("--compile-decode"), {}).compile_decode is True
    assert engine_config_from_args(_serve_args(), {}).compile_decode is False


def test_workload_dispatch(tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    assert main(["workload", "--out", str(out), "--conversations", "1", "--seed", "0", "--min-tokens", "100",
                 "--max-tokens", "200", "--min-turns", "2", "--max-turns", "2"]) == 0
    assert out.is_file()


def test_generate_prints_a_completion(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "Once upon a time", "--max-tokens", "3",
                 "--num-slots", "256"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--max-tokens", "2", "--chat",
                 "--num-slots", "256"]) == 0


def test_serve_subprocess_prints_start_line_and_serves(tiny_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvsplice.cli", "serve", "--model", str(tiny_dir), "--port",
                             str(port), "--num-slots", "512", "--scr-max-spans", "2", "--replica-name", "a"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvsplice.start "), line
        start = json.loads(line[len("kvsplice.start "):])
        assert start["reuse"]["max_spans"] == 2 and start["replica"] == "a"
        assert start["model_path"] == str(tiny_dir) and start["engine"]["num_slots"] == 512
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
        request_line = proc.stdout.readline()
        assert request_line.startswith("kvsplice.request ")
        assert json.loads(request_line[len("kvsplice.request "):])["replica"] == "a"
    finally:
        proc.terminate()
        proc.wait(20)
