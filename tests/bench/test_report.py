import json

import pytest

from kvsplice.bench.commands import report_main
from kvsplice.bench.report import Breakdown, RunError, build_report, format_report, load_run, write_report


def _usage(prompt, prefix, relocated, breakdown=(None, 0, 0, 0), flops=None, spans=0, session="matched"):
    changed, tails, unchosen, uncached = breakdown
    prefilled = prompt - prefix - relocated
    return {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3,
            "prompt_tokens_details": {"cached_tokens": prefix + relocated},
            "reuse": {"prefix_tokens": prefix, "relocated_tokens": relocated, "prefilled_tokens": prefilled,
                      "relocated_spans": spans, "session": session, "fallback": None,
                      "changed": prefilled - tails - unchosen - uncached if changed is None else changed,
                      "span_tails": tails,
                      "unchosen_spans": unchosen, "uncached_unchanged": uncached,
                      "prefill_flops": 10.0 * prefilled if flops is None else flops, "saved_flops": 10.0 * relocated}}


def _record(conversation, turn, edit, usage, ttft=0.1, error=None):
    return {"type": "request", "conversation_id": conversation, "turn": turn, "edit": edit, "usage": usage,
            "ttft_s": ttft, "total_s": 0.5, "output_text": "x", "finish_reason": "length", "error": error}


def _good_records():
    return [
        _record("a", 0, "first", _usage(100, 0, 0, session="new"), ttft=0.3),
        _record("a", 1, "delete_tool_result", _usage(150, 40, 90, breakdown=(12, 6, 2, 0), spans=2), ttft=0.1),
        _record("a", 2, "append", _usage(180, 150, 0), ttft=0.05),
        _record("b", 0, "first", _usage(80, 10, 0, breakdown=(None, 0, 0, 5), session="new"), ttft=0.2),
        _record("b", 1, "strip_reasoning", _usage(90, 20, 60, spans=1), ttft=0.1),
    ]


def _write_run(path, records, n_requests=None):
    header = {"type": "header", "format": 1, "url": "http://x", "model": "m", "concurrency": 2, "scr": None,
              "n_requests": len(records) if n_requests is None else n_requests}
    path.write_text("\n".join(json.dumps(obj) for obj in [header] + records) + "\n")
    return path


def test_good_run_totals_and_identities(tmp_path):
    report = build_report(load_run(_write_run(tmp_path / "scr.jsonl", _good_records())))
    assert report.problems == []
    assert report.label == "scr" and report.source == "replay" and report.n_conversations == 2
    assert (report.all_turns.prompt, report.all_turns.prefix, report.all_turns.relocated,
            report.all_turns.prefilled) == (600, 220, 150, 230)
    assert (report.edited_turns.requests, report.edited_turns.prompt, report.edited_turns.relocated) == (2, 240, 150)
    assert report.edited_turns.share("relocated") == pytest.approx(150 / 240)
    assert report.breakdown == Breakdown(changed=100 + 12 + 30 + 65 + 10, span_tails=6, unchosen_spans=2,
                                         uncached_unchanged=5)
    assert sum(report.breakdown) == report.all_turns.prefilled
    assert report.prefill_flops_per_conversation == {"a": pytest.approx(10.0 * (100 + 20 + 30)),
                                                     "b": pytest.approx(10.0 * (70 + 10))}
    assert report.ttft.n == 5 and report.ttft.p50 == pytest.approx(0.1)
    assert report.by_edit["first"].requests == 2 and report.by_edit["append"].prompt == 180


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: r[1]["usage"].update(prompt_tokens=155), "line 3 (a turn 1): prompt 155 != prefix 40"),
    (lambda r: r[1]["usage"]["reuse"].update(span_tails=7), "line 3 (a turn 1): breakdown"),
    (lambda r: r[4]["usage"]["reuse"].update(prefix_tokens=-10, prefilled_tokens=40, changed=40),
     "line 6 (b turn 1): prefix is negative"),
    (lambda r: r[0]["usage"]["reuse"].update(prefill_flops=-1.0), "prefill_flops is negative"),
])
def test_corrupted_run_fails_self_checks(tmp_path, capsys, mutate, expected):
    records = _good_records()
    mutate(records)
    path = _write_run(tmp_path / "bad.jsonl", records)
    assert any(expected in problem for problem in build_report(load_run(path)).problems)
    assert report_main([str(path)]) == 1
    assert "FAIL: " in capsys.readouterr().out


def test_incomplete_run_and_failed_requests(tmp_path):
    records = _good_records() + [_record("b", 2, "append", None, ttft=None, error="HTTP 500: boom")]
    report = build_report(load_run(_write_run(tmp_path / "r.jsonl", records)))
    assert report.problems == [] and report.n_failed == 1 and report.n_requests == 6
    assert "HTTP 500: boom" in format_report(report)
    report = build_report(load_run(_write_run(tmp_path / "r.jsonl", records, n_requests=9)))
    assert report.problems == ["run incomplete: 6 of 9 requests recorded"]


def test_usage_without_reuse_counts_cached_as_prefix(tmp_path):
    usage = {"prompt_tokens": 50, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}
    records = [_record("a", 0, "first", {"prompt_tokens": 40, "completion_tokens": 1}),
               _record("a", 1, "append", usage)]
    report = build_report(load_run(_write_run(tmp_path / "vllm.jsonl", records)))
    assert (report.all_turns.prefix, report.all_turns.relocated, report.all_turns.prefilled) == (32, 0, 58)
    assert report.breakdown is None and report.prefill_flops_per_conversation is None
    assert "unknown" in format_report(report) and report.problems == []


def _log_line(rid, session_id, prompt, prefix, relocated, spans, session, breakdown=None):
    prefilled = prompt - prefix - relocated
    changed, tails, unchosen, uncached = breakdown or (prefilled, 0, 0, 0)
    return "kvsplice.request " + json.dumps({
        "rid": rid, "prompt_tokens": prompt, "completion_tokens": 4, "prefix_tokens": prefix,
        "relocated_tokens": relocated, "prefilled_tokens": prefilled, "relocated_spans": spans, "session": session,
        "fallback": None, "changed": changed, "span_tails": tails, "unchosen_spans": unchosen,
        "uncached_unchanged": uncached, "prefill_flops": 5.0 * prefilled, "saved_flops": 5.0 * relocated,
        "ttft_s": 0.2, "e2e_s": 0.4, "finish_reason": "stop", "session_id": session_id, "replica": None})


def _server_log(path):
    lines = [
        'kvsplice.start {"model": "smollm2", "reuse": {"max_spans": 6}}',
        "INFO:     Uvicorn running on http://127.0.0.1:8000",
        _log_line("r1", "s1", 100, 0, 0, 0, "new"),
        _log_line("r2", "s1", 140, 100, 0, 0, "matched"),            # append: prefix covers the old prompt
        _log_line("r3", "s1", 150, 30, 100, 2, "matched", (12, 8, 0, 0)),  # edit with relocation
        _log_line("r4", "s1", 160, 60, 0, 0, "matched"),              # edit, nothing relocated: prefix < 150
        _log_line("r5", None, 70, 0, 0, 0, "off"),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_server_log_is_read(tmp_path):
    run = load_run(_server_log(tmp_path / "server.log"))
    assert run.source == "server_log" and run.settings["model"] == "smollm2"
    assert [(row.conversation, row.turn, row.edited) for row in run.rows] == [
        ("s1", 0, False), ("s1", 1, False), ("s1", 2, True), ("s1", 3, True), ("rid:r5", 0, False)]
    report = build_report(run)
    assert report.problems == [] and report.n_conversations == 2
    assert (report.edited_turns.prompt, report.edited_turns.relocated) == (310, 100)
    assert report.breakdown.span_tails == 8
    assert "relocated_spans > 0" in format_report(report)


def test_vs_side_by_side_and_plots(tmp_path, capsys):
    run = _write_run(tmp_path / "scr.jsonl", _good_records())
    log = _server_log(tmp_path / "off.log")
    out = tmp_path / "report"
    assert report_main([str(run), "--vs", str(log), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| all | scr |" in printed and "| all | off |" in printed and "| edited | off |" in printed
    for name in ("token_shares.png", "ttft_cdf.png", "prefilled_breakdown.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    assert "scr vs off" in (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert [entry["label"] for entry in summary] == ["scr", "off"]
    assert summary[0]["all_turns"]["relocated"] == 150


def test_other_run_problems_fail_the_report(tmp_path):
    records = _good_records()
    records[0]["usage"]["reuse"]["prefix_tokens"] = 5
    report = build_report(load_run(_write_run(tmp_path / "a.jsonl", _good_records())),
                          load_run(_write_run(tmp_path / "b.jsonl", records)))
    assert report.problems and all(problem.startswith("OTHER (b): ") for problem in report.problems)
    written = write_report(report, tmp_path / "out")
    assert all(path.exists() for path in written)


def test_unreadable_inputs_exit_2(tmp_path, capsys):
    assert report_main([str(tmp_path / "missing.jsonl")]) == 2
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("hello\nworld\n")
    with pytest.raises(RunError, match="neither"):
        load_run(garbage)
    assert report_main([str(garbage)]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "header"}\n{"type": "request", "conversation_id": "a", "turn": 0, "edit": "first",'
                   ' "usage": {"prompt_tokens": "ten"}}\n')
    assert report_main([str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert report_main([]) == 2


def test_sessions_and_fallback_reasons_are_counted_and_shown(tmp_path):
    records = _good_records()
    records[0]["usage"]["reuse"]["fallback"] = "no_candidate"
    records[3]["usage"]["reuse"]["fallback"] = "no_candidate"
    records[2]["usage"]["reuse"]["fallback"] = "no_spans"
    records.append(_record("b", 2, "update_note", _usage(120, 20, 0, session="new")))
    records[-1]["usage"]["reuse"]["fallback"] = "low_overlap"
    report = build_report(load_run(_write_run(tmp_path / "s.jsonl", records)))
    assert report.problems == []
    everything, edited = report.sessions["all"], report.sessions["edited"]
    assert everything.session == {"matched": 3, "new": 3} and everything.requests == 6
    assert everything.fallback == {"low_overlap": 1, "no_candidate": 2, "no_spans": 1}
    assert edited.requests == 3 and edited.matched_share == pytest.approx(2 / 3)
    assert edited.fallback == {"low_overlap": 1}
    text = format_report(report)
    assert "## SCR sessions and fallback reasons" in text
    assert "| edited | s | 3 | 2 (66.7%) | 1 | 0 | low_overlap 1 |" in text
    other = {"type": "request", "conversation_id": "x", "turn": 0, "edit": "first", "ttft_s": 0.1, "total_s": 0.2,
             "output_text": "", "finish_reason": "stop", "error": None,
             "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}}
    foreign = build_report(load_run(_write_run(tmp_path / "vllm.jsonl", [other])))
    assert foreign.sessions["all"].session == {"unknown": 1} and foreign.sessions["all"].fallback == {"none": 1}


def test_disk_tier_and_sliding_window_counts_are_summed_and_shown(tmp_path):
    records = _good_records()
    records[1]["usage"]["reuse"].update(disk_tokens=30, window_relocated=20)
    records[2]["usage"]["reuse"].update(disk_tokens=150)
    report = build_report(load_run(_write_run(tmp_path / "t.jsonl", records)))
    assert report.problems == []
    assert (report.all_turns.disk, report.all_turns.window_relocated) == (180, 20)
    assert (report.edited_turns.disk, report.edited_turns.window_relocated) == (30, 20)
    text = format_report(report)
    assert "## Disk tier and sliding-window layers" in text
    assert "| all | t | 220 | 180 (81.8%) | 150 | 20 (13.3%) |" in text
    # a run without either counter has no such section
    plain = format_report(build_report(load_run(_write_run(tmp_path / "p.jsonl", _good_records()))))
    assert "Disk tier and sliding-window layers" not in plain
