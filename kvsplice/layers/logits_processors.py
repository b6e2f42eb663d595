"""Logits processing before sampling: grammar masks, min_tokens, logit_bias and the three penalties.

Per decode step, on the rows that sample (`process_logits`, vectorised over the rows, each with its
own `LogitsState`), in this order (vLLM's: the grammar mask first, then the processors, then the
penalties; a masked token stays masked whatever follows):

    1. grammar      tokens the request's grammar does not allow next -> -inf (one bitmask for all rows)
       allowed      tokens not in allowed_token_ids -> -inf (vLLM's whitelist; never beside a grammar)
    2. min_tokens   EOS and stop_token_ids -> -inf while fewer than min_tokens tokens were generated
    3. logit_bias   logit += bias for each listed token (OpenAI)
    4. repetition   tokens seen in the prompt or the output: logit / p if logit > 0 else logit * p
                    (CTRL, Keskar et al. 2019, as HF's RepetitionPenaltyLogitsProcessor and vLLM)
    5. frequency, presence   logit -= frequency * count + presence * (count > 0), count = times the
                    token was generated (OpenAI's formula, output tokens only as in vLLM)

then `sample` (temperature, top-k/p, min-p) on the result; logprobs stay those of the raw logits.
After sampling, `accept_tokens` advances every state by its token (counts, matcher).
`process_logits_reference` is the plain per-row path the tests compare with (and with HF's processors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from kvsplice.sampling_params import SamplingParams
from kvsplice.structured.matcher import GrammarState, apply_bitmask, fill_bitmask


@dataclass
class LogitsState:
    """One request's logits processing state (owned by its Req; the engine thread updates it).

    stop_ids       ids masked until min_tokens are generated (EOS unless ignore_eos, and stop_token_ids).
    output_counts  [V] fp32, times each token was generated; None without frequency/presence/repetition.
    prompt_mask    [V] bool, tokens of the prompt; None without repetition penalty.
    bias_ids / bias_values  logit_bias as [K] int64 / [K] fp32.
    grammar        the request's grammar matcher, or None.
    allowed        [K] int64, the tokens allowed_token_ids lets be sampled; None without it.
    """

    params: SamplingParams
    stop_ids: tuple[int, ...]
    output_counts: Tensor | None
    prompt_mask: Tensor | None
    bias_ids: Tensor
    bias_values: Tensor
    grammar: GrammarState | None
    allowed: Tensor | None = None
    num_generated: int = 0
    grammar_broken: bool = False

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
               eos_token_ids: Sequence[int], grammar: GrammarState | None = None) -> "LogitsState | None":
        """The state for a request, or None when its params change no logits. ValueError naming the
        field when a logit_bias or allowed_token_ids id is outside the vocabulary, or when min_tokens
        would mask every allowed token."""
        if not params.processes_logits:
            return None
        _check_in_vocab("logit_bias", [t for t, _ in params.logit_bias], vocab_size)
        _check_in_vocab("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
        penalised = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        counts = torch.zeros(vocab_size, dtype=torch.float32) if penalised else None
        prompt_mask = None
        if params.repetition_penalty != 1:
            prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
            prompt_mask[torch.tensor(list(prompt_ids), dtype=torch.int64)] = True
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        stop_ids = tuple(dict.fromkeys(eos + params.stop_token_ids))
        bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        return cls(params, stop_ids, counts, prompt_mask, bias_ids, bias_values, grammar,
                   _allowed_ids(params, stop_ids))

    def accept(self, token_id: int) -> None:
        """Record a sampled token. A token its grammar rejects should never have been sampled (it
        was masked); should it happen all the same, `grammar_broken` is set and from then on only
        the stop ids are allowed, so the reply ends instead of leaving its grammar silently."""
        self.num_generated += 1
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.grammar is not None and not self.grammar_broken and not self.grammar.accept(token_id):
            self.grammar_broken = True


def _check_in_vocab(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError naming `name` when some of `token_ids` are outside [0, vocab_size) (up to 8 named)."""
    bad = [t for t in token_ids if t >= vocab_size]
    if bad:
        ids = ", ".join(str(t) for t in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        named = f"token id {ids} is" if len(bad) == 1 else f"token ids {ids} are"
        raise ValueError(f"{name}: {named} outside the vocabulary [0, {vocab_size})")


def _allowed_ids(params: SamplingParams, stop_ids: tuple[int, ...]) -> Tensor | None:
    """allowed_token_ids as [K] int64 (None without it); ValueError when min_tokens would mask every
    one of them (nothing could be sampled)."""
    if params.allowed_token_ids is None:
        return None
    if params.min_tokens and set(params.allowed_token_ids) <= set(stop_ids):
        raise ValueError("allowed_token_ids: every allowed token is a stop token, which min_tokens forbids "
                         "for the first tokens: nothing could be sampled")
    return torch.tensor(params.allowed_token_ids, dtype=torch.int64)


def _rows(states: Sequence[LogitsState | None], wanted) -> list[int]:
    return [row for row, state in enumerate(states) if state is not None and wanted(state)]


def _column(values: list[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _apply_grammars(logits: Tensor, states: Sequence[LogitsState | None]) -> None:
    for row in _rows(states, lambda s: s.grammar_broken):
        keep = logits[row, list(states[row].stop_ids)].clone()
        logits[row] = float("-inf")
        logits[row, list(states[row].stop_ids)] = keep
    rows = _rows(states, lambda s: s.grammar is not None and not s.grammar_broken)
    if not rows:
        return
    bitmask = fill_bitmask([states[row].grammar for row in rows], logits.shape[1])
    subset = logits[rows]
    apply_bitmask(subset, bitmask)
    logits[rows] = subset


def _apply_allowed(logits: Tensor, states: Sequence[LogitsState | None]) -> None:
    rows = _rows(states, lambda s: s.allowed is not None)
    if not rows:
        return
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    for position, row in enumerate(rows):
        keep[position, states[row].allowed.to(logits.device)] = True
    logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))


def _apply_min_tokens(logits: Tensor, states: Sequence[LogitsState | None]) -> None:
    rows = _rows(states, lambda s: s.num_generated < s.params.min_tokens and s.stop_ids)
    if not rows:
        return
    row_index = [row for row in rows for _ in states[row].stop_ids]
    token_index = [token for row in rows for token in states[row].stop_ids]
    logits[row_index, token_index] = float("-inf")


def _apply_logit_bias(logits: Tensor, states: Sequence[LogitsState | None]) -> None:
    rows = _rows(states, lambda s: s.bias_ids.numel() > 0)
    if not rows:
        return
    row_index = torch.cat([torch.full_like(states[row].bias_ids, row) for row in rows]).to(logits.device)
    token_index = torch.cat([states[row].bias_ids for row in rows]).to(logits.device)
    values = torch.cat([states[row].bias_values for row in rows]).to(logits.device, logits.dtype)
    logits.index_put_((row_index, token_index), values, accumulate=True)


def _apply_repetition(logits: Tensor, states: Sequence[LogitsState | None]) -> None:
    rows = _rows(states, lambda s: s.params.repetition_penalty != 1)
    if not rows:
        return
    subset = logits[rows]
    seen = torch.stack([states[row].prompt_mask | (states[row].output_counts > 0) for row in rows]).to(logits.device)
    penalty = _column([states[row].params.repetition_penalty for row in rows], subset)
    penalised = torch.where(subset > 0, subset / penalty, subset * penalty)
    logits[rows] = torch.where(seen, penalised, subset)


def _apply_frequency_presence(logits: Tensor, states: Sequence[LogitsState | None]) -> None:
    rows = _rows(states, lambda s: s.params.frequency_penalty != 0 or s.params.presence_penalty != 0)
    if not rows:
        return
    counts = torch.stack([states[row].output_counts for row in rows]).to(logits.device)
    frequency = _column([states[row].params.frequency_penalty for row in rows], counts)
    presence = _column([states[row].params.presence_penalty for row in rows], counts)
    logits[rows] -= frequency * counts + presence * (counts > 0).to(counts.dtype)


def process_logits(logits: Tensor, states: Sequence[LogitsState | None]) -> Tensor:
    """The logits [B, V] to sample from: `logits` itself when no row has a state, else a processed
    copy (the input is left as it was, for raw logprobs). Rows without a state are unchanged."""
    if len(states) != logits.shape[0]:
        raise ValueError(f"process_logits: {logits.shape[0]} rows but {len(states)} states")
    if all(state is None for state in states):
        return logits
    processed = logits.clone()
    _apply_grammars(processed, states)
    _apply_allowed(processed, states)
    _apply_min_tokens(processed, states)
    _apply_logit_bias(processed, states)
    _apply_repetition(processed, states)
    _apply_frequency_presence(processed, states)
    return processed


def accept_tokens(states: Sequence[LogitsState | None], token_ids: Sequence[int]) -> None:
    """Advance each state by the token its row sampled (rows without a state are skipped)."""
    for state, token_id in zip(states, token_ids):
        if state is not None:
            state.accept(token_id)


def process_logits_reference(logits_row: Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                             output_ids: Sequence[int], stop_ids: Sequence[int],
                             allowed: Tensor | None = None) -> Tensor:
    """Plain per-row `process_logits` for one row [V] (token loops; the tests' reference).
    `allowed`: bool [V] of the tokens the grammar allows, or None."""
    out = logits_row.clone().float()
    if allowed is not None:
        out[~allowed] = float("-inf")
    if params.allowed_token_ids is not None:
        whitelist = set(params.allowed_token_ids)
        for token in range(out.shape[0]):
            if token not in whitelist:
                out[token] = float("-inf")
    if len(output_ids) < params.min_tokens:
        for token in stop_ids:
            out[token] = float("-inf")
    for token, bias in params.logit_bias:
        out[token] += bias
    if params.repetition_penalty != 1:
        for token in set(prompt_ids) | set(output_ids):
            value = out[token]
            out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    counts: dict[int, int] = {}
    for token in output_ids:
        counts[token] = counts.get(token, 0) + 1
    for token, count in counts.items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out
