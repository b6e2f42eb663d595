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
from typing import Iterable

# OpenAI caps `logprobs` / `top_logprobs` at 20; vLLM follows.
MAX_LOGPROBS = 20
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


def _as_id_tuple(stop_token_ids: Iterable[int]) -> tuple[int, ...]:
    """Normalise `stop_token_ids` to a tuple of non-negative ints; ValueError otherwise."""
    if isinstance(stop_token_ids, (str, bytes)):
        raise ValueError("stop_token_ids: must be a sequence of ints, got a string")
    items = tuple(stop_token_ids)
    for item in items:
        if not _is_int(item) or item < 0:
            raise ValueError(f"stop_token_ids: every entry must be an int >= 0, got {item!r}")
    return items


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
      stop_token_ids    token ids that end generation (the token itself is not detokenized as text
                        unless it is a normal token; the engine decides).
      ignore_eos        keep generating past EOS.
      logprobs          None = none; n >= 0 = chosen token's logprob plus the n most likely alternatives.
      prompt_logprobs   same, for each prompt token (except the first).
      skip_special_tokens  drop special tokens when detokenizing.

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
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

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
        # Frozen dataclass: normalising in place needs object.__setattr__, allowed here only.
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_id_tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when the choice is deterministic argmax: temperature == 0 or top_k == 1."""
        return self.temperature == 0 or self.top_k == 1
