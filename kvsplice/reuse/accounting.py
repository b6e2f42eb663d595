"""Per-request reuse counters (the JSON `usage.reuse` object) and a prefill FLOPs model.

Explicit counters replace the SCR overlay's inference from SGLang's double-counted cached_tokens
(reference notes §9, §11.14). The identity every request satisfies:

    prompt_tokens == prefix_tokens + relocated_tokens + prefilled_tokens
    prefilled_tokens == changed + span_tails + unchosen_spans + uncached_unchanged + recomputed

`recomputed` are relocated tokens that selective recompute computed again in every layer (they
count as prefilled, not relocated). `disk_tokens` are the prefix tokens whose K/V was loaded from
the disk tier (0 <= disk_tokens <= prefix_tokens).

By layer type, on a model with sliding-window layers (Gemma 3, Mistral; a windowed pool): the
full-attention layers relocate every relocated token, the sliding layers only those a computed
token's window reads (`window_relocated`), and a relocated token whose old sliding K/V is gone from
such a window is computed instead (`window_recomputed`, within `recomputed`):

    relocated_tokens   [..........................................]   moved in full layers
    window_relocated        [...W...]            [...W...]             moved in sliding layers too
    computed                         [ B ]                [ D ]

    0 <= window_relocated <= relocated_tokens,  0 <= window_recomputed <= recomputed
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from kvsplice.reuse.plan import PlanResult


class AccountingError(ValueError):
    """Reuse counters that do not add up."""


SessionKind = Literal["new", "matched", "off"]


@dataclass(frozen=True)
class ReuseStats:
    """How one prompt was served: prefix_tokens from the radix cache, relocated_tokens (in
    relocated_spans spans) from the session, prefilled_tokens computed, with their breakdown.
    `relocated_spans` counts the spans whose K/V were copied, recomputed tokens or not.
    `session`: "new" (no earlier session), "matched", or "off" (SCR disabled for the request);
    `fallback`: why no relocation happened (a plan reason, or an engine failure), None if it did
    or there was nothing to relocate. `recomputed`, `disk_tokens`, `window_relocated`,
    `window_recomputed`: see the module docstring."""

    prefix_tokens: int
    relocated_tokens: int
    prefilled_tokens: int
    relocated_spans: int
    session: SessionKind
    fallback: str | None = None
    changed: int = 0
    span_tails: int = 0
    unchosen_spans: int = 0
    uncached_unchanged: int = 0
    recomputed: int = 0
    prefill_flops: int = 0     # FLOPs of the tokens computed for this prompt (FlopsModel)
    saved_flops: int = 0       # FLOPs avoided against computing the whole prompt
    disk_tokens: int = 0       # of prefix_tokens: loaded from the disk tier
    window_relocated: int = 0  # of relocated_tokens: moved in the sliding-window layers too
    window_recomputed: int = 0  # of recomputed: computed because a sliding layer's old window was gone

    @classmethod
    def from_plan_result(cls, result: PlanResult, *, prompt_len: int, prefix_len: int,
                         session: SessionKind) -> ReuseStats:
        """Counters for a request served as `result` says: with its plan if it has one, else by
        plain prefill after prefix_len, with the plan's reason as the fallback."""
        plan, parts = result.plan, result.breakdown
        relocated = plan.relocated_tokens if plan else 0
        return cls(
            prefix_tokens=prefix_len,
            relocated_tokens=relocated,
            prefilled_tokens=prompt_len - prefix_len - relocated,
            relocated_spans=len(plan.keeps) if plan else 0,
            session=session,
            fallback=result.reason,
            changed=parts.changed,
            span_tails=parts.span_tails,
            unchosen_spans=parts.unchosen_spans,
            uncached_unchanged=parts.uncached_unchanged,
            recomputed=parts.recomputed,
        )

    def with_recompute(self, tokens: int) -> ReuseStats:
        """These counters after selective recompute moved `tokens` relocated tokens to prefilled
        (relocated_spans still counts every span whose K/V were copied)."""
        return dataclasses.replace(
            self, relocated_tokens=self.relocated_tokens - tokens, prefilled_tokens=self.prefilled_tokens + tokens,
            recomputed=self.recomputed + tokens)

    def check(self, prompt_tokens: int) -> None:
        """Raise AccountingError unless every counter is >= 0, prompt_tokens == prefix +
        relocated + prefilled, the breakdown sums to prefilled, and spans exist iff tokens do."""
        counts = (self.prefix_tokens, self.relocated_tokens, self.prefilled_tokens, self.relocated_spans,
                  self.changed, self.span_tails, self.unchosen_spans, self.uncached_unchanged, self.recomputed)
        if min(counts) < 0:
            raise AccountingError(f"negative reuse counter in {self}")
        if not 0 <= self.disk_tokens <= self.prefix_tokens:
            raise AccountingError(f"disk_tokens {self.disk_tokens} outside [0, prefix {self.prefix_tokens}]")
        if not 0 <= self.window_relocated <= self.relocated_tokens:
            raise AccountingError(f"window_relocated {self.window_relocated} outside [0, relocated "
                                  f"{self.relocated_tokens}]")
        if not 0 <= self.window_recomputed <= self.recomputed:
            raise AccountingError(f"window_recomputed {self.window_recomputed} outside [0, recomputed "
                                  f"{self.recomputed}]")
        if prompt_tokens != self.prefix_tokens + self.relocated_tokens + self.prefilled_tokens:
            raise AccountingError(
                f"prompt_tokens {prompt_tokens} != prefix {self.prefix_tokens} + relocated "
                f"{self.relocated_tokens} + prefilled {self.prefilled_tokens}"
            )
        parts = self.changed + self.span_tails + self.unchosen_spans + self.uncached_unchanged + self.recomputed
        if parts != self.prefilled_tokens:
            raise AccountingError(f"prefilled breakdown does not sum to {self.prefilled_tokens}: {self}")
        if (self.relocated_spans == 0) != (self.relocated_tokens + self.recomputed == 0):
            raise AccountingError(f"{self.relocated_spans} spans but {self.relocated_tokens} relocated "
                                  f"and {self.recomputed} recomputed tokens")

    def as_dict(self) -> dict:
        """The JSON `usage.reuse` object: every counter at top level (the prefilled breakdown
        too: changed, span_tails, unchosen_spans, uncached_unchanged, recomputed)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FlopsModel:
    """Forward FLOPs of prefill, from plain model numbers.

    Per computed token at position p (it attends to context_len = p + 1 keys):
      linear: 2 * non_embedding_params (one multiply-add per weight; Kaplan et al. 2020, "Scaling
        Laws for Neural Language Models", Table 1: C_forward ~= 2N + ...);
      attention: 4 * attention_layers * num_heads * head_dim * context_len (QK^T and attention @ V,
        2 FLOPs per multiply-add each; Hoffmann et al. 2022, "Training Compute-Optimal LLMs",
        Appendix F, and the SCR harness's kv_cache_flops.py). For hybrid models pass only the
        full-attention layers as attention_layers; linear-attention layers are in the 2N term.
    The lm head (2 * hidden_size * vocab_size) is counted only where logits are taken: in prefill,
    the prompt's last token. Relocation (copy and re-rotation) is not counted: O(tokens * kv width)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    non_embedding_params: int
    vocab_size: int
    attention_layers: int | None = None  # default: num_layers (no linear-attention layers)

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden_size, self.num_heads, self.head_dim, self.vocab_size) <= 0:
            raise ValueError(f"FlopsModel sizes must be positive: {self}")
        if self.non_embedding_params < 0 or (self.attention_layers or 0) < 0:
            raise ValueError(f"FlopsModel counts must be >= 0: {self}")

    @property
    def _attention_per_key(self) -> int:
        """Attention FLOPs per (query token, key) pair over all attention layers."""
        layers = self.num_layers if self.attention_layers is None else self.attention_layers
        return 4 * layers * self.num_heads * self.head_dim

    def tokens_flops(self, context_lens: Iterable[int], logits_tokens: int = 0) -> int:
        """FLOPs of computing tokens with the given context lengths (keys attended, own included),
        plus the lm head for `logits_tokens` of them."""
        lens = list(context_lens)
        if any(length < 1 for length in lens):
            raise ValueError("every context length must be >= 1 (a token attends to itself)")
        linear = 2 * self.non_embedding_params * len(lens)
        return linear + self._attention_per_key * sum(lens) + logits_tokens * 2 * self.hidden_size * self.vocab_size

    def prefill_flops(self, prompt_len: int, computed_ranges: Sequence[tuple[int, int]]) -> int:
        """FLOPs of computing the prompt offsets in computed_ranges (disjoint [start, end) within
        [0, prompt_len)), each token attending causally to every earlier position (cached, relocated
        or computed), plus the lm head once if the prompt's last token is computed."""
        total, previous_end, last_computed = 0, 0, False
        for start, end in sorted(computed_ranges):
            if not previous_end <= start <= end <= prompt_len:
                raise ValueError(f"range [{start}, {end}) overlaps another or lies outside [0, {prompt_len})")
            count = end - start
            keys = (start + 1 + end) * count // 2  # sum of p + 1 for p in [start, end)
            total += 2 * self.non_embedding_params * count + self._attention_per_key * keys
            last_computed = last_computed or (count > 0 and end == prompt_len)
            previous_end = end
        if last_computed:
            total += 2 * self.hidden_size * self.vocab_size
        return total

    def saved_flops(self, prompt_len: int, prefix_len: int, computed_ranges: Sequence[tuple[int, int]]) -> int:
        """FLOPs saved by computing only computed_ranges instead of everything beyond the prefix,
        [prefix_len, prompt_len)."""
        return self.prefill_flops(prompt_len, [(prefix_len, prompt_len)]) - self.prefill_flops(prompt_len, computed_ranges)
