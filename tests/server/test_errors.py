"""The error format: field names from validation errors and messages, and the 500 an unexpected
exception becomes (naming the request id, logged with its traceback)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI, Request

from kvsplice.server.errors import (InternalErrorMiddleware, bad_request, bind_request_id, param_in_message,
                                    validation_message)


def test_validation_message_names_the_field_and_the_union_it_failed():
    errors = [{"loc": ("body", "scr", "str"), "msg": "Input should be a valid string"},
              {"loc": ("body", "scr", "dict[str,any]"), "msg": "Input should be a valid dictionary"}]
    message, param = validation_message(errors)
    assert param == "scr" and "scr.str: Input should be a valid string" in message
    assert validation_message([{"loc": ("messages", 0, "role"), "msg": "Field required"}])[1] == "messages.0.role"
    assert validation_message([{"loc": (), "msg": "Value error, n: only n=1 is supported, got 2"}]) == (
        "n: only n=1 is supported, got 2", "n")
    assert validation_message([{"loc": (), "msg": "Value error, exactly one of text or input_ids is required"}])[1] \
        is None


@pytest.mark.parametrize("message, param", [("temperature: must be >= 0", "temperature"),
                                            ("sampling_params.stop: bad", "sampling_params.stop"),
                                            ("the prompt is empty", None), ("a b: c", None)])
def test_param_in_message(message, param):
    assert param_in_message(message) == param


def test_bad_request_places_the_field_inside_the_body():
    error = bad_request(ValueError("top_p: must be in (0, 1], got 2"), "sampling_params.")
    assert (error.status, error.param) == (400, "sampling_params.top_p")
    assert error.message.startswith("sampling_params.top_p:")


def _failing_app() -> FastAPI:
    app = FastAPI()

    @app.get("/named")
    async def named(request: Request):
        bind_request_id(request, "chatcmpl-abc123")
        raise KeyError("boom")

    @app.get("/anonymous")
    async def anonymous():
        raise ZeroDivisionError("boom")

    app.add_middleware(InternalErrorMiddleware)
    return app


async def _get(app: FastAPI, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path)


def test_an_unexpected_exception_is_an_openai_500_naming_the_request(caplog):
    app = _failing_app()
    with caplog.at_level(logging.ERROR, logger="kvsplice.server"):
        named = asyncio.run(_get(app, "/named"))
        anonymous = asyncio.run(_get(app, "/anonymous"))
    assert named.status_code == 500 and named.headers["content-type"] == "application/json"
    error = named.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "chatcmpl-abc123" in error["message"] and error["type"] == "server_error" and "KeyError" in error["message"]
    assert anonymous.status_code == 500 and "req-" in anonymous.json()["error"]["message"]
    logged = [record for record in caplog.records if "chatcmpl-abc123" in record.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback is in the log
