"""The constraint on a reply's text from the request: `response_format` (OpenAI), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, or a forced tool call.

    response_format text                      -> none
    response_format json_object               -> any JSON object
    response_format json_schema (strict or not) -> JSON matching the schema
    guided_json / structured_outputs.json     -> JSON matching the schema
    guided_regex, guided_choice, guided_grammar (EBNF) and their structured_outputs forms

At most one may be given (ConstraintError naming the second); a forced tool call excludes the others.
The spec is compiled before the request reaches the engine (GrammarCache), so a schema xgrammar
cannot compile is a 400 too.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvsplice.server.protocol import _SamplingFields
from kvsplice.structured.spec import StructuredSpec


class ConstraintError(ValueError):
    """A constraint that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _schema(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"{field}: not valid JSON: {error}", field) from error
    return value


def _candidates(body: _SamplingFields) -> list[tuple[str, StructuredSpec]]:
    """(field, spec) for every constraint the body sets."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredSpec.json_object()))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(("response_format", StructuredSpec.json_schema(fmt.json_schema.json_schema)))
    if body.guided_json is not None:
        found.append(("guided_json", StructuredSpec.json_schema(_schema(body.guided_json, "guided_json"), "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredSpec.regex(body.guided_regex)))
    if body.regex is not None:         # SGLang's name for guided_regex
        found.append(("regex", StructuredSpec.regex(body.regex, "regex")))
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredSpec.choice(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", StructuredSpec.grammar(body.guided_grammar)))
    outputs = body.structured_outputs
    if outputs is not None:
        field = "structured_outputs"
        set_fields = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
                      if getattr(outputs, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ConstraintError(f"{field}: give exactly one of json, regex, choice, grammar, json_object", field)
        kind = set_fields[0]
        spec = {"json_": lambda: StructuredSpec.json_schema(_schema(outputs.json_, field), f"{field}.json"),
                "regex": lambda: StructuredSpec.regex(outputs.regex, f"{field}.regex"),
                "choice": lambda: StructuredSpec.choice(outputs.choice, f"{field}.choice"),
                "grammar": lambda: StructuredSpec.grammar(outputs.grammar, f"{field}.grammar"),
                "json_object": StructuredSpec.json_object}[kind]()
        found.append((field, spec))
    return found


def reply_constraint(body: _SamplingFields, forced_call: Optional[StructuredSpec] = None) -> Optional[StructuredSpec]:
    """The one StructuredSpec the reply must match, or None. ConstraintError (naming the field) for
    two constraints or a bad schema. A forced tool call (`forced_call`: a required or named
    tool_choice) wins over a format constraint, as on OpenAI's API: the format governs a text reply
    and a forced call's reply is the call (the OpenAI Agents SDK sends both, its output type next to
    `tool_choice="required"`); the server still compiles the format (`compile_reply_constraints`)."""
    try:
        found = _candidates(body)
    except ConstraintError:
        raise
    except ValueError as error:        # the spec's own checks (size, depth, empty choice)
        field = str(error).split(":", 1)[0].split(".")[0]
        raise ConstraintError(str(error), field if field in type(body).model_fields else "response_format") from error
    if len(found) > 1:
        raise ConstraintError(f"{found[1][0]} cannot be combined with {found[0][0]}: give one constraint", found[1][0])
    return forced_call if forced_call is not None else (found[0][1] if found else None)
