"""The `kvsplice` command: argument parsing, exit codes, precedence of SCR settings, generate and serve."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from kvsplice.cli import (SCR_FLAG_FIELDS, add_scr_args, build_parser, engine_config_from_args, main,
                          resolve_prefill_lane_threads, reuse_config_from_args)
from kvsplice.reuse.config import ENV_TABLE
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
    assert "--model" in out and "--scr-max-spans" in out and "--scr-enabled" in out and "--replica-name" in out
    assert "--tool-call-parser" in out and "--chat-template" in out


GROUPS = ("model", "cache", "scheduler", "suffix cache reuse (SCR)", "server / frontend")


def _shown_options(help_text: str) -> list[str]:
    """The option strings of every option line of an argparse help text (`  --a X, --b X   help`)."""
    shown = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            shown += [part.split()[0] for part in invocation.split(", ")]
    return shown


def test_serve_help_has_at_most_40_options_in_vllm_s_groups(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # one option per line: argparse wraps to the terminal width
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    shown = [opt for opt in _shown_options(out) if opt not in ("-h", "--help")]
    assert len(shown) == len(set(shown)) and 20 <= len(shown) <= 39, shown   # 40 with -h, --help
    for title in GROUPS:
        assert f"\n{title}:\n" in out, title
    assert not {"--no-scr", "--model-path", "--scr-match-min-ratio", "--scr-fastdiff-min"} & set(shown)
    scr_flags = {entry.flag for entry in ENV_TABLE if entry.field in SCR_FLAG_FIELDS}
    assert scr_flags <= set(shown) and len(scr_flags) <= 8


def test_scr_flags_tolerate_settings_missing_from_the_table():
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("scr")
    add_scr_args(group, tuple(entry for entry in ENV_TABLE if entry.field not in ("seam_tokens", "enabled")))
    assert "--scr-seam-tokens" not in parser.format_help()
    assert parser.parse_args(["--scr-tail", "4"]).scr_tail == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--no-scr"])   # no enabled setting: no alias for it either


@pytest.mark.parametrize("argv", [
    [], ["frobnicate"], ["serve", "--num-slots", "many"], ["serve", "--scr-tail", "x"],
    ["serve", "--scr-tail", "0"], ["serve", "--num-slots", "0"], ["serve", "--model", "/does/not/exist"],
    ["serve", "--port", "70000"], ["generate"], ["report", "/does/not/exist.jsonl"],
    ["serve", "--tool-call-parser", "pythonic"], ["serve", "--chat-template", "/no/such/template.jinja"],
    ["serve", "--chat-template", "{% for m in messages %}"], ["serve", "--decode-threads", "0"],
    ["serve", "--decode-threads", "some"], ["serve", "--prefill-lane-threads", "-1"],
    ["serve", "--prefill-lane-threads", "one"], ["serve", "--scr-seam-tokens", "-1"], ["serve", "--scr-enabled", "maybe"],
    ["serve", "--weight-format", "int3"], ["serve", "--step-budget-ratio", "fast"], ["serve", "--no-scr", "1"],
    ["serve", "--scr-match-min-ratio", "2"], ["serve", "--scr-cdc-target", "100"], ["generate", "--prompt", "x", "--scr-tail", "0"],
])
def test_bad_input_exits_2_with_a_message(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip()


@pytest.mark.parametrize("overrides,named", [
    ('{"vocab_size": 3}', "'vocab_size'"), ('{"rope_scaling": {"rope_type": "yarn", "factr": 4}}', "'rope_scaling.factr'"),
    ('{"max_position_embeddings": "32768"}', "max_position_embeddings"), ("rope_scaling=yarn", "not JSON"),
])
def test_hf_overrides_with_an_unknown_or_ill_typed_key_exits_2_naming_it(overrides, named, capsys):
    assert main(["serve", "--hf-overrides", overrides]) == 2
    err = capsys.readouterr().err
    assert "argument --hf-overrides: " in err and named in err


def test_hf_overrides_flag_reaches_the_engine_config():
    text = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 32768}'
    config = engine_config_from_args(_serve_args("--hf-overrides", text), {})
    assert json.loads(config.hf_overrides) == json.loads(text)
    assert engine_config_from_args(_serve_args(), {}).hf_overrides is None


def test_scr_precedence_flag_over_env_over_default():
    env = {"KVREUSE_MAX_BLOCKS": "3", "KVREUSE_V6_MIN_EXTEND": "4"}
    config = reuse_config_from_args(_serve_args("--scr-max-spans", "5"), env)
    assert (config.max_spans, config.tail) == (5, 4)
    assert config.min_span == reuse_config_from_args(_serve_args(), {}).min_span
    assert reuse_config_from_args(_serve_args("--scr-enabled", "0"), {"KVREUSE_ENABLED": "1"}).enabled is False
    assert reuse_config_from_args(_serve_args("--scr-enabled"), {"KVREUSE_ENABLED": "0"}).enabled is True
    config = reuse_config_from_args(_serve_args("--scr-seam-tokens", "4", "--scr-message-start-tokens", "0"), {})
    assert (config.seam_tokens, config.message_start_tokens) == (4, 0)


@pytest.mark.parametrize("old, new, replacement", [
    (["--no-scr"], ["--scr-enabled", "0"], "--scr-enabled 0"),
    (["--model-path", "m"], ["--model", "m"], "--model"),
    (["--scr-match-min-ratio", "0.7"], [], "KVREUSE_MATCH_MIN_RATIO"),
    (["--scr-max-sessions", "3"], [], "KVREUSE_MAX_SESSIONS"),
    (["--scr-state-mode", "fork"], [], "KVREUSE_SSM_MODE"),
])
def test_deprecated_flags_still_work_and_name_their_replacement(old, new, replacement, capsys):
    variable = next((entry.name for entry in ENV_TABLE if entry.flag == old[0]), None)
    environ = {variable: old[1]} if variable else {}
    expected = engine_config_from_args(_serve_args(*new), {} if new else environ)
    assert capsys.readouterr().err == ""
    assert engine_config_from_args(_serve_args(*old), {}) == expected
    warning = capsys.readouterr().err.strip()
    assert warning.count("\n") == 0 and old[0] in warning and "deprecated" in warning and replacement in warning


def test_every_hidden_scr_flag_sets_its_setting():
    for entry in ENV_TABLE:
        if entry.field not in SCR_FLAG_FIELDS:
            default = getattr(reuse_config_from_args(_serve_args(), {}), entry.field)
            raw = {bool: "1", int: "8", float: "0.25"}.get(type(default))
            if raw is not None:
                config = reuse_config_from_args(_serve_args(entry.flag, raw), {})
                assert getattr(config, entry.field) == getattr(reuse_config_from_args(_serve_args(), {entry.name: raw}),
                                                               entry.field), entry.flag


def test_engine_flags():
    args = _serve_args("--model", "m", "--num-slots", "128", "--max-batch-tokens", "64", "--max-running", "2",
                       "--max-waiting", "3", "--max-model-len", "100", "--dtype", "bfloat16", "--no-prefix-cache")
    config = engine_config_from_args(args, {})
    assert (config.model, config.num_slots, config.max_batch_tokens, config.max_running, config.max_waiting,
            config.max_model_len, config.dtype, config.prefix_cache) == ("m", 128, 64, 2, 3, 100, "bfloat16", False)


def test_prefill_lane_threads_auto_is_one_thread_where_there_are_two():
    assert resolve_prefill_lane_threads("auto", 2) == 1 and resolve_prefill_lane_threads("auto", 16) == 1
    assert resolve_prefill_lane_threads("auto", 1) == 0 and resolve_prefill_lane_threads(0, 8) == 0
    assert engine_config_from_args(_serve_args("--prefill-lane-threads", "3"), {}).prefill_lane_threads == 3


def test_compile_decode_flag():
    """auto by default; a bare flag is on (as before it took a value); a bad value exits 2."""
    assert engine_config_from_args(_serve_args("--compile-decode"), {}).compile_decode == "on"
    assert engine_config_from_args(_serve_args(), {}).compile_decode == "auto"
    for value in ("auto", "on", "off"):
        assert engine_config_from_args(_serve_args("--compile-decode", value), {}).compile_decode == value
    assert main(["serve", "--compile-decode", "sometimes"]) == 2
    assert build_parser().parse_args(["pull", "--compile"]).compile is True


def test_pull_takes_a_model_of_ones_own(tiny_dir, capsys):
    """`kvsplice pull --model PATH` loads that model once (a GGUF: converted into the cache), not the
    default model; a path that does not exist exits 2 naming it."""
    assert main(["pull", "--model", str(tiny_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"{tiny_dir}: {tiny_dir.name} (llama) ready"
    assert main(["pull", "--model", "/no/such/model.gguf", "--compile"]) == 2
    assert "--model: /no/such/model.gguf does not exist" in capsys.readouterr().err


def test_fused_relocation_flag():
    """auto by default (the server's); a bare flag is on; a bad value exits 2."""
    assert engine_config_from_args(_serve_args(), {}).fused_relocation == "auto"
    assert engine_config_from_args(_serve_args("--fused-relocation"), {}).fused_relocation == "on"
    for value in ("auto", "on", "off"):
        assert engine_config_from_args(_serve_args("--fused-relocation", value), {}).fused_relocation == value
    assert main(["serve", "--fused-relocation", "sometimes"]) == 2


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


def test_tenant_share_grammar_timeout_and_admin_key_flags():
    args = _serve_args("--tenant-kv-share", "0.25", "--grammar-compile-timeout", "2.5", "--admin-api-key", "op-key")
    config = engine_config_from_args(args, {})
    assert config.tenant_kv_share == 0.25 and config.grammar_compile_timeout == 2.5
    assert args.admin_api_key == "op-key"
    assert engine_config_from_args(_serve_args(), {}).grammar_compile_timeout == 5.0
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="tenant_kv_share"):
            engine_config_from_args(_serve_args("--tenant-kv-share", bad), {})
