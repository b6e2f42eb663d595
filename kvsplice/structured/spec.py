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

A tool's input schema (check_tool_schema) may set an upper bound (maxLength, maxItems, maxProperties)
above MAX_SCHEMA_REPEAT: agents declare such bounds (Claude Code: a file's content of maxLength 524288),
and until a call is grammar-forced the schema only describes the tool to the model. When the call is
forced (StructuredSpec.tool_calls), such a bound is dropped from the grammar only where the reply cannot
reach it: each string character, array item or object property takes at least one character of the
reply, and a reply of `reply_tokens` tokens has at most reply_tokens x longest-token characters, so a
bound at or above that is no constraint. A bound the reply could reach is refused (ValueError naming the
field), so no grammar ever holds a repeat above MAX_SCHEMA_REPEAT. Lower bounds (minLength, minItems,
minProperties) above it force that much output and are always refused.
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
UPPER_BOUND_KEYWORDS = ("maxLength", "maxItems", "maxProperties")

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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _large_upper_bound(node: dict[str, Any], keyword: str) -> bool:
    return keyword in UPPER_BOUND_KEYWORDS and _is_number(node.get(keyword)) and node[keyword] > MAX_SCHEMA_REPEAT


def check_tool_schema(schema: Any, field: str) -> None:
    """check_schema for a tool's input schema: upper bounds above MAX_SCHEMA_REPEAT are allowed (they
    are settled when a call is forced: `without_unreachable_bounds`)."""
    check_schema(schema, field, allow_large_upper_bounds=True)


def check_schema(schema: Any, field: str, allow_large_upper_bounds: bool = False) -> None:
    """ValueError naming `field` unless `schema` is a JSON object (or a boolean schema) within the
    depth and size limits (`allow_large_upper_bounds`: see check_tool_schema)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{field}: the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if len(canonical_json(schema)) > MAX_SPEC_CHARS:
        raise ValueError(f"{field}: the schema is longer than {MAX_SPEC_CHARS} characters")
    for node in _walk(schema):
        for keyword in REPEAT_KEYWORDS:
            bound = node.get(keyword)
            if allow_large_upper_bounds and _large_upper_bound(node, keyword):
                continue
            if _is_number(bound) and bound > MAX_SCHEMA_REPEAT:
                raise ValueError(f"{field}: {keyword} {bound} is above this server's limit of {MAX_SCHEMA_REPEAT}")


def without_unreachable_bounds(schema: Any, field: str, reply_chars: int | None) -> Any:
    """`schema` (a tool's input, check_tool_schema passed) as a grammar may take it: a copy without the
    upper bounds above MAX_SCHEMA_REPEAT that a reply of at most `reply_chars` characters cannot reach
    (none dropped: `schema` itself). ValueError naming `field` for such a bound the reply could reach, or
    any when `reply_chars` is unknown (None)."""
    if not any(_large_upper_bound(node, k) for node in _walk(schema) for k in UPPER_BOUND_KEYWORDS):
        return schema
    copy = json.loads(canonical_json(schema))          # depth already bounded by check_schema
    for node in _walk(copy):
        for keyword in UPPER_BOUND_KEYWORDS:
            if not _large_upper_bound(node, keyword):
                continue
            if reply_chars is None or node[keyword] < reply_chars:
                reach = "an unknown number of" if reply_chars is None else f"up to {reply_chars}"
                raise ValueError(f"{field}: {keyword} {node[keyword]} is above this server's grammar limit of "
                                 f"{MAX_SCHEMA_REPEAT}, and a forced call of {reach} characters could reach it; "
                                 f"lower the bound or max_tokens")
            del node[keyword]
    return copy


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
    def tool_calls(cls, syntax: ToolCallSyntax, functions: list[tuple[str, Any]], parallel: bool,
                   reply_chars: int | None = None) -> "StructuredSpec":
        """Replies that are one call (or, with `parallel`, one or more calls) of `functions`
        ((name, JSON schema of the arguments) pairs), written in `syntax`, and nothing else.
        `reply_chars`: the most characters the reply can have (bounds above it are dropped, see
        without_unreachable_bounds)."""
        if not functions:
            raise ValueError("tools: a forced tool call needs at least one function")
        checked = []
        for name, schema in functions:
            field = f"tools[{name}].function.parameters"
            check_tool_schema(schema, field)
            schema = without_unreachable_bounds(schema, field, reply_chars)
            check_schema(schema, field)
            checked.append((name, schema))
        functions = checked
        value = {"syntax": asdict(syntax), "functions": [[n, s] for n, s in functions], "parallel": bool(parallel)}
        return cls("tool_calls", canonical_json(value))
