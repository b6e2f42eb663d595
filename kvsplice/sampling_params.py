"""Per-request sampling parameters (vLLM / OpenAI semantics).

The server builds one `SamplingParams` per request from the OpenAI body; the sampler
(`kvsplice.layers.sampler`) and the detokenizer (`kvsplice.engine.detokenizer`) read it.
Validation happens here so that bad input becomes a `ValueError` (HTTP 400) before any
work is scheduled. Upper caps that depend on the model (max_tokens vs context length) are
the server's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from kvsplice.structured.spec import StructuredSpec
from kvsplice.structured.stop_patterns import compile_stop_regex

# OpenAI caps `logprobs` / `top_logprobs` at 20; vLLM follows.
MAX_LOGPROBS = 20
# OpenAI's ranges: presence / frequency penalty in [-2, 2], logit_bias values in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# vLLM accepts any repetition_penalty > 0; past 10 every seen token is all but banned.
MAX_REPETITION_PENALTY = 10.0
# Entries of logit_bias (OpenAI sets no number; this bounds the per-request tensor work).
MAX_LOGIT_BIAS_ENTRIES = 1024
# Entries of logprob_token_ids (vLLM sets no number; this bounds each token's logprobs in the answer).
MAX_LOGPROB_TOKEN_IDS = 1024
# torch.Generator.manual_seed accepts exactly this range (int64 min .. uint64 max).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _is_int(value: object) -> bool:
    """True for a real int (bool is an int subclass in Python but never a valid count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_str_tuple(stop: str | Iterable[str]) -> tuple[str, ...]:
    """Normalise `stop` (one string or an iterable of strings) to a tuple of non-empty strings.

    Raises ValueError naming `stop` when an entry is not a string or is empty (an empty
    stop string would match before the first token).
    """
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"stop: every entry must be a string, got {type(item).__name__}")
        if item == "":
            raise ValueError("stop: stop strings must be non-empty")
    return items


def _as_pattern_tuple(patterns: str | Iterable[str]) -> tuple[str, ...]:
    """Normalise `stop_regex` (one pattern or several) to a tuple; ValueError naming `stop_regex` for
    an entry that is not a string, does not compile or matches the empty string."""
    items = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"stop_regex: every entry must be a string, got {type(item).__name__}")
        compile_stop_regex(item)
    return items


def _as_id_tuple(stop_token_ids: Iterable[int]) -> tuple[int, ...]:
    """Normalise `stop_token_ids` to a tuple of non-negative ints; ValueError otherwise."""
    if isinstance(stop_token_ids, (str, bytes)):
        raise ValueError("stop_token_ids: must be a sequence of ints, got a string")
    items = tuple(stop_token_ids)
    for item in items:
        if not _is_int(item) or item < 0:
            raise ValueError(f"stop_token_ids: every entry must be an int >= 0, got {item!r}")
    return items


def _as_token_set(name: str, token_ids: Iterable[int], limit: int | None = None) -> tuple[int, ...]:
    """Normalise a list of token ids (`allowed_token_ids`, `logprob_token_ids`) to a tuple of distinct ids
    in the order given; ValueError naming `name` for an entry that is not an int >= 0, an empty list,
    or more than `limit` entries."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"{name}: must be a list of token ids, got a string")
    items = tuple(token_ids)
    if not items:
        raise ValueError(f"{name}: must not be empty (leave the field out instead)")
    if limit is not None and len(items) > limit:
        raise ValueError(f"{name}: at most {limit} token ids, got {len(items)}")
    bad = [item for item in items if not _is_int(item) or item < 0]
    if bad:
        raise ValueError(f"{name}: entries must be token ids (ints >= 0), got {_listed(bad)}")
    return tuple(dict.fromkeys(items))


def _as_bias_tuple(logit_bias: Mapping | Iterable) -> tuple[tuple[int, float], ...]:
    """Normalise `logit_bias` ({token id (int or decimal string): bias} or (id, bias) pairs) to
    sorted (id, bias) pairs; ValueError naming the field for a bad id, bias or size."""
    items = list(logit_bias.items()) if isinstance(logit_bias, Mapping) else list(logit_bias)
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(items)}")
    pairs: dict[int, float] = {}
    bad_keys, bad_biases = [], []
    for key, bias in items:
        token_id = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token_id) or token_id < 0:
            bad_keys.append(key)
        elif not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            bad_biases.append((key, bias))
        else:
            pairs[token_id] = float(bias)
    # every bad entry is named at once, so a client fixes its map in one round trip
    if bad_keys:
        raise ValueError(f"logit_bias: keys must be token ids (ints >= 0), got {_listed(bad_keys)}")
    if bad_biases:
        named = _listed([f"{bias!r} for token {key}" for key, bias in bad_biases], quote=False)
        raise ValueError(f"logit_bias: biases must be numbers in [-100, 100], got {named}")
    return tuple(sorted(pairs.items()))


def _listed(values: list, quote: bool = True, shown: int = 8) -> str:
    """`values` as a comma-separated list (repr'd when `quote`), the first `shown` and a count of the rest."""
    text = ", ".join(repr(value) if quote else str(value) for value in values[:shown])
    return text + (f" and {len(values) - shown} more" if len(values) > shown else "")


def _check_range(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """ValueError naming `name` unless `value` is a finite number in [low, high] ((low, high] if low_open)."""
    if not _is_number(value) or not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}: must be a number in {bracket}{low:g}, {high:g}], got {value!r}")


def _check_optional_count(name: str, value: int | None) -> None:
    """Validate a logprobs-style field: None, or an int in [0, MAX_LOGPROBS]."""
    if value is None:
        return
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name}: must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token and when to stop.

    Fields follow vLLM's `SamplingParams`:
      max_tokens        generated tokens at most (>= 1).
      temperature       >= 0; 0 means greedy (argmax).
      top_p             nucleus: keep the smallest top set with cumulative probability >= top_p, in (0, 1].
      top_k             keep the k most likely tokens (>= 1) or None for all.
      min_p             keep tokens with probability >= min_p * max probability, in [0, 1].
      seed              per-request RNG seed (same seed + same logits => same tokens), None = global RNG.
      stop              stop strings; a single string is accepted. The output ends right before the
                        first one found (not included, OpenAI semantics).
      stop_regex        stop regexes (SGLang's; the `regex` module's syntax); the output ends right
                        before the first match, as for stop strings (kvsplice/structured/stop_patterns.py).
      stop_token_ids    token ids that end generation (the token itself is not detokenized as text
                        unless it is a normal token; the engine decides).
      ignore_eos        keep generating past EOS.
      logprobs          None = none; n >= 0 = chosen token's logprob plus the n most likely alternatives.
      prompt_logprobs   same, for each prompt token (except the first).
      skip_special_tokens  drop special tokens when detokenizing.
      presence_penalty  in [-2, 2]: subtracted once from the logit of every token already generated.
      frequency_penalty in [-2, 2]: subtracted from a token's logit once per time it was generated.
      repetition_penalty in (0, 10]: logits of tokens in the prompt or the output are divided by it
                        when positive, multiplied when negative (CTRL / HF / vLLM); 1 = off.
      logit_bias        {token id: bias in [-100, 100]} added to the logits (stored as sorted pairs).
      min_tokens        EOS and stop_token_ids cannot be sampled before this many tokens (<= max_tokens).
      allowed_token_ids only these token ids can be sampled (vLLM's); None = all. Distinct, non-empty.
      logprob_token_ids the token ids whose logprobs are reported at each generated position, in place of
                        the `logprobs` most likely ones (vLLM's); needs `logprobs`. None = the top ones.
      structured        a StructuredSpec the reply must match (grammar-constrained sampling), or None.

    The logits processing fields change the distribution tokens are sampled from; logprobs stay
    those of the model's raw distribution (vLLM's default).

    Raises ValueError, naming the field, on any invalid value. Lists given for `stop` and
    `stop_token_ids` are stored as tuples so the object stays hashable.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredSpec | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    logprob_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Validate every field and normalise `stop` / `stop_token_ids` to tuples."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k: must be None or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed: must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")
        _check_optional_count("logprobs", self.logprobs)
        _check_optional_count("prompt_logprobs", self.prompt_logprobs)
        self._check_logits_processing()
        self._check_token_lists()
        # Frozen dataclass: normalising in place needs object.__setattr__, allowed here only.
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_regex", _as_pattern_tuple(self.stop_regex))
        object.__setattr__(self, "stop_token_ids", _as_id_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_bias_tuple(self.logit_bias))

    def _check_logits_processing(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValueError(f"structured: must be a StructuredSpec, got {type(self.structured).__name__}")
            # a complete match allows only a stop token: ignoring it, or forbidding it for a
            # while, would leave no token to sample
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured outputs or a forced tool call")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured outputs or a forced tool call")

    def _check_token_lists(self) -> None:
        """Normalise `allowed_token_ids` / `logprob_token_ids` (in place) and check what they combine with."""
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_token_set("allowed_token_ids", self.allowed_token_ids))
            if self.structured is not None:   # the two masks could leave no token to sample
                raise ValueError("allowed_token_ids cannot be combined with structured outputs or a forced tool call")
        if self.logprob_token_ids is not None:
            object.__setattr__(self, "logprob_token_ids", _as_token_set("logprob_token_ids", self.logprob_token_ids,
                                                                        MAX_LOGPROB_TOKEN_IDS))
            if self.logprobs is None:
                raise ValueError("logprob_token_ids: needs logprobs (the named tokens' logprobs are reported "
                                 "in place of the most likely ones)")

    @property
    def processes_logits(self) -> bool:
        """True when logits are changed before sampling (penalties, bias, min_tokens, allowed_token_ids, a
        grammar)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.min_tokens > 0 or self.structured is not None
                or self.allowed_token_ids is not None)

    @property
    def is_greedy(self) -> bool:
        """True when the choice is deterministic argmax: temperature == 0 or top_k == 1."""
        return self.temperature == 0 or self.top_k == 1
