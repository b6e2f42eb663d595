"""Tool-call parsers on real template output: each family's chat template renders an assistant turn
with tool calls (the text the model learned to write); the parser reads the calls back, streamed at
every split point the same as whole; grammar-forced calls always parse as calls of the offered tools."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from kvsplice.engine.detokenizer import IncrementalDetokenizer
from kvsplice.server.tool_parsers import detect_parser, get_parser
from kvsplice.server.tool_parsers.hermes import HermesToolParser
from kvsplice.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvsplice.server.tool_parsers.mistral import MistralToolParser
from kvsplice.server.tool_parsers.stream import ToolCallStream
from kvsplice.structured.grammar import GrammarCache
from kvsplice.structured.matcher import GrammarState, apply_bitmask, fill_bitmask
from kvsplice.structured.spec import StructuredSpec
from kvsplice.tokenizer import Tokenizer
from tests.server.chat_templates import LLAMA31, MISTRAL_V03, QWEN25, SMOLLM2
from tests.tiny_model import make_tokenizer_files

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16}}, "required": ["query"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
CALLS = [{"id": "call00001", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
         {"id": "call00002", "type": "function",
          "function": {"name": "search", "arguments": {"query": "caf\u00e9 \"best\" {x}; [y]"}}}]

FAMILIES = {  # template, parser class, calls per turn the template allows, end-of-turn marker
    "qwen2.5": (QWEN25, HermesToolParser, 2, "<|im_end|>"),
    "llama3.1": (LLAMA31, Llama3JsonToolParser, 1, "<|eot_id|>"),
    "mistral": (MISTRAL_V03, MistralToolParser, 2, "<|im_end|>"),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok-tools")
    make_tokenizer_files(path)
    tok = Tokenizer.from_dir(path)
    tok.backend.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|eot_id|>"]})
    return tok


def model_output(tokenizer: Tokenizer, template: str, calls: list[dict], content: str | None, end: str) -> str:
    """What the model writes for `calls`: the assistant turn the template renders after its prompt."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    render = tokenizer.backend.apply_chat_template
    prompt = render(messages, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True)
    turn = {"role": "assistant", "content": content, "tool_calls": calls}
    full = render(messages + [turn], tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=False)
    assert full.startswith(prompt)
    return full[len(prompt):].split(end)[0]


def as_expected(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def parsed_calls(reply) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in reply.calls]


def collect(deltas) -> tuple[str | None, list[tuple[str, str]]]:
    """Streamed deltas -> (content, [(name, arguments text)]), as an OpenAI client accumulates them."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        for entry in delta.tool_calls:
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in entry:
                assert call["id"] is None, "an id is sent once, with the name"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    assert all(c["id"] for c in calls.values())
    return (content or None), [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def stream_pieces(parser, pieces: list[str]):
    stream = ToolCallStream(parser)
    return collect([stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)])


@pytest.mark.parametrize("template, expected", [(QWEN25, "hermes"), (LLAMA31, "llama3_json"),
                                                (MISTRAL_V03, "mistral"), (SMOLLM2, "hermes"), (None, "hermes")])
def test_parser_detected_from_the_template(template, expected):
    assert detect_parser(template).name == expected
    assert get_parser(expected).name == expected


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("pythonic")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_content", [False, True])
def test_template_output_parses_back_into_the_calls(tokenizer, family, with_content):
    template, parser_cls, per_turn, end = FAMILIES[family]
    if with_content and family != "qwen2.5":
        pytest.skip("only the Qwen template renders text before its calls")
    calls = CALLS[:per_turn]
    content = "Let me check that." if with_content else None
    text = model_output(tokenizer, template, calls, content, end)
    reply = parser_cls().parse(text)
    assert parsed_calls(reply) == as_expected(calls)
    assert (reply.content or "").strip() == (content or "")


@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_at_every_split_point_equals_the_whole(tokenizer, family):
    template, parser_cls, per_turn, end = FAMILIES[family]
    text = model_output(tokenizer, template, CALLS[:per_turn], "Checking." if family == "qwen2.5" else None, end)
    parser = parser_cls()
    whole = parser.parse(text)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    for split in range(len(text) + 1):
        assert stream_pieces(parser, [text[:split], text[split:]]) == expected, f"split at {split}"
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert stream_pieces(parser, pieces) == expected
    assert stream_pieces(parser, list(text)) == expected
    # token by token, as the engine's detokenizer emits the reply
    detok = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), ())
    pieces = [detok.add(token) for token in tokenizer.encode(text, add_special_tokens=False)] + [detok.flush()]
    assert "".join(pieces) == text
    assert stream_pieces(parser, pieces) == expected


@pytest.mark.parametrize("parser_cls", [HermesToolParser, Llama3JsonToolParser, MistralToolParser])
def test_plain_text_and_malformed_calls_stay_content(parser_cls):
    parser = parser_cls()
    for text in ["Hello there, no tools needed.", "The tag <tool_c is not a call", "[TOOL_CALLS is not either"]:
        reply = parser.parse(text)
        assert reply.calls == () and reply.content == text
        assert stream_pieces(parser, [text[:7], text[7:]]) == (text, [])
    broken = {HermesToolParser: '<tool_call>\n{"name": "f", "arguments": {"a": 1}',
              Llama3JsonToolParser: '{"name": "f", "parameters": {"a": }',
              MistralToolParser: '[TOOL_CALLS] [{"name": "f", "arguments": 7}]'}[parser_cls]
    assert parser.parse(broken).calls == () and parser.parse(broken).content == broken


def test_arguments_written_as_a_json_string_are_decoded():
    text = '{"name": "search", "parameters": "{\\"query\\": \\"x\\"}"}'
    reply = Llama3JsonToolParser().parse(text)
    assert parsed_calls(reply) == [("search", {"query": "x"})]
    assert stream_pieces(Llama3JsonToolParser(), [text[:30], text[30:]]) == (None, [("search", '{"query": "x"}')])


def test_parallel_tool_calls_false_streams_only_the_first():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    stream = ToolCallStream(HermesToolParser(), max_calls=1)
    assert collect([stream.feed(text, final=True)]) == (None, [("a", "{}")])


def test_mistral_ids_are_nine_alphanumerics():
    parser = MistralToolParser()
    new = parser.new_call_id()
    assert len(new) == 9 and new.isalnum()
    mapped = parser.normalise_call_id("call_0123456789abcdef")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == parser.normalise_call_id("call_0123456789abcdef")
    assert parser.normalise_call_id("abcDEF123") == "abcDEF123"


def forced_walk(cache: GrammarCache, spec: StructuredSpec, seed: int, skip_special: bool) -> str:
    state = GrammarState(cache.compile(spec))
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(600):
        logits = torch.randn(1, cache.vocab_size, generator=generator)
        apply_bitmask(logits, fill_bitmask([state], cache.vocab_size))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert state.accept(token)
        if state.is_terminated:
            return cache.tokenizer.decode(tokens, skip_special_tokens=skip_special)
        tokens.append(token)
    raise AssertionError("the forced call did not end")


@pytest.mark.parametrize("parser_cls", [HermesToolParser, Llama3JsonToolParser, MistralToolParser])
@pytest.mark.parametrize("parallel", [False, True])
def test_grammar_forced_calls_always_parse_and_match_the_schemas(tokenizer, parser_cls, parallel):
    """Random logits through the forced-call grammar (the mask a `required` request gets): the reply
    is always one (or, parallel, one or more) valid calls of the offered tools, nothing else."""
    parser = parser_cls()
    vocab = tokenizer.backend.get_vocab()
    syntax = parser.syntax(vocab)
    if parser_cls is MistralToolParser:
        assert syntax.opener_token == "[TOOL_CALLS]"     # matched as the special token it is
    functions = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    spec = StructuredSpec.tool_calls(syntax, functions, parallel=parallel)
    cache = GrammarCache(tokenizer, len(tokenizer.backend), tokenizer.eos_token_ids)
    counts = set()
    for seed in range(8):
        text = forced_walk(cache, spec, seed, skip_special=False)
        reply = parser.parse(text)
        assert reply.content is None and reply.calls, text
        counts.add(len(reply.calls))
        for call in reply.calls:
            jsonschema.validate(json.loads(call.arguments), dict(functions)[call.name])
    assert counts == {1} if not parallel else max(counts) >= 1
