"""The fidelity front: KL against the share of the prompt computed, one row per setting.

Input: the per-case results of `kvsplice.bench.fidelity` (CaseResult). Per setting, over its cases:

    computed     prefilled tokens / prompt tokens, pooled over cases
    FLOPs        prefill FLOPs (FlopsModel) / FLOPs of computing every prompt
                 token, pooled over cases
    mean, median, p90, worst    of the cases' mean KL(exact || setting) over the last positions
    answer       mean over cases of the KL at the prompt's last position (the next token)

A setting is on the Pareto front when no other SCR setting computes at most as much with a mean
KL at most as large, one of them strictly. The fp8 anchors (exact K/V stored in fp8) are reference
lines: their cost is the whole prompt, what matters is their error.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from kvsplice.bench.fidelity_metrics import percentile


def summarize(results: Sequence) -> dict:
    """Aggregate one setting's CaseResults: the old columns (mean of per-case KL means, p90 of the
    per-case p90s, max over positions, top-1, greedy, token sums) and the front's (median, p90
    and worst of the per-case means, answer-position KL, computed and FLOPs shares)."""
    n = len(results)
    means = [r.kl_mean for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "setting": results[0].setting, "cases": n,
        "kl_mean": sum(means) / n,
        "kl_p90": percentile([r.kl_p90 for r in results], 0.9),
        "kl_max": max(r.kl_max for r in results),
        "kl_median": statistics.median(means),
        "kl_case_p90": percentile(means, 0.9),
        "kl_worst": max(means),
        "worst_case": results[means.index(max(means))].case,
        "kl_answer": sum(r.kl_answer for r in results) / n,
        "top1_agreement": sum(r.top1_agreement for r in results) / n,
        "greedy_prefix_frac": sum(r.greedy_prefix_frac for r in results) / n,
        "greedy_exact": sum(r.greedy_exact for r in results),
        "prompt_tokens": prompt,
        "relocated_tokens": sum(r.relocated_tokens for r in results),
        "prefilled_tokens": sum(r.prefilled_tokens for r in results),
        "recomputed_tokens": sum(r.recomputed_tokens for r in results),
        "computed_share": sum(r.computed_tokens for r in results) / prompt,
        "flops_share": sum(r.prefill_flops for r in results) / sum(r.full_flops for r in results),
    }


def pareto(summaries: Sequence[dict]) -> set[str]:
    """Labels of the settings on the front of (computed_share, kl_mean), both minimised."""
    front = set()
    for s in summaries:
        dominated = any(o is not s and o["computed_share"] <= s["computed_share"] and o["kl_mean"] <= s["kl_mean"]
                        and (o["computed_share"] < s["computed_share"] or o["kl_mean"] < s["kl_mean"])
                        for o in summaries)
        if not dominated:
            front.add(s["setting"])
    return front


def choose_default(summaries: Sequence[dict], max_share: float, tolerance: float = 0.1) -> Optional[dict]:
    """The front's knee within the compute budget: among the front settings computing at most
    `max_share` of the prompt, the cheapest whose mean KL is within `tolerance` (relative) of the
    lowest; None when no setting fits."""
    front = pareto(summaries)
    within = [s for s in summaries if s["setting"] in front and s["computed_share"] <= max_share]
    if not within:
        return None
    best = min(s["kl_mean"] for s in within)
    return min((s for s in within if s["kl_mean"] <= best * (1 + tolerance)), key=lambda s: s["computed_share"])


def front_table(summaries: Sequence[dict], anchors: Sequence[dict] = ()) -> str:
    """The front as markdown: the anchors first (reference lines), then every setting by computed
    share; `*` marks the Pareto front, "x fp8" is the mean KL over the first anchor's."""
    lines = ["| setting | computed | FLOPs | mean KL | median | p90 | worst case | answer KL | top-1 | x fp8 | front |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = anchors[0]["kl_mean"] if anchors else None
    for anchor in anchors:
        lines.append(_front_row(anchor, base, "reference"))
    front = pareto(summaries)
    for s in sorted(summaries, key=lambda s: (s["computed_share"], s["kl_mean"])):
        lines.append(_front_row(s, base, "*" if s["setting"] in front else ""))
    return "\n".join(lines)


def _front_row(s: dict, base: Optional[float], mark: str) -> str:
    ratio = f"{s['kl_mean'] / base:.2f}" if base else "-"
    return (f"| {s['setting']} | {s['computed_share']:.1%} | {s['flops_share']:.1%} | {s['kl_mean']:.5f} | "
            f"{s['kl_median']:.5f} | {s['kl_case_p90']:.5f} | {s['kl_worst']:.4f} ({s['worst_case']}) | "
            f"{s['kl_answer']:.4f} | {s['top1_agreement']:.3f} | {ratio} | {mark} |")
