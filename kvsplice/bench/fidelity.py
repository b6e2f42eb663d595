"""SCR fidelity: how far Suffix Cache Reuse moves the model's outputs from a full recompute.

For each edit case (`kvsplice.bench.edit_cases`) and each SCR setting:

    turn 1   SCR engine, session_id=case   prompt + greedy reply (16 tokens) -> the session's sequence
    turn 2   SCR engine, same session      edited prompt (with THAT reply), keep_last_logits=32, greedy N
    exact    engine with prefix_cache=False, the same turn 2 prompt, keep_last_logits=32, greedy N

Metrics over the last 32 prompt positions (always computed: each case ends with a >= 40-token user
message): KL(exact || SCR) in nats from float64 log_softmax, mean and p90, and top-1 agreement; over
the N generated tokens: the fraction equal before the first divergence and an exact-match flag; and
the relocated / prefilled / prefix token counts of turn 2.

All engines share one loaded Decoder (the checkpoint is read once); each case gets a fresh Engine
(its own pool, radix tree and sessions), and every setting starts from turn 1's prompt in the radix
tree and nothing else (see `Harness`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.bench.edit_cases import CasesFileError, EditCase, builtin_cases, fill_reply, load_cases
from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.engine.llm import LLM, GenerationResult, build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

LOGIT_POSITIONS = 32
TURN1_REPLY_TOKENS = 16
DEFAULT_KS = (0, 1, 2, 4, 6, 8)
DEFAULT_TAILS = (4, 8, 16, 32)
BASE_K, BASE_TAIL = 6, 16
POOL_SLOTS = 8_192  # the reference engine: one prompt of up to ~4K tokens at a time
CASE_POOL_SLOTS = 32_768  # one case: turn 1, its sessions (idle ones are dropped when short), turn 2


@dataclass(frozen=True)
class Setting:
    """One SCR configuration under test. max_spans == 0 means SCR off (plain prefix caching)."""

    label: str
    max_spans: int
    tail: int
    no_rerotate: bool = False

    def request_scr(self) -> str | dict:
        """The per-request `scr` field for this setting ("off" when K == 0)."""
        if self.max_spans == 0:
            return "off"
        return {"max_spans": self.max_spans, "tail": self.tail, "no_rerotate": self.no_rerotate}


@dataclass(frozen=True)
class CaseResult:
    """Fidelity of one case under one setting (see the module docstring for each metric)."""

    setting: str
    case: str
    prompt_tokens: int
    prefix_tokens: int
    relocated_tokens: int
    prefilled_tokens: int
    relocated_spans: int
    fallback: Optional[str]
    kl_mean: float
    kl_p90: float
    kl_max: float
    top1_agreement: float
    greedy_prefix_frac: float
    greedy_exact: bool


def default_settings(ks: Sequence[int] = DEFAULT_KS, tails: Sequence[int] = DEFAULT_TAILS) -> list[Setting]:
    """The sweep: every K at tail=16, every tail at K=6, and the NO_REROTATE control (K=6, tail=16)."""
    settings = [Setting(f"K={k} tail={BASE_TAIL}" if k else "scr off", k, BASE_TAIL) for k in ks]
    settings += [Setting(f"K={BASE_K} tail={t}", BASE_K, t) for t in tails if t != BASE_TAIL]
    settings.append(Setting(f"NO_REROTATE K={BASE_K} tail={BASE_TAIL}", BASE_K, BASE_TAIL, no_rerotate=True))
    return settings


# ----- metrics ------------------------------------------------------------------------------
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


# ----- running ------------------------------------------------------------------------------
class Harness:
    """One loaded model: an exact-reference engine (prefix_cache=False) and, per case, a fresh SCR
    engine around the same Decoder.

    Within a case every setting runs under its own session id with per-request `scr` settings.
    Turn 1's prompt is prefilled once and its radix path locked by the harness; after each setting
    `flush_cache` drops every session and every other radix entry, so each setting starts from the
    state a fresh engine has after prefilling turn 1's prompt (exact K/V either way).
    """

    def __init__(self, model: Optional[str] = None, gen_tokens: int = 32, base: Optional[ReuseConfig] = None):
        self.reference = build_engine(EngineConfig(model=model, prefix_cache=False, num_slots=POOL_SLOTS))
        self.tokenizer = self.reference.tokenizer
        self.gen_tokens = gen_tokens
        self.base = base or ReuseConfig()
        self._exact_cache: dict[tuple[int, ...], GenerationResult] = {}

    def case_engine(self) -> Engine:
        """A fresh Engine (own pool, tree, sessions) around the reference's Decoder, SCR on."""
        ref = self.reference
        config = EngineConfig(num_slots=CASE_POOL_SLOTS, reuse=self.base.replace(enabled=True))
        return Engine(ref.runner.model, ref.model_config, ref.tokenizer, config, name=ref.name)

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def exact(self, prompt_ids: list[int]) -> GenerationResult:
        """Full-recompute turn 2 (no prefix cache), memoised by prompt."""
        key = tuple(prompt_ids)
        if key not in self._exact_cache:
            llm = LLM(engine=self.reference)
            self._exact_cache[key] = llm.generate([prompt_ids], self._params(self.gen_tokens),
                                                  keep_last_logits=LOGIT_POSITIONS)[0]
        return self._exact_cache[key]

    def run_turns(self, llm: LLM, setting: Setting, case: EditCase) -> CaseResult:
        """Turn 1 then turn 2 of `case` under `setting` in one session; compared with the exact turn 2."""
        scr = setting.request_scr()
        session_id = f"{case.name}/{setting.label}"
        turn1_ids = self.tokenizer.apply_chat_template(list(case.turn1), add_generation_prompt=True)
        first = llm.generate([turn1_ids], self._params(TURN1_REPLY_TOKENS), session_id=session_id, scr=scr)[0]
        turn2_ids = self.tokenizer.apply_chat_template(fill_reply(case.turn2, first.text), add_generation_prompt=True)
        second = llm.generate([turn2_ids], self._params(self.gen_tokens), session_id=session_id, scr=scr,
                              keep_last_logits=LOGIT_POSITIONS)[0]
        llm.engine.flush_cache()
        return compare(setting, case.name, self.exact(turn2_ids), second)

    def run_case(self, case: EditCase, settings: Sequence[Setting]) -> list[CaseResult]:
        """Every setting on `case`, on one fresh engine (see the class docstring)."""
        engine = self.case_engine()
        llm = LLM(engine=engine)
        turn1_ids = self.tokenizer.apply_chat_template(list(case.turn1), add_generation_prompt=True)
        llm.generate([turn1_ids], self._params(1))  # prefill turn 1's prompt once
        radix = engine.cache.radix
        turn1 = radix.match_prefix(turn1_ids, None)
        radix.lock(turn1.node)
        try:
            return [self.run_turns(llm, setting, case) for setting in settings]
        finally:
            radix.unlock(turn1.node)


def compare(setting: Setting, case_name: str, exact: GenerationResult, approx: GenerationResult) -> CaseResult:
    """The CaseResult of `approx` (SCR turn 2) against `exact` (full recompute of the same prompt)."""
    if exact.prompt_token_ids != approx.prompt_token_ids:
        raise ValueError(f"{case_name}: exact and SCR prompts differ")
    kls = list(kl_per_position(exact.prompt_logits, approx.prompt_logits).values())
    stats, prompt_tokens = approx.reuse, len(approx.prompt_token_ids)
    return CaseResult(
        setting=setting.label, case=case_name, prompt_tokens=prompt_tokens,
        prefix_tokens=stats.prefix_tokens, relocated_tokens=stats.relocated_tokens,
        prefilled_tokens=stats.prefilled_tokens, relocated_spans=stats.relocated_spans,
        fallback=stats.fallback, kl_mean=sum(kls) / len(kls), kl_p90=percentile(kls, 0.9), kl_max=max(kls),
        top1_agreement=top1_agreement(exact.prompt_logits, approx.prompt_logits),
        greedy_prefix_frac=greedy_prefix_fraction(exact.token_ids, approx.token_ids),
        greedy_exact=exact.token_ids == approx.token_ids,
    )


# ----- summaries and reports ----------------------------------------------------------------
def summarize(results: Sequence[CaseResult]) -> dict:
    """Aggregate one setting's cases: mean of per-case KL means (equal to the pooled mean, since every
    case has LOGIT_POSITIONS positions), p90 of per-case p90s, mean top-1, greedy, and token sums."""
    n = len(results)
    return {
        "setting": results[0].setting, "cases": n,
        "kl_mean": sum(r.kl_mean for r in results) / n,
        "kl_p90": percentile([r.kl_p90 for r in results], 0.9),
        "kl_max": max(r.kl_max for r in results),
        "top1_agreement": sum(r.top1_agreement for r in results) / n,
        "greedy_prefix_frac": sum(r.greedy_prefix_frac for r in results) / n,
        "greedy_exact": sum(r.greedy_exact for r in results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "relocated_tokens": sum(r.relocated_tokens for r in results),
        "prefilled_tokens": sum(r.prefilled_tokens for r in results),
    }


def markdown_table(summaries: Sequence[dict]) -> str:
    """One row per setting."""
    lines = ["| setting | mean KL (nats) | p90 KL | max KL | top-1 | greedy prefix | greedy exact | "
             "relocated | prefilled | prompt |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['setting']} | {s['kl_mean']:.5f} | {s['kl_p90']:.5f} | {s['kl_max']:.4f} | "
                     f"{s['top1_agreement']:.3f} | {s['greedy_prefix_frac']:.3f} | {s['greedy_exact']}/{s['cases']} | "
                     f"{s['relocated_tokens']} | {s['prefilled_tokens']} | {s['prompt_tokens']} |")
    return "\n".join(lines)


def case_table(results: Sequence[CaseResult]) -> str:
    """One row per (setting, case)."""
    lines = ["| setting | case | prompt | prefix | relocated (spans) | prefilled | mean KL | p90 KL | top-1 | "
             "greedy prefix |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.setting} | {r.case} | {r.prompt_tokens} | {r.prefix_tokens} | "
                     f"{r.relocated_tokens} ({r.relocated_spans}) | {r.prefilled_tokens} | {r.kl_mean:.5f} | "
                     f"{r.kl_p90:.5f} | {r.top1_agreement:.3f} | {r.greedy_prefix_frac:.3f} |")
    return "\n".join(lines)


def write_plots(summaries: Sequence[dict], settings: Sequence[Setting], out_dir: Path) -> list[Path]:
    """KL vs K, relocated tokens vs K, KL vs tail (PNG, matplotlib Agg). Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label = {s["setting"]: s for s in summaries}
    k_rows = [(st.max_spans, by_label[st.label]) for st in settings
              if st.tail == BASE_TAIL and not st.no_rerotate]
    tail_rows = [(st.tail, by_label[st.label]) for st in settings if st.max_spans == BASE_K and not st.no_rerotate]
    plots = (("kl_vs_k.png", "K (spans relocated)", "mean KL (nats)", k_rows, "kl_mean"),
             ("relocated_vs_k.png", "K (spans relocated)", "relocated tokens (all cases)", k_rows, "relocated_tokens"),
             ("kl_vs_tail.png", f"tail (K={BASE_K})", "mean KL (nats)", tail_rows, "kl_mean"))
    paths = []
    for name, xlabel, ylabel, rows, key in plots:
        rows = sorted(rows, key=lambda row: row[0])
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([x for x, _ in rows], [s[key] for _, s in rows], marker="o")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def run_sweep(harness: Harness, settings: Sequence[Setting], cases: Sequence[EditCase],
              log=print) -> tuple[list[CaseResult], list[dict]]:
    """Every setting over every case; returns the per-case results and one summary per setting."""
    results: list[CaseResult] = []
    for case in cases:
        started = time.perf_counter()
        rows = harness.run_case(case, settings)
        results += rows
        log(f"{case.name}: " + ", ".join(f"{r.setting} KL {r.kl_mean:.4f}" for r in rows)
            + f"  ({time.perf_counter() - started:.1f} s)")
    summaries = [summarize([r for r in results if r.setting == s.label]) for s in settings]
    return results, summaries


# ----- command line -------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsplice fidelity", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path or id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--cases", default=None, help="JSONL file of cases {name, turn1, turn2} (default: built-in)")
    parser.add_argument("--out", default="fidelity_out", help="directory for results.json, results.md, PNGs")
    parser.add_argument("--k", type=_int_list, default=list(DEFAULT_KS), help="K values (0 = SCR off)")
    parser.add_argument("--tails", type=_int_list, default=list(DEFAULT_TAILS), help="tail values at K=6")
    parser.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens compared after turn 2")
    return parser


def fidelity_main(argv: Optional[Sequence[str]] = None) -> int:
    """`kvsplice fidelity`: run the sweep, print the table, write results.json / results.md / PNGs to
    --out. Returns 0, or 2 for a bad cases file or bad arguments (message on stderr)."""
    args = build_parser().parse_args(argv)
    if args.gen_tokens < 1 or 0 in args.tails:
        print("error: --gen-tokens and every tail must be >= 1", file=sys.stderr)
        return 2
    try:
        cases = load_cases(args.cases) if args.cases else builtin_cases()
    except (CasesFileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = default_settings(args.k, args.tails)
    harness = Harness(args.model, gen_tokens=args.gen_tokens)
    results, summaries = run_sweep(harness, settings, cases)
    table = markdown_table(summaries)
    print(table)
    (out_dir / "results.md").write_text(table + "\n\n" + case_table(results) + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {"model": harness.reference.name, "logit_positions": LOGIT_POSITIONS, "gen_tokens": args.gen_tokens,
         "summaries": summaries, "cases": [asdict(r) for r in results]}, indent=1))
    for path in write_plots(summaries, settings, out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(fidelity_main())
