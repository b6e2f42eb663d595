"""Structured outputs: specs, the grammar cache, the batch bitmask against its reference, and random
walks through the masks that must always end in text matching the constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvsplice.structured.grammar import GrammarCache, schema_ebnf
from kvsplice.structured.matcher import (GrammarState, apply_bitmask, apply_bitmask_reference,
                                         fill_bitmask)
from kvsplice.structured.spec import MAX_SCHEMA_DEPTH, StructuredSpec, ToolCallSyntax
from kvsplice.tokenizer import Tokenizer
from tests.tiny_model import make_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(path)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def cache(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, len(tokenizer.backend), tokenizer.eos_token_ids)


def random_walk(cache: GrammarCache, spec: StructuredSpec, seed: int, max_steps: int = 400) -> str:
    """Sample uniformly random logits through the grammar's mask until it ends (a stop token)."""
    state = GrammarState(cache.compile(spec))
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_steps):
        logits = torch.randn(1, cache.vocab_size, generator=generator)
        apply_bitmask(logits, fill_bitmask([state], cache.vocab_size))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert state.accept(token)
        if state.is_terminated:
            return cache.tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"the walk did not end in {max_steps} steps: {cache.tokenizer.decode(tokens)!r}")


BOUNDED = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}},
    "required": ["city", "days", "unit", "tags"], "additionalProperties": False}


def test_properties_come_in_schema_order(cache):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    text = random_walk(cache, StructuredSpec.json_schema(schema), seed=0)
    assert list(json.loads(text)) == ["zeta", "alpha"]


def test_json_schema_walks_always_parse_and_validate(cache):
    """Random tokens through the mask: strict JSON (no raw control characters nor surrogates, which
    xgrammar's string classes admit unrepaired) that validates against the schema."""
    spec = StructuredSpec.json_schema(BOUNDED)
    for seed in range(40):
        text = random_walk(cache, spec, seed)
        assert "\ufffd" not in text      # no invalid UTF-8 (a surrogate's bytes)
        jsonschema.validate(json.loads(text), BOUNDED)


def test_the_string_class_repair_is_applied():
    """Bounded and unbounded strings exclude control characters and surrogates."""
    ebnf = schema_ebnf({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                                         "b": {"type": "string"}}})
    assert ebnf.count(r"[^\0-\x1f\"\\\ud800-\udfff]") == 2
    assert r"[^\"\\\r\n]" not in ebnf and r"\r\n]" not in ebnf


def test_json_object_regex_choice_and_grammar_walks(cache):
    for seed in range(5):
        assert isinstance(json.loads(random_walk(cache, StructuredSpec.json_object(), seed, 2000)), dict)
        assert re.fullmatch(r"[a-c]{2,4}-\d", random_walk(cache, StructuredSpec.regex(r"[a-c]{2,4}-\d"), seed))
        assert random_walk(cache, StructuredSpec.choice(["yes", "no", "maybe so"]), seed) in ("yes", "no", "maybe so")
        assert random_walk(cache, StructuredSpec.grammar('root ::= "(" [0-9]+ ")"'), seed, 2000)[0] == "("


def test_tool_calls_spec_walks_are_calls_of_the_offered_functions(cache):
    syntax = ToolCallSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n")
    functions = [("get_weather", BOUNDED), ("noop", {"type": "object", "properties": {}})]
    spec = StructuredSpec.tool_calls(syntax, functions, parallel=False)
    seen = set()
    for seed in range(10):
        text = random_walk(cache, spec, seed)
        body = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.S).group(1)
        call = json.loads(body)
        seen.add(call["name"])
        schema = dict(functions)[call["name"]]
        jsonschema.validate(call["arguments"], schema)
    assert seen == {"get_weather", "noop"}


def test_cache_hits_and_lru_eviction(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer.backend), tokenizer.eos_token_ids, max_entries=2)
    first = cache.compile(StructuredSpec.regex("a+"))
    assert cache.compile(StructuredSpec.regex("a+")) is first
    assert (cache.hits, cache.misses) == (1, 1)
    cache.compile(StructuredSpec.regex("b+"))
    cache.compile(StructuredSpec.regex("c+"))          # evicts a+ (least recently used)
    cache.compile(StructuredSpec.regex("a+"))
    assert (cache.hits, cache.misses) == (1, 4)
    # whitespace does not matter; property order does (properties are generated in schema order)
    assert StructuredSpec.json_schema(json.loads('{ "a" : 1 }')) == StructuredSpec.json_schema({"a": 1})
    assert StructuredSpec.json_schema({"b": 1, "a": 2}) != StructuredSpec.json_schema({"a": 2, "b": 1})


@pytest.mark.parametrize("spec, reason", [
    (StructuredSpec.json_schema({"type": "frobnicate"}), "Unsupported type"),
    (StructuredSpec.regex("(("), "parenthesis"),
    (StructuredSpec.grammar("root ::= ("), "json_schema|grammar|EBNF|parse|Expect"),
])
def test_a_constraint_that_cannot_compile_is_a_value_error(cache, spec, reason):
    with pytest.raises(ValueError, match="cannot compile") as info:
        cache.compile(spec)
    assert re.search(reason, str(info.value), re.I)
    assert "/project/cpp" not in str(info.value)


def test_spec_limits_name_the_field():
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="response_format.json_schema.schema: the schema is nested deeper"):
        StructuredSpec.json_schema(deep)
    with pytest.raises(ValueError, match="guided_choice"):
        StructuredSpec.choice([])
    with pytest.raises(ValueError, match="maxLength 100000 is above this server's limit"):
        StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}})
    with pytest.raises(ValueError, match="a JSON schema must be an object"):
        StructuredSpec.json_schema([1, 2])


def test_batched_bitmask_matches_reference_and_per_row_fill(cache):
    states = [GrammarState(cache.compile(StructuredSpec.regex(p))) for p in ("ab+", "[0-9]{3}", "yes|no")]
    states[0].accept(cache.tokenizer.encode("a", add_special_tokens=False)[0])
    bitmask = fill_bitmask(states, cache.vocab_size)
    for row, state in enumerate(states):
        assert torch.equal(bitmask[row], fill_bitmask([state], cache.vocab_size)[0])
    logits = torch.randn(3, cache.vocab_size)
    fast, reference = logits.clone(), logits.clone()
    apply_bitmask(fast, bitmask)
    apply_bitmask_reference(reference, bitmask)
    assert torch.equal(fast, reference)
    random_mask = torch.randint(-2**31, 2**31 - 1, bitmask.shape, dtype=torch.int32)
    fast, reference = logits.clone(), logits.clone()
    apply_bitmask(fast, random_mask)
    apply_bitmask_reference(reference, random_mask)
    assert torch.equal(fast, reference)


def test_llama2c_tokenizers_are_refused_with_a_reason():
    from kvsplice.tokenizer_llama2c import Llama2cBPE

    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)] + [b"a"]
    tok = Tokenizer(Llama2cBPE(pieces, [0.0] * len(pieces)))
    with pytest.raises(ValueError, match="need a Hugging Face tokenizer"):
        GrammarCache(tok, len(pieces), (2,)).compile(StructuredSpec.regex("a"))
