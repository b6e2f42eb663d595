"""benchmarks/soak.py end to end on the tiny model for a few seconds: the script runs its traffic,
reads the server's metrics, waits for idle, flushes, and passes (no 5xx, nothing leaked)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_short_soak_on_the_tiny_model_passes(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    soak = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, soak)   # its dataclasses look their module up there
    spec.loader.exec_module(soak)
    # the script sets KVSPLICE_API_KEY for its server; this restores the variable afterwards
    monkeypatch.setenv("KVSPLICE_API_KEY", "")
    out = tmp_path / "soak.json"
    status = soak.main(["--tiny", "--duration", "6", "--clients", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    result = json.loads(out.read_text())
    assert result["server_errors"] == 0 and result["failures"] == []
    assert result["idle"]["idle"] and result["idle"]["slots_in_use_after_flush"] == 0
    assert "verdict: PASS" in printed
