"""Message content starts found from token ids alone: the first content token of every ChatML
message, none for empty messages or content that opens with a line break, headers that hold
special tokens (Llama 3 style), openings limited to the offsets asked for and cut at specials."""

from __future__ import annotations

import pytest

from kvsplice.reuse.message_starts import MessageStarts
from kvsplice.tokenizer import Tokenizer
from tiny_model import make_tokenizer_files


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
