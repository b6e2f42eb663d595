"""Stop regexes: the earliest match cuts the output, a partial match is withheld (so text released
before the cut never holds a match), bad patterns are a ValueError naming stop_regex."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsplice.engine.detokenizer import IncrementalDetokenizer
from kvsplice.sampling_params import SamplingParams
from kvsplice.structured.stop_patterns import MAX_HOLD, StopPatterns, compile_stop_regex

ALPHABET = "ab .!?\nxyz"


def stream(text_pieces: list[str], patterns: tuple[str, ...], stop: tuple[str, ...] = ()) -> tuple[str, list[str], str]:
    """Feed `text_pieces` as tokens (one id per piece) through the detokenizer; (text, chunks, reason)."""
    vocab = {piece: index for index, piece in enumerate(dict.fromkeys(text_pieces))}
    pieces = {index: piece for piece, index in vocab.items()}
    detok = IncrementalDetokenizer(lambda ids: "".join(pieces[i] for i in ids), stop,
                                   stop_patterns=StopPatterns(patterns, timeout_s=5.0))  # no wall-clock flakiness here
    chunks = [detok.add(vocab[piece]) for piece in text_pieces]
    chunks.append(detok.flush())
    return detok.text, chunks, detok.stop_reason


def test_the_output_ends_right_before_the_first_match():
    text, _, reason = stream(["Once", " upon", " a", " time", " and", " more"], (r"and|or",))
    assert text == "Once upon a time " and reason == "and|or"


def test_a_match_split_over_tokens_is_withheld_then_cut():
    text, chunks, reason = stream(["x", " a", "n", "d", " y"], (r"and",))
    assert text == "x " and reason == "and"
    assert "a" not in "".join(chunks)        # "a" was held while it could begin "and"


def test_a_partial_match_that_fails_is_released():
    text, chunks, reason = stream(["x", " a", "n", "t", " y"], (r"and",))
    assert text == "x ant y" and reason is None and "".join(chunks) == text


def test_end_anchor_matches_when_a_sentence_ends():
    text, _, reason = stream(["Hi", " there", ".", " More"], (r"[.!?]\s*$",))
    assert text == "Hi there" and reason == r"[.!?]\s*$"


def test_lookbehind_sees_released_text():
    text, _, reason = stream(["f", "or", " or"], (r"\bor\b",))
    assert text == "for " and reason == r"\bor\b"


def test_strings_and_patterns_together_the_earliest_wins():
    text, _, reason = stream(["a", "b", "STOP", "c", "and"], (r"and",), stop=("STOP",))
    assert text == "ab" and reason == "STOP"
    text, _, reason = stream(["a", "and", "b", "STOP"], (r"and",), stop=("STOP",))
    assert text == "a" and reason == "and"


def test_a_hold_is_bounded():
    pieces = ["<"] + ["x"] * (MAX_HOLD + 50)
    _, chunks, _ = stream(pieces, (r"<x*>",))
    assert len("".join(chunks[:-1])) >= 50      # most of it released before the end


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=30),
       st.sampled_from([r"ab", r"a+b", r"[.!?]\s*$", r"x.y", r"\bz", r"b\n"]))
def test_streamed_text_is_the_whole_text_cut_at_its_first_match(pieces, pattern):
    text, chunks, reason = stream(pieces, (pattern,))
    assert "".join(chunks) == text
    whole = "".join(pieces)
    if reason is None:
        assert text == whole
    else:
        assert whole.startswith(text)
        if not pattern.endswith("$"):   # "$" matched where the text ended at some step, not at its end
            assert re.search(pattern, whole) is not None
    # the text kept never holds a complete match (an end anchor's depends on where the text ended)
    if not pattern.endswith("$"):
        assert re.search(pattern, text) is None


@pytest.mark.parametrize("pattern, needle", [("(", "does not compile"), ("a*", "empty string"), ("", "empty string")])
def test_bad_patterns_are_refused_naming_stop_regex(pattern, needle):
    with pytest.raises(ValueError, match=f"stop_regex: .*{needle}"):
        compile_stop_regex(pattern)
    with pytest.raises(ValueError, match="stop_regex"):
        SamplingParams(stop_regex=[pattern])


def test_sampling_params_take_one_pattern_or_several():
    assert SamplingParams(stop_regex="and").stop_regex == ("and",)
    assert SamplingParams(stop_regex=["and", "or"]).stop_regex == ("and", "or")
    with pytest.raises(ValueError, match="stop_regex: every entry must be a string"):
        SamplingParams(stop_regex=[3])


def test_a_search_over_its_time_limit_does_not_match():
    patterns = StopPatterns(("(x+x+)+y",), timeout_s=1e-9)
    assert patterns.first_match("", "x" * 5000) is None
