"""IncrementalDetokenizer: multi-byte characters across tokens, stop strings, prompt context."""

from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvsplice.engine.detokenizer import IncrementalDetokenizer

_STORIES_TOKENIZER = Path(__file__).resolve().parents[3] / "shared/models/stories260K/hf/tokenizer.json"
_MULTIBYTE = "héllo wörld 日本語 🎉"
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little girl who liked to play.",
    "hello world, hello there, the end.",
] * 20


def _byte_level_bpe() -> Tokenizer:
    """A tiny GPT-2-style byte-level BPE trained on an ASCII corpus: non-ASCII text becomes
    single-byte tokens, so multi-byte characters are split across tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer


@pytest.fixture(params=["byte_level_bpe", "stories260K"], scope="module")
def tokenizer(request) -> Tokenizer:
    """Each real tokenizer the tests run against; stories260K (SentencePiece byte fallback) is skipped when absent."""
    if request.param == "byte_level_bpe":
        return _byte_level_bpe()
    if not _STORIES_TOKENIZER.exists():
        pytest.skip(f"{_STORIES_TOKENIZER} not present")
    return Tokenizer.from_file(str(_STORIES_TOKENIZER))


def _decoder(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """The decode callable the engine would pass: skip_special_tokens bound."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed ids one by one, then flush; return every chunk returned (including empty ones)."""
    chunks = [detokenizer.add(token_id) for token_id in ids]
    chunks.append(detokenizer.flush())
    return chunks


def test_multibyte_stream_equals_full_decode(tokenizer):
    ids = tokenizer.encode(_MULTIBYTE, add_special_tokens=False).ids
    decode = _decoder(tokenizer)
    # The test only means something if some token holds an incomplete character.
    assert any("\ufffd" in decode([token_id]) for token_id in ids)
    detokenizer = IncrementalDetokenizer(decode, stop=())
    chunks = _stream(detokenizer, ids)
    assert "".join(chunks) == decode(ids) == detokenizer.text
    assert detokenizer.text.strip() == _MULTIBYTE
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert not detokenizer.stopped


def test_stop_string_across_tokens_is_cut_and_nothing_after_is_emitted(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    decode = _decoder(tokenizer)
    stop = "k brown f"
    assert all(stop not in decode([token_id]) for token_id in ids)  # it spans several tokens
    detokenizer = IncrementalDetokenizer(decode, stop=(stop,))
    chunks = _stream(detokenizer, ids)
    assert detokenizer.stopped and detokenizer.stop_reason == stop
    assert detokenizer.text == "The quic"
    assert "".join(chunks) == "The quic"
    assert detokenizer.add(ids[0]) == "" and detokenizer.text == "The quic"


def test_multibyte_stop_string(tokenizer):
    ids = tokenizer.encode(_MULTIBYTE, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(_decoder(tokenizer), stop=("本語",))
    chunks = _stream(detokenizer, ids)
    assert detokenizer.text == "".join(chunks) == "héllo wörld 日"
    assert detokenizer.stop_reason == "本語"


def test_stop_prefix_that_is_not_a_stop_is_emitted_in_full(tokenizer):
    text = "hello world, hello there, the end."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    decode = _decoder(tokenizer)
    detokenizer = IncrementalDetokenizer(decode, stop=("hello thereafter", "the end!"))
    emitted_before_flush = "".join(detokenizer.add(token_id) for token_id in ids)
    # "the end." is no stop: the "the end" prefix was held back only until "." disambiguated it.
    assert emitted_before_flush == decode(ids)
    assert detokenizer.flush() == ""
    assert not detokenizer.stopped


def test_trailing_stop_prefix_is_held_until_flush(tokenizer):
    text = "hello world, hello there"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    decode = _decoder(tokenizer)
    detokenizer = IncrementalDetokenizer(decode, stop=("there is",))
    emitted = "".join(detokenizer.add(token_id) for token_id in ids)
    assert emitted == decode(ids)[: -len("there")]
    assert detokenizer.flush() == "there"
    assert detokenizer.text == decode(ids)


def test_prompt_context_keeps_leading_space(tokenizer):
    ids = tokenizer.encode("Once upon a time there was", add_special_tokens=False).ids
    decode = _decoder(tokenizer)
    context, generated = ids[:3], ids[3:]
    expected = decode(ids)[len(decode(context)) :]
    detokenizer = IncrementalDetokenizer(decode, stop=(), context_ids=context)
    assert "".join(_stream(detokenizer, generated)) == expected == " time there was"


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(lambda ids: "", stop=("",))


def _utf8_decode(ids: list[int]) -> str:
    """Decode callable for a byte tokenizer: each id is one UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def _expected_with_stops(text: str, stop: tuple[str, ...]) -> str:
    """Reference: scan end offsets; at the first end where a stop string completes, cut before the
    longest one ending there (it starts earliest)."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop if text[:end].endswith(s)]
        if ending_here:
            return text[: end - max(len(s) for s in ending_here)]
    return text


_ALPHABET = st.sampled_from(list("ab c") + ["é", "日", "🎉"])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_byte_stream_matches_reference(data):
    text = data.draw(st.text(alphabet=_ALPHABET, max_size=24), label="text")
    stop_strings = st.one_of(
        st.text(alphabet=_ALPHABET, min_size=1, max_size=4),
        st.tuples(st.integers(0, max(len(text) - 1, 0)), st.integers(1, 4)).map(
            lambda span: text[span[0] : span[0] + span[1]] or "a"
        ),
    )
    stop = tuple(data.draw(st.lists(stop_strings, max_size=3), label="stop"))
    ids = list(text.encode("utf-8"))
    detokenizer = IncrementalDetokenizer(_utf8_decode, stop=stop)
    chunks = _stream(detokenizer, ids)
    expected = _expected_with_stops(text, stop)
    assert "".join(chunks) == detokenizer.text == expected
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert detokenizer.stopped == any(s in text for s in stop)


def test_incomplete_trailing_bytes_are_flushed_as_replacement():
    ids = list("ok 日".encode("utf-8"))[:-1]  # last character cut mid-sequence
    detokenizer = IncrementalDetokenizer(_utf8_decode, stop=())
    emitted = "".join(detokenizer.add(token_id) for token_id in ids)
    assert emitted == "ok "
    assert detokenizer.flush() == _utf8_decode(ids)[len("ok ") :]
    assert detokenizer.text == _utf8_decode(ids)
