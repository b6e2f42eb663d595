"""Message offsets from the chat template: the fast path (one tokenization with character offsets)
equals the reference (tokenize every prefix), offsets sit where messages start, and templates that
merge, reorder or reject content only lose the offsets they make unverifiable."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsplice.message_offsets import message_offsets, message_offsets_reference
from kvsplice.tokenizer import Tokenizer
from tiny_model import CHATML_TEMPLATE, make_tokenizer_files

HYBRID_MINI = Path(__file__).resolve().parents[1] / "models" / "hybrid-mini"

# consecutive user messages merged into one block
MERGING = (
    "{% for m in messages %}"
    "{% if loop.first or m['role'] != messages[loop.index0 - 1]['role'] or m['role'] != 'user' %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}{% else %}{{ ' ' }}{% endif %}"
    "{{ m['content'] }}"
    "{% if loop.last or m['role'] != 'user' or messages[loop.index0 + 1]['role'] != 'user' %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# the system message rendered after everything else
REORDERING = (
    "{% for m in messages if m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% for m in messages if m['role'] == 'system' %}{{ '<|im_start|>system\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# refuses a chat that does not end with a user message, unless the reply is opened
STRICT = (
    "{% if not add_generation_prompt and messages[-1]['role'] != 'user' %}{{ raise_exception('need a user') }}{% endif %}"
    + CHATML_TEMPLATE
)

MESSAGES = [
    {"role": "system", "content": "The robot reads documentation."},
    {"role": "user", "content": "Once upon a time there was a fox."},
    {"role": "user", "content": "Tool results are long; notes are short."},
    {"role": "assistant", "content": "def main(): print('hello world')"},
    {"role": "user", "content": "héllo wörld 日本語 🎉"},
]


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(path)
    return path


def tokenizer_with(path: Path, template: str) -> Tokenizer:
    tokenizer = Tokenizer.from_dir(path)
    tokenizer.backend.chat_template = template
    return tokenizer


def both(tokenizer, messages=MESSAGES):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    fast = message_offsets(tokenizer, messages, ids)
    assert fast == message_offsets_reference(tokenizer, messages, ids)
    return ids, fast


def test_chatml_offsets_are_message_starts(tiny_tokenizer_dir):
    tokenizer = tokenizer_with(tiny_tokenizer_dir, CHATML_TEMPLATE)
    ids, offsets = both(tokenizer)
    assert len(offsets) == len(MESSAGES)               # messages 1..4 and the reply
    start = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    for offset in offsets:
        assert ids[offset: offset + len(start)] == start
    assert offsets[-1] == len(ids) - len(tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))


def test_merging_template_loses_only_the_merged_boundary(tiny_tokenizer_dir):
    _, chatml = both(tokenizer_with(tiny_tokenizer_dir, CHATML_TEMPLATE))
    ids, merged = both(tokenizer_with(tiny_tokenizer_dir, MERGING))
    assert len(merged) == len(chatml) - 1             # messages 1 and 2 are one block: no start of 2
    assert merged[0] == chatml[0] and len(ids) < len(tokenizer_with(tiny_tokenizer_dir, CHATML_TEMPLATE)
                                                      .apply_chat_template(MESSAGES))


def test_reordering_and_refusing_templates_keep_only_verified_offsets(tiny_tokenizer_dir):
    # a prefix without the later messages renders the system block earlier: no prefix verifies
    # except the full chat without the reply
    ids, offsets = both(tokenizer_with(tiny_tokenizer_dir, REORDERING))
    assert offsets == [len(ids) - len(tokenizer_with(tiny_tokenizer_dir, REORDERING)
                                      .encode("<|im_start|>assistant\n", add_special_tokens=False))]
    # prefixes that end with a non-user message are refused by the template: they are skipped
    _, strict = both(tokenizer_with(tiny_tokenizer_dir, STRICT))
    _, chatml = both(tokenizer_with(tiny_tokenizer_dir, CHATML_TEMPLATE))
    assert strict == [chatml[1], chatml[2], chatml[4]]   # prefixes ending in user messages 1, 2 and 4


def test_prompt_ids_from_elsewhere_give_the_reference_answer(tiny_tokenizer_dir):
    tokenizer = tokenizer_with(tiny_tokenizer_dir, CHATML_TEMPLATE)
    ids, offsets = both(tokenizer)
    assert message_offsets(tokenizer, MESSAGES, ids[:-2]) == [o for o in offsets if o < len(ids) - 2]


@pytest.mark.skipif(not HYBRID_MINI.is_dir(), reason="models/hybrid-mini is not in this checkout")
def test_smollm2_template_on_an_agent_conversation():
    from kvsplice.bench.workload import generate_traces

    tokenizer = Tokenizer.from_dir(HYBRID_MINI)
    [conversation] = generate_traces(1, seed=1, min_tokens=800, max_tokens=1200, min_turns=4, max_turns=4)
    messages = [dict(m) for m in conversation.turns[-1].messages]
    _, offsets = both(tokenizer, messages)
    assert len(offsets) == len(messages)
