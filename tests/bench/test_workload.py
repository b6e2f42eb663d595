import collections
import json

import pytest

from kvsplice.bench.commands import workload_main
from kvsplice.bench.trace import KNOWN_EDITS, load_trace
from kvsplice.bench.workload import EARLY_EDITS, EARLY_LIMIT_TOKENS, THINK_RE, estimate_tokens, generate_traces

SMALL = dict(min_tokens=300, max_tokens=800, min_turns=4, max_turns=6, max_output_tokens=32)


def test_deterministic_for_a_seed():
    assert generate_traces(3, seed=7, **SMALL) == generate_traces(3, seed=7, **SMALL)
    assert generate_traces(3, seed=7, **SMALL) != generate_traces(3, seed=8, **SMALL)


def test_sizes_and_turn_counts():
    conversations = generate_traces(8, seed=1, **SMALL)
    assert len({c.id for c in conversations}) == 8
    for conversation in conversations:
        assert 4 <= len(conversation.turns) <= 6
        sizes = [estimate_tokens(turn.messages) + turn.max_tokens for turn in conversation.turns]
        assert max(sizes) <= 800
        assert max(sizes) >= 300 * 0.5, sizes
        assert all(8 <= turn.max_tokens <= 32 for turn in conversation.turns)


def test_large_defaults_reach_realistic_sizes():
    conversation = generate_traces(1, seed=3, min_tokens=8000, max_tokens=12000, min_turns=10, max_turns=12)[0]
    peak = max(estimate_tokens(turn.messages) + turn.max_tokens for turn in conversation.turns)
    assert 4000 <= peak <= 12000


def _answered(messages):
    call_ids = [call["id"] for m in messages if m["role"] == "assistant" for call in m.get("tool_calls") or ()]
    result_ids = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    return call_ids == result_ids


def test_edit_kinds_do_what_they_say():
    conversations = generate_traces(12, seed=5, **SMALL)
    kinds = collections.Counter(turn.edit for c in conversations for turn in c.turns)
    assert set(kinds) == set(KNOWN_EDITS), kinds
    for conversation in conversations:
        assert conversation.turns[0].edit == "first"
        assert [m["role"] for m in conversation.turns[0].messages] == ["system", "user", "user"]
        for previous, turn in zip(conversation.turns, conversation.turns[1:]):
            old, new = list(previous.messages), list(turn.messages)
            assert _answered(new)
            assert new[-2]["role"] == "assistant" and new[-1]["role"] == "tool"
            if turn.edit == "append":
                assert new[: len(old)] == old and len(new) == len(old) + 2
                continue
            assert new[: len(old)] != old, turn.edit  # an edit inside the old context
            if turn.edit == "strip_reasoning":
                assert not any(THINK_RE.search(m["content"]) for m in new[:-2] if m["role"] == "assistant")
                assert any(THINK_RE.search(m["content"]) for m in old if m["role"] == "assistant")
            elif turn.edit == "delete_tool_result":
                assert len(new) < len(old) + 2
            elif turn.edit == "update_note":
                assert new[2]["content"].startswith(old[2]["content"]) and new[2] != old[2]
                assert new[3:len(old)] == old[3:]
            elif turn.edit == "replace_with_note":
                assert any(m["role"] == "tool" and m["content"].startswith("[note]") for m in new)


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_tokens"):
        generate_traces(1, 0, min_tokens=900, max_tokens=800)
    with pytest.raises(ValueError, match="min_turns"):
        generate_traces(1, 0, min_turns=5, max_turns=4)
    with pytest.raises(ValueError, match="n_conversations"):
        generate_traces(0, 0)


def test_workload_command_writes_a_valid_trace(tmp_path):
    out = tmp_path / "w.jsonl"
    argv = ["--out", str(out), "--conversations", "2", "--seed", "4", "--min-tokens", "300", "--max-tokens",
            "800", "--min-turns", "4", "--max-turns", "5", "--max-output-tokens", "16", "--cache-salt", "s"]
    assert workload_main(argv) == 0
    conversations = load_trace(out)
    assert len(conversations) == 2 and all(c.cache_salt == "s" for c in conversations)
    assert json.loads(out.read_text().splitlines()[0])["id"] == "w4-0"
    assert workload_main(["--out", str(out), "--conversations", "2", "--seed", "1", "--min-tokens", "900",
                          "--max-tokens", "800"]) == 2
    assert workload_main(["--out", str(out)]) == 2


EARLY = dict(min_tokens=1500, max_tokens=3000, min_turns=5, max_turns=7, max_output_tokens=16, edits="early")


def test_early_edits_change_the_context_before_token_1024_every_turn():
    conversations = generate_traces(10, seed=2, **EARLY)
    kinds = collections.Counter(turn.edit for c in conversations for turn in c.turns[1:])
    assert set(kinds) == set(EARLY_EDITS) | {"append"}, kinds
    for conversation in conversations:
        assert conversation.id.startswith("e2-") and conversation.turns[0].edit == "first"
        for previous, turn in zip(conversation.turns, conversation.turns[1:]):
            old, new = list(previous.messages), list(turn.messages)
            assert _answered(new) and new[-2]["role"] == "assistant" and new[-1]["role"] == "tool"
            if turn.edit == "append":  # only while the context is still short
                assert new[: len(old)] == old and estimate_tokens(old) < EARLY_LIMIT_TOKENS
                continue
            first_change = next(offset for offset, (a, b) in enumerate(zip(old, new)) if a != b)
            assert estimate_tokens(new[:first_change]) < EARLY_LIMIT_TOKENS, turn.edit
            if turn.edit == "edit_system":
                assert first_change == 0 and new[0]["content"].split(".")[0] != old[0]["content"].split(".")[0]
                assert new[0]["content"].split(". ", 1)[1] == old[0]["content"].split(". ", 1)[1]
            elif turn.edit == "move_message":
                assert (new[1], new[2]) == (old[2], old[1]) and new[3:len(old)] == old[3:]
            elif turn.edit == "two_edits":
                assert sum(a != b for a, b in zip(old, new)) >= 2


def test_early_profile_is_deterministic_and_checked():
    assert generate_traces(2, seed=3, **EARLY) == generate_traces(2, seed=3, **EARLY)
    with pytest.raises(ValueError, match="edits"):
        generate_traces(1, 0, edits="late")


def test_workload_command_takes_the_edit_profile(tmp_path):
    out = tmp_path / "e.jsonl"
    argv = ["--out", str(out), "--conversations", "1", "--seed", "4", "--min-tokens", "1500", "--max-tokens",
            "3000", "--min-turns", "4", "--max-turns", "4", "--max-output-tokens", "16", "--edits", "early"]
    assert workload_main(argv) == 0
    assert load_trace(out)[0].id == "e4-0" and workload_main(argv[:-1] + ["late"]) == 2
