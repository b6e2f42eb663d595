"""What a constrained reply must match: StructuredSpec, pure data (frozen, hashable, no xgrammar).

A request's `response_format`, vLLM's `guided_*` fields or a forced tool call become one spec; the
engine compiles it (kvsplice.structured.grammar, cached by the spec) and masks every sampled token
with it (kvsplice.structured.matcher). Kinds and their `value`:

    json_schema   the schema as compact JSON (key order kept: properties are generated in that order)
    json_object   "" (any JSON object)
    regex         the pattern
    choice        canonical JSON list of the allowed strings
    grammar       EBNF text (xgrammar's dialect, GBNF-like)
    tool_calls    canonical JSON {"syntax": ToolCallSyntax fields, "functions": [[name, schema]], "parallel"}

Sizes are bounded here, where the spec is built (ValueError naming the field): a value of at most
MAX_SPEC_CHARS characters, a schema nested at most MAX_SCHEMA_DEPTH levels whose length and count
bounds are at most MAX_SCHEMA_REPEAT, at most MAX_CHOICES choices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

MAX_SPEC_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 256
# Bounds a schema may set on lengths and counts: a grammar grows with them (compiling a string of
# maxLength 100,000 takes seconds).
MAX_SCHEMA_REPEAT = 10_000
REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

SpecKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_calls"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")


def canonical_json(value: Any) -> str:
    """`value` as compact JSON (the cache key). Keys keep their order: a schema's properties are
    generated in the order it lists them, so two orders are two grammars."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _walk(value: Any):
    """Every dict inside `value` (itself included), without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def nesting_depth(value: Any) -> int:
    """Levels of dicts / lists in `value` (a scalar is 0), without recursion (a hostile schema
    cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        else:
            continue
        deepest = max(deepest, depth + 1)
    return deepest


def check_schema(schema: Any, field: str) -> None:
    """ValueError naming `field` unless `schema` is a JSON object (or a boolean schema) within the
    depth and size limits."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{field}: the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if len(canonical_json(schema)) > MAX_SPEC_CHARS:
        raise ValueError(f"{field}: the schema is longer than {MAX_SPEC_CHARS} characters")
    for node in _walk(schema):
        for keyword in REPEAT_KEYWORDS:
            bound = node.get(keyword)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > MAX_SCHEMA_REPEAT:
                raise ValueError(f"{field}: {keyword} {bound} is above this server's limit of {MAX_SCHEMA_REPEAT}")


@dataclass(frozen=True)
class ToolCallSyntax:
    """How one model family writes tool calls, as text around each call's JSON arguments:

        [opener_token] opener  call_prefix NAME name_suffix {arguments}  call_suffix
                               separator   call_prefix NAME ...          call_suffix  closer

    `opener_token`: a special token that must come first, matched as that one token (Mistral's
    `[TOOL_CALLS]`), or None. Example, Hermes: call_prefix `<tool_call>\\n{"name": "`, name_suffix
    `", "arguments": `, call_suffix `}\\n</tool_call>`, separator `\\n`.
    """

    call_prefix: str
    name_suffix: str
    call_suffix: str
    separator: str
    opener: str = ""
    closer: str = ""
    opener_token: str | None = None


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint on a reply (see the module docstring for the kinds). Build it with the class
    methods, which validate and canonicalise; the constructor checks the kind and the size."""

    kind: SpecKind
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output value must be a string, got {type(self.value).__name__}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} constraint is longer than {MAX_SPEC_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: Any, field: str = "response_format.json_schema.schema") -> "StructuredSpec":
        check_schema(schema, field)
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def json_object(cls) -> "StructuredSpec":
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str, field: str = "guided_regex") -> "StructuredSpec":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{field}: must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Any, field: str = "guided_choice") -> "StructuredSpec":
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"{field}: must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"{field}: at most {MAX_CHOICES} choices are allowed, got {len(choices)}")
        return cls("choice", canonical_json(choices))

    @classmethod
    def grammar(cls, ebnf: str, field: str = "guided_grammar") -> "StructuredSpec":
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise ValueError(f"{field}: must be a non-empty string")
        return cls("grammar", ebnf)

    @classmethod
    def tool_calls(cls, syntax: ToolCallSyntax, functions: list[tuple[str, Any]], parallel: bool) -> "StructuredSpec":
        """Replies that are one call (or, with `parallel`, one or more calls) of `functions`
        ((name, JSON schema of the arguments) pairs), written in `syntax`, and nothing else."""
        if not functions:
            raise ValueError("tools: a forced tool call needs at least one function")
        for name, schema in functions:
            check_schema(schema, f"tools[{name}].function.parameters")
        value = {"syntax": asdict(syntax), "functions": [[n, s] for n, s in functions], "parallel": bool(parallel)}
        return cls("tool_calls", canonical_json(value))
