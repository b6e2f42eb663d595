"""The server's OpenAPI document, true to what it sends.

Handlers parse their JSON bodies themselves (kvsplice.server.body: size, depth and Unicode checks
first, then the pydantic model, in a worker thread), so FastAPI does not see the body models; each
route declares its body with `json_request_body(Model)` and its error statuses with
`error_responses(...)`, and `install_openapi` adds the body models' schemas to the document's
components. No route declares FastAPI's 422 (it adds one for path parameters; install_openapi
replaces it): validation errors are answered 400.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvsplice.server.errors import ERROR_STATUSES
from kvsplice.server.protocol import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"


def json_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose required JSON body is `model`."""
    schema = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses` of a route that may answer `statuses`, each with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses}


# What each kind of route may answer besides 200 (the OpenAPI document declares exactly these).
# An inference route answers JSON, or with "stream": true an event stream (Server-Sent Events).
INFERENCE_ERRORS = {200: {"content": {"application/json": {}, "text/event-stream": {}}},
                    **error_responses(400, 401, 404, 413, 500, 503)}
READ_ERRORS = error_responses(401, 500)
ADMIN_ERRORS = error_responses(401, 403, 500, 503)
PROBE_ERRORS = error_responses(500, 503)
TOKEN_ERRORS = error_responses(400, 401, 404, 413, 500)


def install_openapi(app: FastAPI, body_models: Iterable[type[BaseModel]]) -> None:
    """Make `app.openapi()` build FastAPI's document plus the JSON schemas of `body_models`."""
    models = tuple(body_models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                   description=app.description)
            _, definitions = models_json_schema([(model, "validation") for model in models],
                                                ref_template=REF_TEMPLATE)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in definitions.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            _no_422(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented way to customise the document


def _no_422(document: dict[str, Any]) -> None:
    """FastAPI declares 422 for every route with parameters; the server answers validation errors 400:
    declare that instead (with the error body)."""
    error = error_responses(400)[400]
    error = {"description": error["description"],
             "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}}
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", error)
    document.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    document.get("components", {}).get("schemas", {}).pop("ValidationError", None)
