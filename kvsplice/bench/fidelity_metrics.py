"""Fidelity metrics: KL between next-token distributions, top-1 and greedy agreement, percentiles."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def kl_per_position(exact: dict[int, torch.Tensor], approx: dict[int, torch.Tensor]) -> dict[int, float]:
    """KL(exact || approx) in nats at every offset of `exact`, from float64 log_softmax of raw logits.
    Raises ValueError when `approx` lacks an offset of `exact` (that position was not computed)."""
    missing = sorted(set(exact) - set(approx))
    if missing:
        raise ValueError(f"no SCR logits at prompt offsets {missing[:5]} (served from a cache?)")
    out = {}
    for offset, logits in exact.items():
        log_p = torch.log_softmax(logits.double(), dim=-1)
        log_q = torch.log_softmax(approx[offset].double(), dim=-1)
        out[offset] = float((log_p.exp() * (log_p - log_q)).sum())
    return out


def top1_agreement(exact: dict[int, torch.Tensor], approx: dict[int, torch.Tensor]) -> float:
    """Fraction of `exact`'s offsets where both logits have the same argmax."""
    same = [int(exact[o].argmax()) == int(approx[o].argmax()) for o in exact]
    return sum(same) / len(same)


def greedy_prefix_fraction(exact_ids: Sequence[int], approx_ids: Sequence[int]) -> float:
    """Tokens equal before the first divergence, over len(exact_ids) (1.0: identical)."""
    agree = 0
    for a, b in zip(exact_ids, approx_ids):
        if a != b:
            break
        agree += 1
    return agree / max(1, len(exact_ids))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, linear interpolation (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
