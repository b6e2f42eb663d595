"""`kvsplice serve` flags for keys and limits (the server / frontend group): parsed into ServerSettings'
parts; bad values exit 2 before the model is loaded."""

from __future__ import annotations

import pytest

from kvsplice.cli import BAD_INPUT, build_parser, main, request_limits_from_args
from kvsplice.server.limits import MAX_JSON_DEPTH, RequestLimits


def test_limit_flags_become_request_limits():
    args = build_parser().parse_args(["serve", "--max-body-bytes", "5000", "--max-messages", "7", "--max-stop", "3",
                                      "--max-stop-chars", "9", "--max-id-chars", "11", "--max-json-depth", "5"])
    assert request_limits_from_args(args) == RequestLimits(max_body_bytes=5000, max_messages=7, max_stop=3,
                                                           max_stop_chars=9, max_id_chars=11, max_json_depth=5)
    defaults = request_limits_from_args(build_parser().parse_args(["serve"]))
    assert defaults == RequestLimits() and defaults.max_json_depth == MAX_JSON_DEPTH


def test_api_key_flags_repeat():
    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2"])
    assert args.api_keys == ["k1", "k2"]


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--max-stop", "0"], "max_stop"),
    (["serve", "--max-body-bytes", "-1"], "max_body_bytes"),
    (["serve", "--api-key", ""], "--api-key"),
    (["serve", "--api-key", "a,b"], "--api-key"),
])
def test_bad_values_exit_2_with_a_message(argv, needle, capsys):
    assert main(argv) == BAD_INPUT
    assert needle in capsys.readouterr().err


def test_key_limit_and_address_flags_are_in_the_server_group():
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    group = next(g for g in serve._action_groups if g.title == "server / frontend")
    flags = {opt for action in group._group_actions for opt in action.option_strings}
    assert {"--host", "--port", "--api-key", "--expose-model-path", "--max-body-bytes", "--max-json-depth",
            "--chat-template", "--tool-call-parser"} <= flags
