"""Stands in for SGLang's `sglang.test.test_utils`: the names its OpenAI-server tests import.

`popen_launch_server` launches nothing: the kvsplice server under test is already running at
DEFAULT_URL_FOR_TEST. Every model name is the name that server is served under.
"""

from __future__ import annotations

import unittest

from served import SERVED_MODEL_NAME, server_url

DEFAULT_MODEL_NAME_FOR_TEST = SERVED_MODEL_NAME
DEFAULT_SMALL_MODEL_NAME_FOR_TEST = SERVED_MODEL_NAME
DEFAULT_SMALL_MODEL_NAME_FOR_TEST_QWEN = SERVED_MODEL_NAME
DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST = SERVED_MODEL_NAME
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600
DEFAULT_URL_FOR_TEST = server_url()


class CustomTestCase(unittest.TestCase):
    """SGLang's base class adds retries on CI; a plain TestCase here (no retries: a failure is a failure)."""


class RunningServer:
    """What `popen_launch_server` returns: SGLang's tests only read `.pid` to kill it afterwards."""

    pid = None


def popen_launch_server(model, base_url, timeout=None, api_key=None, other_args=(), **_ignored) -> RunningServer:
    return RunningServer()
