"""Message offsets from the chat template: the fast path (one tokenization with character offsets)
equals the reference (tokenize every prefix), offsets sit where messages start, and templates that
merge, reorder or reject content only lose the offsets they make unverifiable. From the token ids alone
(MessageStarts): the first content token of every ChatML message, none for empty messages or content
that opens with a line break, headers that hold special tokens (Llama 3 style), openings limited to
the offsets asked for and cut at specials."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsplice.message_offsets import MessageStarts, message_offsets, message_offsets_reference
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


# ----- from the token ids alone -------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(path)
    return Tokenizer.from_dir(path)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_first_content_token_of_every_chatml_message(tokenizer):
    messages = [{"role": "system", "content": "The robot reads documentation."},
                {"role": "user", "content": "Tool results are long"},
                {"role": "assistant", "content": "Once upon a time"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    finder = MessageStarts(tokenizer)
    starts = finder.content_starts(ids)
    assert [tokenizer.decode(ids[o:]).startswith(m["content"]) for o, m in zip(starts, messages)] == [True] * 3
    assert len(starts) == 3        # the generation prompt opens no content yet
    assert {tokenizer.token_str(ids[o - 1]) for o in starts} == {"\n"}


def test_empty_messages_start_nothing_and_leading_line_breaks_are_skipped(tokenizer):
    messages = [{"role": "user", "content": ""}, {"role": "user", "content": "\n\nnotes are short"},
                {"role": "user", "content": "fox"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    starts = MessageStarts(tokenizer).content_starts(ids)
    assert [tokenizer.decode(ids[o:o + 1]) for o in starts] == [tokenizer.decode(encode(tokenizer, word)[:1])
                                                               for word in ("notes", "fox")]


def test_a_header_with_special_tokens_inside_ends_at_its_line_break(tokenizer):
    """Llama 3 style: <|start|> role <|end|> \\n\\n content (here with the tiny tokenizer's specials)."""
    text = "<|im_start|>user<|endoftext|>\n\nOnce upon a time<|im_end|><|im_start|>user<|endoftext|>\n\nfox"
    ids = encode(tokenizer, text)
    starts = MessageStarts(tokenizer).content_starts(ids)
    assert [tokenizer.decode(ids[o:o + 2]) for o in starts] == [tokenizer.decode(encode(tokenizer, "Once")[:2]),
                                                               tokenizer.decode(encode(tokenizer, "fox")[:2])]


def test_no_special_tokens_no_starts(tokenizer):
    ids = encode(tokenizer, "user\nOnce upon a time\nassistant\nfox")
    assert MessageStarts(tokenizer).content_starts(ids) == []


def test_openings_take_each_role_and_first_tokens_within_the_offsets_asked_for(tokenizer):
    """An opening is the header's tokens that are not special (role, line break) and the first
    content tokens; <|im_start|> itself is left out."""
    messages = [{"role": "user", "content": "Once upon a time there was a fox."},
                {"role": "user", "content": "ab"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    finder = MessageStarts(tokenizer)
    first, second = finder.messages(ids)
    assert ids[first.header] in finder.special_ids and ids[second.header] in finder.special_ids
    roles = [*range(first.header + 1, first.content), *range(second.header + 1, second.content)]  # role, \n
    assert finder.openings(ids, 1, range(len(ids))) == sorted(roles + [first.content, second.content])
    three = finder.openings(ids, 3, range(len(ids)))
    assert [o for o in three if o < second.header] == [*range(first.header + 1, first.content + 3)]
    assert all(ids[o] not in finder.special_ids for o in three if o >= second.content)   # "ab" is cut at <|im_end|>
    assert finder.openings(ids, 3, range(second.header, len(ids))) == [o for o in three if o >= second.header]
    assert finder.openings(ids, 1, []) == [] and finder.openings(ids, 0, range(len(ids))) == []
