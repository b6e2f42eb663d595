"""The model cache proves itself: manifest written by the converter, checked on every load, damage re-converted.

Every test converts a tiny GGUF written in the test (see test_gguf_convert.py) into a temporary cache.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from kvsplice.cli import main as cli_main
from kvsplice.models.gguf_convert import CONVERTER_VERSION, convert_gguf, ensure_converted
from kvsplice.models.loader import load_checkpoint
from kvsplice.models.manifest import (MANIFEST_FILE, STAMP_FILE, ModelCacheError, check_cache, read_manifest,
                                      sha256_of)

WEIGHTS = "model.safetensors"


def gguf_test_helpers():
    """The tiny-GGUF writer of test_gguf_convert.py, loaded by path (independent of pytest import mode)."""
    spec = importlib.util.spec_from_file_location("gguf_test_helpers", Path(__file__).with_name("test_gguf_convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_gguf(tmp_path):
    """(path of a tiny llama GGUF, the fp32 tensors its conversion must hold)."""
    path = tmp_path / "tiny.gguf"
    _, expected = gguf_test_helpers().write_tiny_gguf(path, "llama", tied=True)
    return path, expected


@pytest.fixture
def converted(tmp_path, tiny_gguf, monkeypatch):
    """The tiny GGUF loaded once through load_checkpoint into a temporary KVSPLICE_CACHE; its cache dir."""
    monkeypatch.setenv("KVSPLICE_CACHE", str(tmp_path / "cache"))
    load_checkpoint(str(tiny_gguf[0]))
    (cache_dir,) = (tmp_path / "cache" / "models" / "gguf").iterdir()
    return cache_dir


def zero_region(path: Path, offset: int, length: int) -> None:
    """Overwrite `length` bytes at `offset` with zeros in place (the file keeps its size)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes(length))


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def assert_holds(checkpoint, expected) -> None:
    assert set(checkpoint.state_dict) == set(expected)
    assert all(torch.equal(checkpoint.state_dict[name], expected[name]) for name in expected)


def test_manifest_records_every_written_file_and_the_source(converted, tiny_gguf):
    manifest = read_manifest(converted)
    assert manifest.converter_version == CONVERTER_VERSION
    written = {p.name for p in converted.iterdir()} - {MANIFEST_FILE, STAMP_FILE}
    assert set(manifest.files) == written and {WEIGHTS, "config.json", "tokenizer.json"} <= written
    for name, record in manifest.files.items():
        assert (record.size, record.sha256) == ((converted / name).stat().st_size, sha256_of(converted / name))
    gguf_path = tiny_gguf[0]
    assert manifest.source.path == str(gguf_path.resolve()) and manifest.source.size == gguf_path.stat().st_size
    assert manifest.source.sha256 == sha256_of(gguf_path)
    assert check_cache(converted, CONVERTER_VERSION, gguf_path).problem is None


def test_intact_cache_is_neither_reconverted_nor_rehashed(converted, tiny_gguf, capsys):
    weights_mtime = (converted / WEIGHTS).stat().st_mtime_ns
    stamp_mtime = (converted / STAMP_FILE).stat().st_mtime_ns
    capsys.readouterr()
    assert_holds(load_checkpoint(str(tiny_gguf[0])), tiny_gguf[1])
    assert_holds(load_checkpoint(str(converted)), tiny_gguf[1])
    assert (converted / WEIGHTS).stat().st_mtime_ns == weights_mtime
    # The stamp is rewritten only when a file had to be hashed again.
    assert (converted / STAMP_FILE).stat().st_mtime_ns == stamp_mtime
    assert capsys.readouterr().err == ""


def test_zeroed_region_of_the_same_size_is_detected_and_reconverted(converted, tiny_gguf, capsys):
    weights = converted / WEIGHTS
    size = weights.stat().st_size
    zero_region(weights, size // 3, size // 3)
    assert weights.stat().st_size == size
    assert check_cache(converted, CONVERTER_VERSION, tiny_gguf[0]).usable is False
    capsys.readouterr()
    assert_holds(load_checkpoint(str(tiny_gguf[0])), tiny_gguf[1])
    message = capsys.readouterr().err.strip().splitlines()[0]
    assert "model.safetensors does not match its sha256" in message and "re-converting" in message
    assert sha256_of(weights) == read_manifest(converted).files[WEIGHTS].sha256


def test_truncated_weights_are_reconverted(converted, tiny_gguf, capsys):
    size = (converted / WEIGHTS).stat().st_size
    truncate_to_half(converted / WEIGHTS)
    capsys.readouterr()
    assert_holds(load_checkpoint(str(tiny_gguf[0])), tiny_gguf[1])
    assert f"model.safetensors is {size // 2} bytes, the manifest says {size}" in capsys.readouterr().err
    assert check_cache(converted, CONVERTER_VERSION, tiny_gguf[0]).problem is None


def test_a_directly_loaded_cache_is_repaired_before_it_is_loaded(converted, tiny_gguf):
    zero_region(converted / WEIGHTS, 200, 4096)
    assert_holds(load_checkpoint(str(converted)), tiny_gguf[1])
    (converted / "config.json").write_text("{}")  # same as a damaged config: never loaded as is
    checkpoint = load_checkpoint(str(converted))
    assert checkpoint.hf_config["num_hidden_layers"] == 2


@pytest.mark.parametrize("damage", [truncate_to_half, lambda p: zero_region(p, 200, 4096), os.unlink])
def test_damaged_cache_whose_source_is_gone_is_refused(converted, tiny_gguf, damage):
    damage(converted / WEIGHTS)
    tiny_gguf[0].unlink()
    with pytest.raises(ModelCacheError, match="is damaged: model.safetensors .*tiny.gguf\\) is gone"):
        load_checkpoint(str(converted))


def test_cli_exits_2_with_one_line_when_the_cache_is_damaged_and_its_source_gone(converted, tiny_gguf, capsys):
    zero_region(converted / WEIGHTS, 200, 4096)
    tiny_gguf[0].unlink()
    capsys.readouterr()
    assert cli_main(["generate", "--model", str(converted), "--prompt", "hello", "--max-tokens", "1"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("kvsplice generate: the model cache")
    assert "does not match its sha256" in error and "is gone" in error


def test_intact_cache_whose_source_is_gone_still_loads(converted, tiny_gguf):
    tiny_gguf[0].unlink()
    assert_holds(load_checkpoint(str(converted)), tiny_gguf[1])


def test_cache_without_manifest_is_reconverted(converted, tiny_gguf, capsys):
    (converted / MANIFEST_FILE).unlink()  # what an older kvsplice left behind
    capsys.readouterr()
    assert_holds(load_checkpoint(str(tiny_gguf[0])), tiny_gguf[1])
    assert f"has no {MANIFEST_FILE}" in capsys.readouterr().err
    assert read_manifest(converted) is not None


def test_unreadable_manifest_counts_as_damage(converted, tiny_gguf):
    (converted / MANIFEST_FILE).write_text('{"format": 1, "files": [')
    verdict = check_cache(converted, CONVERTER_VERSION, tiny_gguf[0])
    assert not verdict.usable and "unreadable manifest" in verdict.problem
    with pytest.raises(ModelCacheError, match="is unknown"):
        ensure_converted(None, converted)
    assert ensure_converted(tiny_gguf[0], converted, progress=False) == converted
    assert check_cache(converted, CONVERTER_VERSION, tiny_gguf[0]).problem is None


def test_touched_but_unchanged_file_is_rehashed_once_and_kept(converted, tiny_gguf):
    weights = converted / WEIGHTS
    inode = weights.stat().st_ino
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))
    stamped_before = json.loads((converted / STAMP_FILE).read_text())["files"][WEIGHTS]
    assert ensure_converted(tiny_gguf[0], converted, progress=False) == converted
    assert weights.stat().st_ino == inode  # not re-converted
    stamped_after = json.loads((converted / STAMP_FILE).read_text())["files"][WEIGHTS]
    assert stamped_after != stamped_before and stamped_after["stat"][1] == 1_000_000_000


def test_a_changed_source_is_reconverted_and_an_unchanged_copy_is_not(tmp_path, tiny_gguf, capsys):
    out_dir = convert_gguf(tiny_gguf[0], tmp_path / "out", progress=False)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(tiny_gguf[0].read_bytes())  # same content, new path and mtime: hashed, kept
    weights_inode = (out_dir / WEIGHTS).stat().st_ino
    assert ensure_converted(copy, out_dir, progress=False) == out_dir
    assert (out_dir / WEIGHTS).stat().st_ino == weights_inode
    _, other = gguf_test_helpers().write_tiny_gguf(tiny_gguf[0], "llama", tied=True, seed=7)
    capsys.readouterr()
    ensure_converted(tiny_gguf[0], out_dir, progress=False)
    assert "was converted from a different GGUF" in capsys.readouterr().err
    assert_holds(load_checkpoint(str(out_dir)), other)


def test_an_older_converter_version_is_reconverted_when_the_source_is_there(tmp_path, tiny_gguf, capsys):
    out_dir = convert_gguf(tiny_gguf[0], tmp_path / "out", progress=False)
    manifest = json.loads((out_dir / MANIFEST_FILE).read_text())
    (out_dir / MANIFEST_FILE).write_text(json.dumps({**manifest, "converter_version": "0"}))
    verdict = check_cache(out_dir, CONVERTER_VERSION, tiny_gguf[0])
    assert verdict.usable and "converter version 0" in verdict.problem
    assert ensure_converted(None, out_dir) == out_dir  # no source: the intact cache is used
    capsys.readouterr()
    ensure_converted(tiny_gguf[0], out_dir, progress=False)
    assert "converter version 0" in capsys.readouterr().err
    assert read_manifest(out_dir).converter_version == CONVERTER_VERSION


def test_a_cache_that_cannot_be_written_is_a_clean_error(tmp_path, tiny_gguf):
    (tmp_path / "not-a-dir").write_text("a file where the cache's parent should be")
    with pytest.raises(ModelCacheError, match="cannot write the model cache"):
        ensure_converted(tiny_gguf[0], tmp_path / "not-a-dir" / "out", progress=False)
