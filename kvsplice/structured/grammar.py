"""GrammarCache: StructuredSpec -> xgrammar CompiledGrammar, compiled once per spec (LRU) per tokenizer.

    spec ──(cache hit)──────────────────────────────> CompiledGrammar
         └─(miss) spec -> EBNF / structural tag ──xgrammar GrammarCompiler──┘   (ValueError if it cannot)

xgrammar (the constrained-decoding library vLLM and SGLang use; C++, runs on CPU) builds, per
grammar, the token masks for the model's vocabulary. Compiling costs milliseconds to seconds, so
the server compiles in a worker thread before a request reaches the engine (a bad schema is then a
400), and the engine's own compile of the same spec is a cache hit. Thread-safe.

JSON is generated compactly (`{"a": 1, "b": [2, 3]}`, no free whitespace): a weak model cannot then
spend its tokens on whitespace, and tool calls look as chat templates render them (`tojson`).

Two repairs of xgrammar's string rules (xgrammar 0.2.x), applied to the EBNF it generates:
a string with `minLength`/`maxLength` uses the character class `[^"\\\r\n]`, which admits raw
control characters (U+0000..U+001F) that JSON forbids inside strings, and every string class admits
UTF-16 surrogates (U+D800..U+DFFF), whose UTF-8 bytes are not valid UTF-8 (they decode to U+FFFD,
three per surrogate, breaking maxLength). Strict parsers (Python's json, JavaScript's JSON.parse)
reject the first, every decoder the second. `_strict_strings` narrows both classes to
`[^\0-\x1f"\\\ud800-\udfff]`; tests sample strings at random through the masks and parse them.

Time limit: some grammars take xgrammar seconds to minutes to compile (an ambiguous EBNF of a few
thousand repetitions: its preprocessing grows with the grammar's positions times the vocabulary).
With `compile_timeout_s`, each compile runs on a thread of its own and the caller waits at most
that long; past it the caller gets GrammarTimeoutError (a ValueError: the server's 400) and is free
at once, while the compile ends on its own (xgrammar's compile releases the GIL, so it costs a core,
not the engine's steps) and its result is dropped. A spec that ran out once is refused at once
afterwards (the last `max_entries` such specs are remembered), so resending it costs nothing. At
most `max_compiles` compiles run at once, abandoned ones included; a caller that finds none free
within the limit gets GrammarBusyError (the server's 503). A process that exits waits for the
compiles still running (the threads are not daemons: xgrammar aborts the process if the
interpreter is torn down under a compile):

    caller ──start──> compile thread ──────────────(done: cached)
       └── wait <= timeout ──> result, or GrammarTimeoutError (the thread runs on, its result dropped)
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

from kvsplice.structured.spec import StructuredSpec
from kvsplice.tokenizer import Tokenizer

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_MAX_COMPILES = 2


class GrammarTimeoutError(ValueError):
    """A constraint that did not compile within the time limit."""


class GrammarBusyError(RuntimeError):
    """Every compile slot stayed busy (slow compiles still running) for the whole time limit."""
# the classes as xgrammar prints them -> the strict class (see the module docstring)
_STRING_CLASS_REPAIRS = {r'[^\"\\\r\n]': r'[^\0-\x1f\"\\\ud800-\udfff]',
                         r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\\ud800-\udfff]'}
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def load_xgrammar():
    """The xgrammar module (imported on first use: only constrained requests need it)."""
    try:
        import xgrammar
    except ImportError as error:  # a dependency of kvsplice; absent only in a broken install
        raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from error
    return xgrammar


def _strict_strings(ebnf: str) -> str:
    """`ebnf` with JSON string classes that exclude control characters and surrogates (see the
    module docstring)."""
    for loose, strict in _STRING_CLASS_REPAIRS.items():
        ebnf = ebnf.replace(loose, strict)
    return ebnf


def schema_ebnf(schema: Any, strict: bool = True) -> str:
    """Compact-JSON EBNF for `schema` (a dict or bool). `strict`: properties the schema does not
    list are not generated (xgrammar's strict_mode; the output still validates either way)."""
    xgr = load_xgrammar()
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
    return _strict_strings(str(grammar))


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON escapes are valid EBNF escapes)."""
    return json.dumps(text, ensure_ascii=False)


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def tool_calls_tag(value: dict[str, Any]) -> dict[str, Any]:
    """The xgrammar structural tag for a `tool_calls` spec value: one call (or, with parallel, one
    or more calls joined by the separator), each `call_prefix NAME name_suffix ARGS call_suffix`
    with ARGS matching that function's schema, inside opener/closer, and no other text."""
    syntax = value["syntax"]
    tags = [{"type": "tag", "begin": syntax["call_prefix"] + name + syntax["name_suffix"],
             "content": {"type": "grammar", "grammar": schema_ebnf(schema)}, "end": syntax["call_suffix"]}
            for name, schema in value["functions"]]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": syntax["separator"],
             "at_least_one": True, "stop_after_first": not value["parallel"]}
    elements = []
    if syntax["opener_token"]:
        elements.append({"type": "token", "token": syntax["opener_token"]})
    if syntax["opener"]:
        elements.append({"type": "const_string", "value": syntax["opener"]})
    elements.append(calls)
    if syntax["closer"]:
        elements.append({"type": "const_string", "value": syntax["closer"]})
    body = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return {"type": "structural_tag", "format": body}


def _error_message(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else repr(error))


class GrammarCache:
    """Compiles StructuredSpecs for one tokenizer and keeps the last `max_entries` compiled grammars.

    `vocab_size`: the model's logits width (may exceed the tokenizer's: padded rows are masked).
    `stop_token_ids`: the ids that end a reply; a grammar allows them once it is complete.
    `compile_timeout_s`: the most one compile may take (None: no limit, compiled on the calling
    thread); `max_compiles`: compiles running at once under a limit (see the module docstring).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = DEFAULT_CACHE_ENTRIES, compile_timeout_s: float | None = None,
                 max_compiles: int = DEFAULT_MAX_COMPILES):
        if compile_timeout_s is not None and compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be positive, got {compile_timeout_s}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_entries = max_entries
        self.compile_timeout_s = compile_timeout_s
        self.hits = 0
        self.misses = 0
        self.timeouts = 0
        self._compiled: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._timed_out: OrderedDict[StructuredSpec, None] = OrderedDict()
        self._slots = threading.BoundedSemaphore(max_compiles)
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        """xgrammar's compiler for this tokenizer, built on first use (it reads the whole vocabulary)."""
        if self._compiler is None:
            xgr = load_xgrammar()
            backend = self.tokenizer.backend
            if not hasattr(backend, "convert_ids_to_tokens"):
                raise ValueError("structured outputs and forced tool calls need a Hugging Face tokenizer; "
                                 "this model's llama2.c tokenizer has none")
            info = xgr.TokenizerInfo.from_huggingface(backend, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids))
            # no cache of xgrammar's own: this class is the cache (one eviction policy, one count)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredSpec):
        """The CompiledGrammar of `spec` (cached). ValueError with xgrammar's reason when the spec
        cannot be compiled (an unsupported schema keyword, a bad regex, an EBNF syntax error).

        The lock is not held while compiling: the engine thread, which only ever asks for specs
        the server compiled already, never waits behind another request's slow compile. With a
        time limit: GrammarTimeoutError when the compile runs out of it (or ran out before),
        GrammarBusyError when no compile slot frees up within it."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self.hits += 1
                self._compiled.move_to_end(spec)
                return compiled
            self.misses += 1
            if spec in self._timed_out:
                self._timed_out.move_to_end(spec)
                raise self._timeout_error(spec)
            compiler = self._get_compiler()
        compiled = (self._compile_uncached(compiler, spec) if self.compile_timeout_s is None
                    else self._compile_limited(compiler, spec))
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _compile_limited(self, compiler, spec: StructuredSpec):
        """`_compile_uncached` on a thread of its own, waited for at most `compile_timeout_s`."""
        if not self._slots.acquire(timeout=self.compile_timeout_s):
            raise GrammarBusyError(f"structured outputs are busy: slow constraints are still compiling after "
                                   f"{self.compile_timeout_s:g} s; retry later")
        result: Future = Future()
        # not a daemon: a C++ compile still running while the interpreter shuts down aborts the
        # process, so an exit waits for it (bounded by MAX_SPEC_CHARS and max_compiles)
        thread = threading.Thread(target=self._compile_into, args=(compiler, spec, result), daemon=False,
                                  name="kvsplice-grammar")
        thread.start()
        try:
            return result.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            with self._lock:
                self.timeouts += 1
                self._timed_out[spec] = None
                while len(self._timed_out) > self.max_entries:
                    self._timed_out.popitem(last=False)
            raise self._timeout_error(spec) from None

    def _compile_into(self, compiler, spec: StructuredSpec, result: Future) -> None:
        """The compile thread: compile, hand over the outcome (dropped if nobody waits any more),
        free the slot."""
        try:
            result.set_result(self._compile_uncached(compiler, spec))
        except BaseException as error:    # handed to the waiting caller, who raises it
            result.set_exception(error)
        finally:
            self._slots.release()

    def _timeout_error(self, spec: StructuredSpec) -> GrammarTimeoutError:
        return GrammarTimeoutError(f"the {spec.kind.replace('_', ' ')} constraint did not compile within "
                                   f"{self.compile_timeout_s:g} s (the server's --grammar-compile-timeout); "
                                   f"simplify it")

    @staticmethod
    def _compile_uncached(compiler, spec: StructuredSpec):
        try:
            if spec.kind == "json_schema":
                return compiler.compile_grammar(schema_ebnf(json.loads(spec.value)))
            if spec.kind == "json_object":
                return compiler.compile_grammar(schema_ebnf({"type": "object"}, strict=False))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(json.loads(spec.value)))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.value)
            return compiler.compile_structural_tag(json.dumps(tool_calls_tag(json.loads(spec.value))))
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"cannot compile the {spec.kind.replace('_', ' ')} constraint: "
                             f"{_error_message(error)}") from error
