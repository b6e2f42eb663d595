"""The bench tools end to end: a 20-conversation agent trace replayed against a live kvsplice server (tiny
model, SCR on), then the report on the replay run and on the server's own request log.

Session ids are sent (`send_session_id=True`), so every later turn names its own conversation's session
whatever the other 19 conversations (which share the system prompt) are doing; the id attaches when the
content verifies (a turn whose edit left nothing after the common prefix does not, and loses nothing by it);
automatic matching is covered by tests/server/test_scr_e2e.py.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from kvsplice.bench.commands import report_main
from kvsplice.bench.replay import replay
from kvsplice.bench.report import build_report, load_run, write_report
from kvsplice.bench.trace import UNEDITED_KINDS
from kvsplice.bench.workload import generate_traces
from kvsplice.reuse.config import ReuseConfig
from tests.server.conftest import start_server
from tests.tiny_model import make_tiny_model_dir

N_CONVERSATIONS = 20
TRACE = dict(seed=11, min_tokens=300, max_tokens=900, min_turns=4, max_turns=6, max_output_tokens=16)
REUSE = ReuseConfig()  # defaults: a span needs min_span + tail = 80 equal tokens to be relocated
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """Replay the trace once (concurrency 4) and keep the trace, records, run file and server log."""
    work = tmp_path_factory.mktemp("e2e_replay")
    server = start_server(make_tiny_model_dir(work / "model"), num_slots=65_536, max_batch_tokens=2048, reuse=REUSE)
    try:
        conversations = generate_traces(N_CONVERSATIONS, **TRACE)
        records = replay(server.url, conversations, concurrency=4, out_path=work / "run_on.jsonl", progress=False,
                         send_session_id=True, timeout_s=60)
        log_path = work / "server.log"
        log_path.write_text("\n".join(server.sink.lines()) + "\n", encoding="utf-8")
        yield {"conversations": conversations, "records": records, "run": work / "run_on.jsonl", "log": log_path,
               "work": work, "tokenizer": server.state.engine.tokenizer}
    finally:
        server.thread.stop()


def test_every_request_succeeded_with_a_reply(replayed):
    records = replayed["records"]
    assert len(records) == sum(len(c.turns) for c in replayed["conversations"])
    for record in records:
        assert record.error is None, record.error
        assert record.finish_reason in ("stop", "length")
        assert record.ttft_s is None or 0 < record.ttft_s <= record.total_s
        reuse = record.usage["reuse"]
        if record.turn == 0:
            assert (reuse["session"], reuse["fallback"]) == ("new", "new_session")
        else:
            assert reuse["session"] == "matched" or reuse["fallback"] == "session_mismatch", reuse


def test_report_identities_hold_and_plots_are_written(replayed, capsys):
    report = build_report(load_run(replayed["run"]))
    assert report.problems == []
    assert report.n_requests == len(replayed["records"]) and report.n_failed == 0
    assert report.n_conversations == N_CONVERSATIONS
    assert report.all_turns.prompt == report.all_turns.prefix + report.all_turns.relocated + report.all_turns.prefilled
    written = write_report(report, replayed["work"] / "report_api")
    names = {path.name for path in written}
    assert {"report.md", "summary.json", "token_shares.png", "ttft_cdf.png", "prefilled_breakdown.png"} <= names
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == PNG_MAGIC
    out_dir = replayed["work"] / "report_cli"
    assert report_main([str(replayed["run"]), "--out", str(out_dir)]) == 0
    assert "OK: every identity held" in capsys.readouterr().out
    assert (out_dir / "token_shares.png").read_bytes()[:8] == PNG_MAGIC


def _prompt_ids(tokenizer, messages) -> list[int]:
    from kvsplice.server.chat import chat_prompt_ids
    from kvsplice.server.protocol import ChatMessage

    return chat_prompt_ids(tokenizer, [ChatMessage(**message) for message in messages])


def _longest_surviving_run(old_ids: list[int], new_ids: list[int]) -> int:
    """Longest run of equal tokens of old and new after their common prefix (what SCR could relocate)."""
    prefix = 0
    while prefix < min(len(old_ids), len(new_ids)) and old_ids[prefix] == new_ids[prefix]:
        prefix += 1
    matcher = difflib.SequenceMatcher(None, old_ids[prefix:], new_ids[prefix:], autojunk=False)
    return max(block.size for block in matcher.get_matching_blocks())


def test_edited_turns_relocate_unless_nothing_long_enough_survived(replayed):
    report = build_report(load_run(replayed["run"]))
    assert report.edited_turns.requests > 0
    assert report.edited_turns.relocated > 0
    assert report.edited_turns.share("relocated") > 0.1
    by_id = {conversation.id: conversation for conversation in replayed["conversations"]}
    edited = [r for r in replayed["records"] if r.edit not in UNEDITED_KINDS]
    relocated = [r for r in edited if r.usage["reuse"]["relocated_tokens"] > 0]
    assert len(relocated) >= len(edited) // 2
    for record in edited:
        reuse = record.usage["reuse"]
        if reuse["relocated_tokens"] > 0:
            continue
        # No relocation is right only when no run of min_span + tail equal tokens survived the edit (then the
        # plan has no span, or the id did not even verify: nothing distinctive survived after the prefix).
        assert reuse["fallback"] in ("no_spans", "session_mismatch"), (record.conversation_id, record.turn, reuse)
        turns = by_id[record.conversation_id].turns
        old_ids = _prompt_ids(replayed["tokenizer"], turns[record.turn - 1].messages)
        new_ids = _prompt_ids(replayed["tokenizer"], turns[record.turn].messages)
        assert _longest_surviving_run(old_ids, new_ids) < REUSE.min_span + REUSE.tail, (record.conversation_id,
                                                                                         record.turn)


def test_server_log_is_readable_by_report(replayed, capsys):
    log_run = load_run(replayed["log"])
    assert log_run.source == "server_log" and log_run.settings["scr"] == "on"
    log_report = build_report(log_run)
    assert log_report.problems == []
    replay_report = build_report(load_run(replayed["run"]))
    # The same requests seen from both ends: every total agrees.
    assert log_report.all_turns == replay_report.all_turns
    assert log_report.n_conversations == N_CONVERSATIONS  # hashed session ids still tell conversations apart
    assert 0 < log_report.edited_turns.requests
    assert log_report.edited_turns.relocated == replay_report.all_turns.relocated
    out_dir = replayed["work"] / "report_vs"
    assert report_main([str(replayed["run"]), "--vs", str(replayed["log"]), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "OK: every identity held" in out and Path(out_dir / "report.md").is_file()
