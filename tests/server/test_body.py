"""Request bodies: JSON parsing with the depth and Unicode checks, and the limits' defaults."""

from __future__ import annotations

import pytest

from kvsplice.server import limits
from kvsplice.server.body import check_tree, parse_json, validate_body
from kvsplice.server.errors import ApiError
from kvsplice.server.limits import RequestLimits
from kvsplice.server.protocol import ChatCompletionRequest


def _nested(depth: int) -> bytes:
    """A JSON value nested `depth` levels deep: [[...[1]...]]."""
    return b"[" * depth + b"1" + b"]" * depth


def test_depth_at_the_limit_passes_and_one_more_is_refused():
    assert parse_json(_nested(64), max_depth=64)
    with pytest.raises(ApiError) as refused:
        parse_json(_nested(65), max_depth=64)
    assert refused.value.status == 400 and refused.value.code == "json_too_deep"


def test_depth_far_beyond_the_recursion_limit_is_a_400():
    with pytest.raises(ApiError) as refused:
        parse_json(_nested(200_000), max_depth=64)
    assert refused.value.code == "json_too_deep"


@pytest.mark.parametrize("raw, code", [
    (b"\xff", "invalid_utf8"),
    (b'"\xed\xa0\x80"', "invalid_utf8"),
    (b'{"a": NaN}', "json_invalid"),
    (b'{"a": -Infinity}', "json_invalid"),
    (b'{"a": 1e400}', "json_invalid"),
    (b'{"a": "\\ud800"}', "invalid_unicode"),
    (b'{"\\udbff": 1}', "invalid_unicode"),
    (b'{"a": [{"b": "x\\udc00"}]}', "invalid_unicode"),
])
def test_bodies_that_are_not_json_text(raw, code):
    with pytest.raises(ApiError) as refused:
        parse_json(raw, max_depth=64)
    assert refused.value.status == 400 and refused.value.code == code


def test_a_surrogate_pair_is_text():
    assert parse_json(b'{"a": "\\ud83d\\ude00"}', max_depth=64) == {"a": "\U0001f600"}


def test_lone_surrogate_param_is_the_path():
    with pytest.raises(ApiError) as refused:
        check_tree({"messages": [{"content": "ok"}, {"content": "\ud800"}]}, max_depth=64)
    assert refused.value.param == "messages.1.content"


def test_limits_resolve_from_the_context_and_refuse_nonsense():
    resolved = RequestLimits().resolve(8192)
    assert resolved.max_body_bytes == 8192 * limits.BYTES_PER_TOKEN + limits.BODY_OVERHEAD
    assert resolved.max_messages == 8192
    assert RequestLimits(max_body_bytes=10, max_messages=3).resolve(8192) == RequestLimits(max_body_bytes=10,
                                                                                             max_messages=3)
    for field in ("max_body_bytes", "max_messages", "max_stop", "max_stop_chars", "max_id_chars", "max_json_depth"):
        with pytest.raises(ValueError, match=field):
            RequestLimits(**{field: 0})


def test_validation_uses_the_limits_given():
    body = {"messages": [{"role": "user", "content": "hi"}] * 3, "session_id": "s" * 9}
    assert validate_body(ChatCompletionRequest, body, RequestLimits(max_messages=3, max_id_chars=9))
    with pytest.raises(ApiError) as refused:
        validate_body(ChatCompletionRequest, body, RequestLimits(max_messages=2))
    assert refused.value.param == "messages"
    with pytest.raises(ApiError) as refused:
        validate_body(ChatCompletionRequest, body, RequestLimits(max_id_chars=8))
    assert refused.value.param == "session_id"
