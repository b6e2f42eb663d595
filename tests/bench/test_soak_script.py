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
    # six seconds are all warm-up (kernel code for new shapes still filling): the memory limit is
    # for long runs, so it is lifted here; everything else is checked as in a real soak
    status = soak.main(["--tiny", "--duration", "6", "--clients", "2", "--max-rss-growth-mb", "100000",
                        "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    result = json.loads(out.read_text())
    assert result["server_errors"] == 0 and result["failures"] == []
    assert result["idle"]["idle"] and result["idle"]["slots_in_use_after_flush"] == 0
    assert "verdict: PASS" in printed


def test_late_growth_is_measured_over_the_second_half(monkeypatch):
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    soak = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, soak)
    spec.loader.exec_module(soak)
    # caches filling early (2,900 -> 3,200 MiB), then flat: no growth in the second half
    flat = [[120, 200, 2900.0, 0.0], [200, 400, 3200.0, 0.0], [300, 600, 3150.0, 0.0], [400, 800, 3150.0, 0.0],
            [500, 1400, 3150.0, 0.0]]
    assert soak.late_growth(flat) == 0.0
    # the decode arena growing to its bound late in the run is not a leak: growth is net of it
    arena = [row[:3] + [0.0] for row in flat[:-1]] + [[500, 1400, 3450.0, 300.0]]
    assert soak.late_growth(arena) == 0.0
    # a leak: 1 MiB per 10 requests all along
    leak = [[t, n, 2900.0 + n / 10, 0.0] for t, n in ((120, 200), (200, 400), (300, 600), (400, 800), (500, 1400))]
    assert abs(soak.late_growth(leak) - 100.0) < 1e-9
    assert soak.late_growth(leak[:1]) is None and soak.late_growth([row for row in leak if row[1] < 500]) is None
