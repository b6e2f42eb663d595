import json

import pytest

from kvsplice.bench.trace import Conversation, TraceError, Turn, dump_trace, load_trace

GOOD = {"id": "c1", "cache_salt": None,
        "turns": [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                   "edit": "first", "max_tokens": 8}]}


def _write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _with(**changes):
    obj = json.loads(json.dumps(GOOD))
    obj.update(changes)
    return obj


def _turn_with(**changes):
    obj = json.loads(json.dumps(GOOD))
    obj["turns"][0].update(changes)
    return obj


def test_round_trip(tmp_path):
    conversations = [
        Conversation("a", "salt", (Turn(({"role": "user", "content": "hi"},), "first", 4),
                                   Turn(({"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                          "tool_calls": [{"id": "x", "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]},
                                         {"role": "tool", "tool_call_id": "x", "content": "r"}), "append", 5))),
        Conversation("b", None, (Turn(({"role": "user", "content": "yo"},), "first", 1),)),
    ]
    path = tmp_path / "t.jsonl"
    dump_trace(conversations, path)
    assert load_trace(path) == conversations
    assert conversations[0].is_edited == (False, False)


@pytest.mark.parametrize("bad_obj, expected", [
    (_with(id=3), "'id'"),
    (_with(cache_salt=5), "cache_salt"),
    (_with(turns=[]), "turns"),
    ({k: v for k, v in GOOD.items() if k != "turns"}, "missing 'turns'"),
    (_turn_with(max_tokens="8"), "max_tokens"),
    (_turn_with(max_tokens=True), "max_tokens"),
    (_turn_with(max_tokens=0), "max_tokens"),
    (_turn_with(edit=""), "edit"),
    (_turn_with(messages=[]), "messages"),
    (_turn_with(messages=[{"role": "robot", "content": "x"}]), "role"),
    (_turn_with(messages=[{"role": "user"}]), "content"),
    (_turn_with(messages=[{"role": "user", "content": None}]), "null"),
    ([1, 2], "JSON object"),
])
def test_bad_line_names_line_and_problem(tmp_path, bad_obj, expected):
    path = _write(tmp_path, [json.dumps(GOOD), "", json.dumps(bad_obj)])
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert "line 3" in str(caught.value)
    assert expected in str(caught.value)


def test_missing_turn_field(tmp_path):
    obj = json.loads(json.dumps(GOOD))
    del obj["turns"][0]["edit"]
    with pytest.raises(TraceError, match=r"line 1: turns\[0\] is missing 'edit'"):
        load_trace(_write(tmp_path, [json.dumps(obj)]))


def test_bad_json_and_duplicates_and_empty(tmp_path):
    with pytest.raises(TraceError, match="line 2: bad JSON"):
        load_trace(_write(tmp_path, [json.dumps(GOOD), "{not json"]))
    with pytest.raises(TraceError, match="line 2: duplicate conversation id 'c1'"):
        load_trace(_write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)]))
    with pytest.raises(TraceError, match="no conversations"):
        load_trace(_write(tmp_path, [""]))
    assert issubclass(TraceError, ValueError)
