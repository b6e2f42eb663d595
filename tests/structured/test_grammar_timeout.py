"""The grammar compile time limit: a constraint that runs out of it is refused (GrammarTimeoutError,
a ValueError) without holding the caller, the compile ends on its own thread, the same spec is then
refused at once, other constraints still compile, and the slots of slow compiles are bounded."""

from __future__ import annotations

import threading
import time

import pytest

from kvsplice.structured.grammar import GrammarBusyError, GrammarCache, GrammarTimeoutError
from kvsplice.structured.spec import StructuredSpec
from kvsplice.tokenizer import Tokenizer
from tests.tiny_model import make_tokenizer_files

LIMIT_S = 0.2


def slow_grammar(seed: int = 0) -> StructuredSpec:
    """An ambiguous EBNF whose compile takes seconds, even with a tiny vocabulary: xgrammar's work
    grows with the square of the repetitions (3000 take about 4 s on 2 loaded cores)."""
    return StructuredSpec.grammar("root ::= " + " ".join(["[a-z]*"] * 3000) + f' "{seed}"')


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(path)
    return Tokenizer.from_dir(path)


def grammar_cache(tokenizer, **kwargs) -> GrammarCache:
    return GrammarCache(tokenizer, len(tokenizer.backend), tokenizer.eos_token_ids,
                        compile_timeout_s=LIMIT_S, **kwargs)


def test_a_slow_constraint_is_refused_within_the_limit_and_then_at_once(tokenizer):
    cache = grammar_cache(tokenizer)
    started = time.perf_counter()
    with pytest.raises(GrammarTimeoutError, match=r"did not compile within 0\.2 s"):
        cache.compile(slow_grammar())
    assert time.perf_counter() - started < LIMIT_S + 1.0
    assert issubclass(GrammarTimeoutError, ValueError) and cache.timeouts == 1
    started = time.perf_counter()
    with pytest.raises(GrammarTimeoutError):
        cache.compile(slow_grammar())                 # remembered: no second compile
    assert time.perf_counter() - started < 0.05 and cache.timeouts == 1
    assert cache.compile(StructuredSpec.regex("[ab]+")) is not None    # others still compile


def test_the_caller_is_free_while_the_abandoned_compile_runs(tokenizer):
    """xgrammar releases the GIL while it compiles: the caller's thread (the engine's, in the server)
    keeps running at full speed next to the abandoned compile."""
    cache = grammar_cache(tokenizer)
    with pytest.raises(GrammarTimeoutError):
        cache.compile(slow_grammar(1))
    running = [t for t in threading.enumerate() if t.name == "kvsplice-grammar"]
    assert running, "the abandoned compile runs on its own thread"
    count, deadline = 0, time.perf_counter() + 0.2
    while time.perf_counter() < deadline:
        count += 1
    assert count > 10_000


def test_slow_compiles_hold_at_most_max_compiles_slots(tokenizer):
    cache = grammar_cache(tokenizer, max_compiles=1)
    with pytest.raises(GrammarTimeoutError):
        cache.compile(slow_grammar(2))
    with pytest.raises(GrammarBusyError, match="busy"):    # the abandoned compile still holds the slot
        cache.compile(StructuredSpec.regex("[cd]+"))


def test_without_a_limit_it_compiles_on_the_calling_thread(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer.backend), tokenizer.eos_token_ids)
    assert cache.compile_timeout_s is None and cache.compile(StructuredSpec.regex("x+")) is not None
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarCache(tokenizer, len(tokenizer.backend), tokenizer.eos_token_ids, compile_timeout_s=0)
