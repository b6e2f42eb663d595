"""Schema bounds in kvsplice.structured.spec: a tool's input schema may declare an upper bound above
MAX_SCHEMA_REPEAT (Claude Code's Write tool: maxLength 524288); a forced call drops such a bound only
where the reply cannot reach it, and every other schema keeps the limit."""

from __future__ import annotations

import pytest

from kvsplice.structured.spec import (MAX_SCHEMA_REPEAT, StructuredSpec, ToolCallSyntax, check_schema,
                                      check_tool_schema, without_unreachable_bounds)

BIG = 524_288
WRITE = {"type": "object", "properties": {
    "file_path": {"type": "string"},
    "content": {"type": "string", "maxLength": BIG},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": BIG}},
    "required": ["file_path", "content"]}
HERMES = ToolCallSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n")


def test_a_tool_schema_may_declare_large_upper_bounds_but_no_other_schema_may():
    check_tool_schema(WRITE, "input_schema")
    with pytest.raises(ValueError, match=f"input_schema: max(Length|Items) {BIG} is above"):
        check_schema(WRITE, "input_schema")
    with pytest.raises(ValueError, match="response_format.json_schema.schema: max(Length|Items)"):
        StructuredSpec.json_schema(WRITE)


@pytest.mark.parametrize("keyword", ["minLength", "minItems", "minProperties"])
def test_large_lower_bounds_are_refused_in_tool_schemas_too(keyword):
    with pytest.raises(ValueError, match=f"{keyword} {MAX_SCHEMA_REPEAT + 1} is above"):
        check_tool_schema({"type": "string", keyword: MAX_SCHEMA_REPEAT + 1}, "parameters")


def test_unreachable_bounds_are_dropped_from_a_copy():
    relaxed = without_unreachable_bounds(WRITE, "tools[Write]", reply_chars=BIG)
    assert "maxLength" not in relaxed["properties"]["content"] and "maxItems" not in relaxed["properties"]["lines"]
    assert relaxed["properties"]["lines"]["items"]["maxLength"] == 80          # a small bound stays
    assert WRITE["properties"]["content"]["maxLength"] == BIG                  # the request's schema is untouched
    check_schema(relaxed, "tools[Write]")
    small = {"type": "string", "maxLength": 80}
    assert without_unreachable_bounds(small, "f", reply_chars=10) is small


def test_a_reachable_or_unknown_large_bound_is_refused():
    with pytest.raises(ValueError, match=f"tools\\[Write\\]: max(Length|Items) {BIG} .* up to {BIG + 1} characters"):
        without_unreachable_bounds(WRITE, "tools[Write]", reply_chars=BIG + 1)
    with pytest.raises(ValueError, match="an unknown number of characters"):
        without_unreachable_bounds(WRITE, "tools[Write]", reply_chars=None)


def test_a_forced_call_grammar_never_holds_a_large_bound():
    spec = StructuredSpec.tool_calls(HERMES, [("Write", WRITE)], parallel=False, reply_chars=4096)
    assert str(BIG) not in spec.value and '"maxLength":80' in spec.value
    with pytest.raises(ValueError, match="max(Length|Items) 524288 is above"):
        StructuredSpec.tool_calls(HERMES, [("Write", WRITE)], parallel=False, reply_chars=10 * BIG)
