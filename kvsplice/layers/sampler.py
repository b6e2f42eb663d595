"""Token sampling and logprobs for a batch of rows with per-row `SamplingParams`.

Call order, per decode step:
    sample(logits[B, V], params[B], generators[B], raw_logits[B, V] | None)
      0. `logits` may already be processed (kvsplice.layers.logits_processors: grammar masks,
         penalties, logit_bias, min_tokens); `raw_logits` are the model's own, for logprobs.
      1. greedy rows (temperature == 0 or top_k == 1): argmax of the raw logits.
      2. random rows: filtered_probs() = temperature -> top-k -> top-p -> min-p, vectorised over
         the rows with each row's own parameters (HF `generate` warper order), then one draw per
         row with that row's generator (inverse CDF with one uniform per row).
      3. logprobs (rows that asked): log_softmax of the *unprocessed* logits (vLLM's default
         "raw_logprobs": `raw_logits` when given, else `logits`), the chosen token plus the top-n
         alternatives, or plus the tokens the row's `logprob_token_ids` names (vLLM's).

`filtered_probs_reference` is the plain per-row path that the vectorised one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from kvsplice.sampling_params import SamplingParams

# Candidates sorted for top-p without top-k; a nucleus larger than this falls back to a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one token under the model's raw distribution.

    token_id  the chosen (or actual) token.
    logprob   its log-probability (log_softmax of the unprocessed logits).
    top       the n most likely tokens as (token_id, logprob), most likely first; may contain
              `token_id` itself (OpenAI `top_logprobs` semantics). Empty when n == 0. With
              `logprob_token_ids`: those tokens instead, in the order named.
    rank      1 + the number of tokens more likely than `token_id` (vLLM's rank); None if not computed.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator seeded with `seed` on `device`, or None (use the global RNG) when seed is None.

    Create it once per request and pass it to every `sample` call for that request, so that the
    same seed and the same logits give the same tokens whatever else is in the batch.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check_batch(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence) -> None:
    """Raise ValueError unless logits is [B, V] and params / generators both have B entries."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(
            f"batch mismatch: logits has {batch} rows, params {len(params)}, generators {len(generators)}"
        )


def _row_column(values: Sequence[float], like: Tensor) -> Tensor:
    """`values` as a [R, 1] fp32 tensor on `like`'s device, for per-row broadcasting."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _rows_where(params: Sequence[SamplingParams], wanted: Callable[[SamplingParams], bool]) -> list[int]:
    """Offsets of the rows whose params satisfy `wanted`."""
    return [row for row, p in enumerate(params) if wanted(p)]


def _mask_top_k(scaled: Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: set logits below each row's k-th largest to -inf (ties with the k-th are kept, as
    HF/vLLM). Uses topk(max k) instead of a full sort; rows without top_k are untouched."""
    vocab = scaled.shape[1]
    rows = _rows_where(params, lambda p: p.top_k is not None and p.top_k < vocab)
    if not rows:
        return
    ks = torch.tensor([params[row].top_k for row in rows], device=scaled.device).unsqueeze(1)
    subset = scaled[rows]
    top_values = subset.topk(int(ks.max()), dim=-1, sorted=True).values
    kth_logit = top_values.gather(1, ks - 1)
    scaled[rows] = subset.masked_fill(subset < kth_logit, float("-inf"))


def _mask_top_p(scaled: Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: per row with top_p < 1, keep token i (in descending order) while the mass of the
    tokens strictly before it is < top_p -- HF's "drop the tail whose cumulative mass is <= 1 - top_p"
    -- on the already top-k-masked (so renormalised) distribution; the most likely token always stays.
    Tokens tied with the last kept one are kept too (as top-k keeps ties with the k-th), so the kept
    set is a threshold on the probability: it does not depend on how a sort orders equal values,
    hence not on the other rows of the batch.

    Sorting the whole vocabulary is the slow part, so only the most likely candidates are sorted:
    all finite ones when every row has top_k, else the top _TOP_P_CANDIDATES, falling back to a full
    sort when their mass is below some row's top_p. Exact either way: a token after the candidates
    has at least their mass before it, which is >= top_p, so it would be dropped; and the sorted
    values' prefix (so its running mass, a sequential cumsum) is the same whichever sort ran.
    """
    rows = _rows_where(params, lambda p: p.top_p < 1.0)
    if not rows:
        return
    subset = scaled[rows]
    probs = torch.softmax(subset, dim=-1)
    top_p = _row_column([params[row].top_p for row in rows], scaled)
    if all(params[row].top_k is not None for row in rows):
        candidates = int(torch.isfinite(subset).sum(dim=-1).max().clamp(min=1))
    else:
        candidates = min(_TOP_P_CANDIDATES, subset.shape[1])
    sorted_probs = probs.topk(candidates, dim=-1, sorted=True).values
    if bool((sorted_probs.sum(dim=-1, keepdim=True) < top_p).any()):
        sorted_probs = probs.sort(dim=-1, descending=True).values
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_probs.gather(1, kept - 1)
    scaled[rows] = subset.masked_fill(probs < threshold, float("-inf"))


def _apply_min_p(probs: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Zero tokens with prob < min_p * max prob and renormalise; rows with min_p == 0 are untouched."""
    min_p = _row_column([p.min_p for p in params], probs)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    kept = probs.masked_fill(probs < threshold, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    # Rows with min_p == 0 keep their exact values (no renormalisation rounding), so a row's
    # result does not depend on which other rows share the batch.
    return torch.where(min_p > 0, kept, probs)


def filtered_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Sampling distribution [R, V] for random rows: temperature, top-k, top-p, min-p (vectorised).

    Every row must have temperature > 0. Each row's output depends only on that row's logits and
    params (not on the rest of the batch). Rows sum to 1; filtered-out tokens have probability 0.
    """
    if any(p.temperature <= 0 for p in params):
        raise ValueError("filtered_probs: temperature must be > 0 (greedy rows take argmax)")
    scaled = logits.float() / _row_column([p.temperature for p in params], logits)
    _mask_top_k(scaled, params)
    _mask_top_p(scaled, params)
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0 for p in params):
        probs = _apply_min_p(probs, params)
    return probs


def filtered_probs_reference(logits_row: Tensor, params: SamplingParams) -> Tensor:
    """Plain per-row version of `filtered_probs` for one row [V]; the tests' reference.

    Same order and tie rules: temperature, top-k (ties with the k-th kept), top-p (keep while the
    mass before the token is < top_p, in descending order; ties with the last kept one kept), min-p
    (prob >= min_p * max prob).
    """
    scaled = logits_row.float() / params.temperature
    vocab = scaled.shape[0]
    if params.top_k is not None and params.top_k < vocab:
        kth_logit = torch.topk(scaled, params.top_k).values[-1]
        scaled = torch.where(scaled < kth_logit, float("-inf"), scaled)
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        order = torch.argsort(probs, descending=True).tolist()
        mass_before, last_kept = 0.0, order[0]
        for token_id in order:
            if mass_before >= params.top_p:
                break
            last_kept = token_id
            mass_before += probs[token_id].item()
        scaled = torch.where(probs >= probs[last_kept], scaled, float("-inf"))   # ties with it kept
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs = probs / probs.sum()
    return probs


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    """One U[0, 1) per row [R, 1]: seeded rows from their own generator (drawn on the generator's
    device), unseeded rows from one draw of the global RNG."""
    uniforms = torch.empty(len(generators), 1, device=device)
    unseeded = [row for row, gen in enumerate(generators) if gen is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), 1, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            uniforms[row] = torch.rand(1, generator=gen, device=gen.device).to(device)
    return uniforms


def _draw(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row of `probs` [R, V] by inverse CDF: the first token whose cumulative mass
    exceeds u * total, u ~ U[0, 1). P(token i) = p_i; zero-probability tokens have an empty interval
    and are never chosen. One uniform per row (not V exponentials as vLLM's GPU race) keeps the CPU
    cost at one cumsum. A seeded row's token depends only on its probs and its generator.
    """
    cdf = torch.cumsum(probs, dim=-1)
    targets = _uniforms(generators, probs.device) * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # fp32 rounding can put u * total at the very top (== cdf[-1]); fall back to the last token
    # with nonzero probability rather than past the end or onto a filtered-out tail token.
    vocab = probs.shape[1]
    last_nonzero = vocab - 1 - (probs > 0).flip(dims=[1]).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(token_ids, last_nonzero)


def _token_logprobs(raw_logprobs: Tensor, token_ids: Tensor, top_ns: Sequence[int],
                    named: Sequence[tuple[int, ...] | None] = ()) -> list[TokenLogprob]:
    """TokenLogprob per row of `raw_logprobs` [N, V] for `token_ids` [N], row i with top_ns[i] alternatives,
    or, where named[i] is given, the logprobs of those token ids instead."""
    chosen_column = raw_logprobs.gather(1, token_ids.long().unsqueeze(1))
    chosen = chosen_column.squeeze(1).tolist()
    ranks = ((raw_logprobs > chosen_column).sum(dim=1) + 1).tolist()
    max_n = min(max(top_ns, default=0), raw_logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in top_ns]
    top_ids: list[list[int]] = [[] for _ in top_ns]
    if max_n > 0:
        top = torch.topk(raw_logprobs, max_n, dim=-1, sorted=True)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    tops = [tuple(zip(top_ids[row][:n], top_values[row][:n])) for row, n in enumerate(top_ns)]
    for row, ids in enumerate(named):
        if ids is not None:
            tops[row] = tuple(zip(ids, raw_logprobs[row, list(ids)].tolist()))
    return [
        TokenLogprob(token_id=int(token_id), logprob=chosen[row], top=tops[row], rank=int(ranks[row]))
        for row, token_id in enumerate(token_ids.tolist())
    ]


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    raw_logits: Tensor | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of `logits` [B, V] (fp32) with that row's params and generator.
    `raw_logits` [B, V]: the model's logits before any processing, which logprobs are taken from
    (default: `logits`).

    Returns (token ids, logprobs) with B entries each; logprobs[i] is None unless
    params[i].logprobs is set, else the chosen token's raw logprob plus params[i].logprobs top
    alternatives (or the params[i].logprob_token_ids named tokens' raw logprobs). Greedy rows never touch their generator; a seeded random row's token depends
    only on its logits, params and generator state (which advances by one draw).
    Raises ValueError on shape / length mismatch.
    """
    _check_batch(logits, params, generators)
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    random_rows = [row for row, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        probs = filtered_probs(logits[random_rows], [params[row] for row in random_rows])
        drawn = _draw(probs, [generators[row] for row in random_rows])
        token_ids[random_rows] = drawn
    logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if logprob_rows:
        source = logits if raw_logits is None else raw_logits.float()
        raw = torch.log_softmax(source[logprob_rows], dim=-1)
        top_ns = [0 if params[row].logprob_token_ids else params[row].logprobs for row in logprob_rows]
        named = [params[row].logprob_token_ids for row in logprob_rows]
        for row, entry in zip(logprob_rows, _token_logprobs(raw, token_ids[logprob_rows], top_ns, named)):
            logprobs[row] = entry
    return token_ids.tolist(), logprobs


def logprobs_of(logits: Tensor, token_ids: Tensor, top_n: int) -> list[TokenLogprob]:
    """Raw logprob of token_ids[i] under logits[i] ([N, V], [N]) plus the top_n alternatives.

    Used for prompt logprobs: logits[i] is the model output at prompt offset i and token_ids[i]
    the actual prompt token at offset i + 1. Raises ValueError on bad shapes or top_n < 0.
    """
    if logits.dim() != 2 or token_ids.dim() != 1 or logits.shape[0] != token_ids.shape[0]:
        raise ValueError(
            f"logprobs_of: need logits [N, V] and token_ids [N], got {tuple(logits.shape)} and {tuple(token_ids.shape)}"
        )
    if top_n < 0:
        raise ValueError(f"logprobs_of: top_n must be >= 0, got {top_n}")
    raw = torch.log_softmax(logits.float(), dim=-1)
    return _token_logprobs(raw, token_ids.to(raw.device), [top_n] * logits.shape[0])
