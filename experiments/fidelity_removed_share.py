"""What seams that grow with the removed text would cost: plan only, no forward pass.

A span after deleted text saw that text; the more was deleted, the more of the span's K/V it
shaped, so a seam proportional to the removed token count ("alpha x removed, at most cap") is the
natural predictor to try next. This prints, for the fact task's deleted-fact questions and for
the edit cases the fidelity front is measured on (built-in and workload seeds 11, 23, 37), how
much text the edit removes and how much more of the prompt such seams would compute than the
default's fixed seams. The plan is the engine's (`diff_tokens`, `make_plan`, `seam_lengths`);
turn 1's reply is a fixed sentence instead of the model's 16 greedy tokens, so the prompts are
within a few tokens of the fidelity runs'.

    python experiments/fidelity_removed_share.py
"""
import argparse
import statistics

from kvsplice.bench.edit_cases import builtin_cases, workload_cases
from kvsplice.bench.fact_cases import fact_cases
from kvsplice.bench.fidelity import turn1_prompt, turn2_prompt
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import common_prefix_len, diff_tokens
from kvsplice.reuse.plan import make_plan
from kvsplice.reuse.recompute import seam_lengths

REPLY = "I will read the next document and then summarise what I found for the task."
SCALINGS = ((0.25, 256), (0.5, 256), (1.0, 256), (1.0, 512))


def turn2_plan(tokenizer, case, cfg: ReuseConfig):
    """The engine's SpanPlan for turn 2 of `case` against turn 1 plus REPLY (None: no plan)."""
    old = turn1_prompt(tokenizer, case) + tokenizer.encode(REPLY, add_special_tokens=False)
    new = turn2_prompt(tokenizer, case, REPLY)
    runs = diff_tokens(old, new, fastdiff_min=cfg.fastdiff_min, cdc_target=cfg.cdc_target)
    return make_plan(old, new, runs, prefix_len=common_prefix_len(old, new), old_kv_len=len(old), cfg=cfg).plan


def extra_share(plan, cfg: ReuseConfig, alpha: float, cap: int) -> float:
    """Share of the prompt that seams of max(default seam, min(cap, alpha x removed)) after removed
    text compute beyond the default's seams."""
    removed = plan.removed or (0,) * len(plan.keeps)
    default = seam_lengths(plan, cfg.seam_tokens, cfg.removed_seam_tokens)
    grown = [min(keep.length, max(seam, min(cap, int(alpha * gone)))) for keep, seam, gone
             in zip(plan.keeps, default, removed)]
    return (sum(grown) - sum(default)) / plan.prompt_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    args = parser.parse_args()
    tokenizer = build_engine(EngineConfig(model=args.model, prefix_cache=False, num_slots=64)).tokenizer
    cfg = ReuseConfig().replace(enabled=True)
    sets = {"facts: deleted-fact questions": [f.case for f in fact_cases() if f.kind in ("delete_result", "replace_note")],
            "built-in cases": builtin_cases(), **{f"workload seed {s}": workload_cases(s) for s in (11, 23, 37)}}
    print(f"default seams {cfg.seam_tokens}, {cfg.removed_seam_tokens} after removed; extra computed share of the prompt")
    print("| cases | plans | prompt tokens | removed tokens | removed share | "
          + " | ".join(f"alpha {a:g}, cap {c}" for a, c in SCALINGS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(SCALINGS))
    for name, cases in sets.items():
        plans = [p for p in (turn2_plan(tokenizer, case, cfg) for case in cases) if p is not None]
        extras = [100 * statistics.mean(extra_share(p, cfg, a, c) for p in plans) for a, c in SCALINGS]
        print(f"| {name} | {len(plans)} | {statistics.mean(p.prompt_len for p in plans):.0f} | "
              f"{statistics.mean(sum(p.removed) for p in plans):.0f} | "
              f"{100 * statistics.mean(sum(p.removed) / p.prompt_len for p in plans):.1f}% | "
              + " | ".join(f"+{e:.1f}%" for e in extras) + " |")


if __name__ == "__main__":
    main()
