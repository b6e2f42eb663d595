"""Messages agents send, through any template: tool calls with content null, tool results, text
parts, names, developer messages; what a template cannot take is normalised, what it rejects is a
400 naming the message."""

from __future__ import annotations

import json

import pytest

from kvsplice.server.chat import ChatRenderer, ChatTemplateError, load_chat_template
from kvsplice.server.protocol import ChatMessage
from kvsplice.server.tool_parsers.stream import ToolCallStream
from kvsplice.tokenizer import Tokenizer
from tests.server.chat_templates import LLAMA31, MISTRAL_V03, QWEN25, SMOLLM2
from tests.server.test_tool_parsers import TOOLS, collect
from tests.tiny_model import make_tokenizer_files

AGENT_TURN = [
    {"role": "developer", "content": "You are a weather agent."},
    {"role": "user", "name": "alice", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7f3a9c0d2b1e4f5a6b7c8d9e", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_7f3a9c0d2b1e4f5a6b7c8d9e", "content": "18 degrees, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok-chat")
    make_tokenizer_files(path)
    return Tokenizer.from_dir(path)


def messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage(**m) for m in raw]


def test_default_model_template_takes_an_agent_turn(tokenizer):
    """SmolLM2's template knows neither tools nor tool_calls nor content null: the tools go into the
    system message, the call into the assistant's content in Hermes syntax, the result as is."""
    text = ChatRenderer(tokenizer, SMOLLM2).render(messages(AGENT_TURN), TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a weather agent.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text and "<tool_call></tool_call> XML tags" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in text
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_default_model_template_output_parses_back(tokenizer):
    """The assistant turn as the default model's template renders it (through the normalisation)
    is what the detected parser reads back, streamed at every split the same."""
    renderer = ChatRenderer(tokenizer, SMOLLM2)
    prompt = renderer.render(messages(AGENT_TURN[:2]), TOOLS)
    full = renderer.render(messages(AGENT_TURN[:3]) + messages([{"role": "user", "content": "ok"}]), TOOLS)
    reply = full[len(prompt):].split("<|im_end|>")[0]
    parsed = renderer.parser.parse(reply)
    assert renderer.parser.name == "hermes" and parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    expected = (None, [(c.name, c.arguments) for c in parsed.calls])
    for split in range(len(reply) + 1):
        stream = ToolCallStream(renderer.parser)
        assert collect([stream.feed(reply[:split]), stream.feed(reply[split:], final=True)]) == expected


def test_qwen_template_renders_tools_and_results_itself(tokenizer):
    text = ChatRenderer(tokenizer, QWEN25).render(messages(AGENT_TURN), TOOLS)
    assert text.count("# Tools") == 1                   # the template's own, nothing injected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in text


def test_mistral_template_gets_nine_character_ids(tokenizer):
    """OpenAI-style ids would make Mistral's template raise; they are mapped to 9 characters, the
    same in the call and in its result."""
    renderer = ChatRenderer(tokenizer, MISTRAL_V03)
    text = renderer.render(messages(AGENT_TURN), TOOLS)
    short = renderer.parser.normalise_call_id(AGENT_TURN[2]["tool_calls"][0]["id"])
    assert f'"id": "{short}"' in text and f'"call_id": "{short}"' in text
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in text


def test_template_error_names_the_message(tokenizer):
    two_calls = dict(AGENT_TURN[2], tool_calls=AGENT_TURN[2]["tool_calls"] * 2)
    with pytest.raises(ChatTemplateError, match=r"messages\[2\] \(role assistant\).*single tool-calls") as info:
        ChatRenderer(tokenizer, LLAMA31).render(messages(AGENT_TURN[:2] + [two_calls]), TOOLS)
    assert info.value.param == "messages[2]"


def test_a_template_that_rejects_tool_messages_gets_them_as_user_turns(tokenizer):
    strict = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
              "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    text = ChatRenderer(tokenizer, strict).render(messages(AGENT_TURN))
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in text


def test_no_template_is_a_clear_error():
    from kvsplice.tokenizer_llama2c import Llama2cBPE

    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    renderer = ChatRenderer(Tokenizer(Llama2cBPE(pieces, [0.0] * len(pieces))))
    with pytest.raises(ValueError, match="no chat template"):
        renderer.render(messages(AGENT_TURN[:2]))


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


def test_chat_template_kwargs_reach_the_template(tokenizer):
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    renderer = ChatRenderer(tokenizer, template)
    assert renderer.render(messages(AGENT_TURN[1:2]), None, {"enable_thinking": False}).endswith("<no-think>")
    assert not renderer.render(messages(AGENT_TURN[1:2])).endswith("<no-think>")


# a system message after the first one (Claude Code sends one between turns), shown where the template can
LATE_SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Reminder: no emojis."},
               {"role": "user", "content": "List the files."}]
# Gemma's rule: a system turn only first (it raises on a later one), as Gemma's and Llama 2's templates do
SYSTEM_FIRST_ONLY = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                     "{{ raise_exception('System role only first') }}{% endif %}"
                     "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a template that drops every system message but the first, silently
SYSTEM_DROPPED = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}"
                  "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_late_system_message_stays_a_system_turn_where_the_template_renders_it(tokenizer):
    text = ChatRenderer(tokenizer, SMOLLM2).render(messages(LATE_SYSTEM))
    assert "<|im_start|>system\nReminder: no emojis.<|im_end|>\n<|im_start|>user\nList the files." in text


@pytest.mark.parametrize("template", [SYSTEM_FIRST_ONLY, SYSTEM_DROPPED], ids=["rejects", "drops"])
def test_a_late_system_message_is_folded_into_the_next_user_turn_where_the_template_cannot(tokenizer, template):
    renderer = ChatRenderer(tokenizer, template)
    text = renderer.render(messages(LATE_SYSTEM))
    assert "<|im_start|>user\nReminder: no emojis.\n\nList the files.<|im_end|>" in text
    assert text.count("<|im_start|>system") == 1
    ids = renderer.prompt_ids(messages(LATE_SYSTEM))
    assert len(renderer.message_offsets(messages(LATE_SYSTEM), ids)) == 4     # the folded chat's 4 messages


def test_a_trailing_late_system_message_joins_the_user_turn_before_it(tokenizer):
    chat = LATE_SYSTEM[:2] + [{"role": "system", "content": "Reminder: no emojis."}]
    text = ChatRenderer(tokenizer, SYSTEM_FIRST_ONLY).render(messages(chat))
    assert "<|im_start|>user\nHi\n\nReminder: no emojis.<|im_end|>\n<|im_start|>assistant\n" in text
