"""`kvsplice fidelity`: the command around the fidelity harness (kvsplice.bench.fidelity) and the
fact-tracking task (kvsplice.bench.fact_cases): arguments, case selection, the printed report and
the files it writes (results.json, results.md, PNGs; facts.json, facts.md).

Imports run one way: this module -> fact_cases -> fidelity (the harness), never back.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional, Sequence

from kvsplice.bench.edit_cases import (LONG_CASE_EDITS, CasesFileError, EditCase, builtin_cases,
                                       leaves_content_to_relocate, load_cases, long_cases, workload_cases)
from kvsplice.bench.fact_cases import KINDS, fact_cases, fact_settings, facts_table, run_facts, select_facts
from kvsplice.bench.fidelity import (ANCHOR_LABEL, BASE_K, BASE_TAIL, DEFAULT_FRONT_TAILS, DEFAULT_KL_TARGET,
                                     DEFAULT_SEAMS, DEFAULT_WORST_TARGET, LOGIT_POSITIONS, TURN1_REPLY_TOKENS,
                                     Harness, Setting, case_table, front_settings, markdown_table, run_sweep,
                                     sweep_settings)
from kvsplice.bench.fidelity_front import choose_default, front_table, pareto, summarize
from kvsplice.bench.workload import estimate_tokens
from kvsplice.reuse.config import ReuseConfig


def write_plots(summaries: Sequence[dict], settings: Sequence[Setting], out_dir: Path,
                anchor: Optional[dict] = None) -> list[Path]:
    """PNGs (matplotlib Agg): KL vs K, relocated tokens vs K and KL vs tail when the K / tail
    sweep ran; KL vs computed share (one point per SCR setting, the fp8 anchor as a line) when
    the selective-recompute sweep ran. Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label = {s["setting"]: s for s in summaries}
    plain = [st for st in settings if not st.no_rerotate]
    k_rows = [(st.max_spans, by_label[st.label]) for st in plain if st.tail == BASE_TAIL]
    tail_rows = [(st.tail, by_label[st.label]) for st in plain if st.max_spans == BASE_K]
    plots = []
    if len({k for k, _ in k_rows}) > 2:
        plots += [("kl_vs_k.png", "K (spans relocated)", "mean KL (nats)", k_rows, "kl_mean"),
                  ("relocated_vs_k.png", "K (spans relocated)", "relocated tokens (all cases)", k_rows,
                   "relocated_tokens")]
    if len(tail_rows) > 1:
        plots.append(("kl_vs_tail.png", f"tail (K={BASE_K})", "mean KL (nats)", tail_rows, "kl_mean"))
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
    if any(st.seam_tokens or st.message_start_tokens for st in settings):
        paths.append(_plot_front(summaries, settings, anchor, out_dir / "front.png", plt))
    return paths


def _plot_front(summaries, settings, anchor, path: Path, plt) -> Path:
    by_label = {s["setting"]: s for s in summaries}
    rows = [by_label[st.label] for st in settings if st.max_spans and not st.no_rerotate]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * s["computed_share"] for s in rows], [s["kl_mean"] for s in rows], "o", label="SCR settings")
    for s in rows:
        ax.annotate(s["setting"], (100 * s["computed_share"], s["kl_mean"]), fontsize=6)
    if anchor is not None:
        ax.axhline(anchor["kl_mean"], color="gray", linestyle="--", label="fp8 K/V")
    ax.set_xlabel("prompt computed (%)")
    ax.set_ylabel("mean KL (nats)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _number_list(kind):
    def parse(text: str):
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or min(values) < 0:
            raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {text!r}")
        return values
    return parse


DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPES = ("float32", "auto")


def _dtype_list(text: str) -> list[str]:
    """The dtypes `text` names, "auto" resolved as `kvsplice serve` resolves it, each once."""
    from kvsplice.engine.llm import resolve_auto_dtype
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in DTYPES + ("auto",)]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes of {DTYPES + ('auto',)}, got {text!r}")
    resolved = [str(resolve_auto_dtype(name)).removeprefix("torch.") if name == "auto" else name for name in names]
    return list(dict.fromkeys(resolved))


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsplice fidelity", description="SCR fidelity: how far Suffix Cache Reuse moves the model's outputs "
                                              "from a full recompute")
    parser.add_argument("--model", default=None, help="model path or id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--task", choices=("edits", "facts"), default="edits",
                        help="edits: KL sweep over edit cases (default); facts: the fact-tracking task")
    parser.add_argument("--cases", default=None, help="JSONL file of cases {name, turn1, turn2} (default: built-in)")
    parser.add_argument("--workload-seed", type=int, default=None,
                        help="use fresh cases from the workload generator with this seed instead")
    parser.add_argument("--workload-conversations", type=int, default=8, help="conversations to draw cases from")
    parser.add_argument("--long-cases", type=_number_list(int), default=None,
                        help="use the built-in edits (delete, replace, insert a note, strip reasoning) on agent chats "
                             "of about these many tokens instead, comma-separated (e.g. 8192,16384,32768)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (file or text) rendering the cases, in place of the model's "
                             "own (a base model has none), as `kvsplice serve --chat-template`")
    parser.add_argument("--default-only", action="store_true",
                        help="run only the setting `kvsplice serve` uses by default (and the fp8 anchors), "
                             "no sweep")
    parser.add_argument("--case", type=_name_list, default=None, help="only these case names (comma-separated; facts task: question names, "
                             "e.g. delete_result-0)")
    parser.add_argument("--relocating", action="store_true",
                        help="only the cases whose edit leaves content after it to relocate (the others edit "
                             "the last message before the question and are served by prefix caching alone)")
    parser.add_argument("--max-cases", type=int, default=None, help="at most this many cases, spread evenly")
    parser.add_argument("--out", default="fidelity_out", help="directory for results.json, results.md, PNGs")
    parser.add_argument("--k", type=_number_list(int), default=None,
                        help="K values to sweep at tail=16 (0 = SCR off), with the NO_REROTATE control")
    parser.add_argument("--tails", type=_number_list(int), default=None, help="tail values to sweep at K=6")
    parser.add_argument("--seams", type=_number_list(int), default=list(DEFAULT_SEAMS),
                        help="seam lengths to sweep: tokens recomputed at the start of every relocated span")
    parser.add_argument("--removed-seams", type=_number_list(int), default=[],
                        help="with every seam length, also sweep these longer seams for spans that follow "
                             "removed (deleted or replaced) text")
    parser.add_argument("--openings", type=_number_list(int), default=[],
                        help="also sweep SCR without seams and every seam length with this many first content "
                             "tokens of every message recomputed (--scr-message-start-tokens)")
    parser.add_argument("--front-tails", type=_number_list(int), default=list(DEFAULT_FRONT_TAILS),
                        help="span tails of the selective-recompute sweep (K=6)")
    parser.add_argument("--fact-seams", type=_number_list(int), default=[],
                        help="facts task: also run K=6, tail=16 with these seam lengths")
    parser.add_argument("--no-anchor", action="store_true", help="skip the fp8 K/V anchors")
    parser.add_argument("--max-share", type=float, default=0.08,
                        help="most of the prompt the chosen default may compute")
    parser.add_argument("--kl-target", type=float, default=DEFAULT_KL_TARGET,
                        help="mean KL the report checks the chosen setting against (nats)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens compared after turn 2")
    parser.add_argument("--dtype", type=_dtype_list, default=",".join(DEFAULT_DTYPES),
                        help="compute dtypes, comma-separated, each a sweep of its own with SCR and the exact "
                             "reference alike in it (edits task; auto: what `kvsplice serve` picks on this CPU; "
                             "default float32,auto, compared side by side)")
    return parser


def select_cases(cases: list[EditCase], names: Optional[list[str]], max_cases: Optional[int]) -> list[EditCase]:
    """`cases` limited to `names` (ValueError naming unknown ones), then to `max_cases` spread evenly."""
    if names:
        known = {case.name for case in cases}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"unknown case(s) {unknown}; known: {sorted(known)}")
        cases = [case for case in cases if case.name in names]
    if max_cases is not None and max_cases < len(cases):
        step = len(cases) / max_cases
        cases = [cases[int(i * step)] for i in range(max_cases)]
    return cases


def _check_args(args) -> Optional[str]:
    if args.gen_tokens < 1 or 0 in (args.tails or []) or 0 in args.front_tails:
        return "--gen-tokens and every tail must be >= 1"
    if not 0 < args.max_share <= 1 or not 0 < args.kl_target < 10:
        return "--max-share must lie in (0, 1], --kl-target in (0, 10)"
    if args.max_cases is not None and args.max_cases < 1:
        return "--max-cases must be >= 1"
    if any(not 0 <= n <= 4096 for n in args.seams + args.fact_seams + args.removed_seams):
        return "every seam length must lie in [0, 4096]"
    if any(not 0 <= n <= 64 for n in args.openings):
        return "every --openings count must lie in [0, 64]"
    if args.task == "facts" and (args.long_cases or args.chat_template is not None or args.default_only):
        return "--long-cases, --chat-template and --default-only apply to the edits task only"
    if any(not 1024 <= n <= 1_048_576 for n in args.long_cases or []):
        return "every --long-cases length must lie in [1024, 1048576]"
    return None


def load_template(args) -> Optional[str]:
    """--chat-template's Jinja source (None without one); ValueError when it is neither a file nor a
    valid template."""
    if args.chat_template is None:
        return None
    from kvsplice.server.chat import load_chat_template   # (jinja2 validation, as `kvsplice serve`)
    return load_chat_template(args.chat_template)


def load_edit_cases(args) -> list[EditCase]:
    """The cases the arguments name; CasesFileError / OSError / ValueError on bad ones."""
    if args.cases:
        cases = load_cases(args.cases)
    elif args.long_cases:
        # built by `run_dtype`, sized with the model's tokenizer and template; names checked now
        names = [f"{kind}-{tokens}" for tokens in args.long_cases for kind in LONG_CASE_EDITS]
        select_cases([EditCase(name, (), ()) for name in names], args.case, None)
        return []
    elif args.workload_seed is not None:
        cases = workload_cases(args.workload_seed, conversations=args.workload_conversations)
    else:
        cases = builtin_cases()
    if args.relocating:
        cases = [case for case in cases if leaves_content_to_relocate(case)]
    return select_cases(cases, args.case, args.max_cases)


def fidelity_main(argv: Optional[Sequence[str]] = None) -> int:
    """`kvsplice fidelity`: run the sweep, print the tables and the front, write results.json /
    results.md / PNGs to --out. Returns 0, or 2 for a bad cases file or bad arguments (message on
    stderr)."""
    args = build_parser().parse_args(argv)
    problem = _check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.task == "facts":
        return facts_main(args)
    try:
        cases = load_edit_cases(args)
        args.template = load_template(args)
    except (CasesFileError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = chosen_settings(args)
    by_dtype = {}
    for dtype in args.dtype:
        # one directory per dtype when there are several
        dtype_dir = out_dir / dtype if len(args.dtype) > 1 else out_dir
        dtype_dir.mkdir(parents=True, exist_ok=True)
        if len(args.dtype) > 1:
            print(f"dtype {dtype}:")
        by_dtype[dtype] = run_dtype(args, dtype, cases, settings, dtype_dir)
    if len(args.dtype) > 1:
        print(dtype_table(by_dtype, settings))
    return 0


def sized_long_cases(harness: Harness, lengths: Sequence[int]) -> list[EditCase]:
    """`long_cases` of every length in `lengths`, sized in the harness model's tokens (its tokenizer
    and chat template), with room left in turn 2 for turn 1's reply (TURN1_REPLY_TOKENS) and the
    generated tokens; named "{kind}-{length}"."""
    def count(messages) -> int:
        return len(harness.tokenizer.apply_chat_template(messages, chat_template=harness.chat_template))
    room = TURN1_REPLY_TOKENS + harness.gen_tokens
    return [replace(case, name=f"{case.name.rsplit('-', 1)[0]}-{tokens}")
            for tokens in lengths for case in long_cases(tokens - room, count=count)]


def chosen_settings(args) -> list[Setting]:
    """The settings the arguments sweep: with --default-only the server's default alone; else the
    K / tail sweep (when --k or --tails) and the selective-recompute front."""
    if args.default_only:
        return [default_setting()]
    settings = sweep_settings(args.k or [0, BASE_K], args.tails or [BASE_TAIL]) if args.k or args.tails else []
    front = front_settings(tails=args.front_tails, seams=args.seams, removed_seams=args.removed_seams,
                           openings=args.openings)
    return settings + [st for st in front if st.label not in {s.label for s in settings}]


def default_setting() -> Setting:
    """The SCR setting of `kvsplice serve` without flags (`ReuseConfig()`'s), labelled "default"."""
    config = ReuseConfig()
    return Setting("default", config.max_spans, config.tail, seam_tokens=config.seam_tokens,
                   removed_seam_tokens=config.removed_seam_tokens, message_start_tokens=config.message_start_tokens)


def run_dtype(args, dtype: str, cases: list[EditCase], settings: list[Setting], out_dir: Path) -> list[dict]:
    """The sweep at compute dtype `dtype`: printed report, results.json / results.md / PNGs in
    `out_dir`. Returns the settings' summaries."""
    # room in the reference pool for the longest case (estimated tokens, with a margin for the tokenizer)
    longest = max(args.long_cases or [2 * estimate_tokens(case.turn2) for case in cases])
    harness = Harness(args.model, gen_tokens=args.gen_tokens, dtype=dtype, chat_template=args.template,
                      max_prompt_tokens=longest + 64)
    if args.long_cases:
        cases = select_cases(sized_long_cases(harness, args.long_cases), args.case, args.max_cases)
    started = time.perf_counter()
    results, summaries = run_sweep(harness, settings, cases, anchor=not args.no_anchor)
    anchors = [] if args.no_anchor else summaries[len(settings):]
    summaries = summaries[: len(settings)]
    print(report(summaries, anchors, settings, args, len(cases), time.perf_counter() - started))
    if args.long_cases:
        print(length_table(results, args.long_cases))
    (out_dir / "results.md").write_text(markdown_table(summaries) + "\n\n" + case_table(results) + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {"model": harness.reference.name, "dtype": dtype, "logit_positions": LOGIT_POSITIONS,
         "gen_tokens": args.gen_tokens, "summaries": summaries, "anchors": anchors,
         "cases": [asdict(r) for r in results]}, indent=1))
    for path in write_plots(summaries, settings, out_dir, anchors[0] if anchors else None):
        print(f"wrote {path}")
    return summaries


def dtype_table(by_dtype: dict[str, list[dict]], settings: Sequence[Setting]) -> str:
    """Every SCR setting's mean and answer-position KL at each dtype, and each dtype's against the
    first's (x): how much of SCR's fidelity a compute dtype keeps."""
    first, *others = by_dtype
    header = ["setting", "computed"] + [f"{kind} {dtype}" for kind in ("mean KL", "answer KL") for dtype in by_dtype]
    header += [f"x {dtype}" for dtype in others]
    lines = ["dtypes compared (x: answer KL against " + first + "):", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for index, setting in enumerate(settings):
        if not setting.max_spans or setting.no_rerotate:
            continue
        rows = {dtype: summaries[index] for dtype, summaries in by_dtype.items()}
        cells = [setting.label, f"{rows[first]['computed_share']:.1%}"]
        cells += [f"{rows[dtype][key]:.5f}" for key in ("kl_mean", "kl_answer") for dtype in rows]
        base = rows[first]["kl_answer"]
        cells += [f"{rows[dtype]['kl_answer'] / base:.2f}" if base > 0 else "-" for dtype in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(summaries: list[dict], anchors: list[dict], settings: Sequence[Setting], args,
           n_cases: int, seconds: float) -> str:
    """The printed report: the settings table, the front with the anchors, and the chosen setting
    (the front's knee within --max-share: `choose_default`) checked against the targets."""
    scr = [s for s, st in zip(summaries, settings) if st.max_spans and not st.no_rerotate]
    chosen = choose_default(scr, args.max_share)
    lines = [markdown_table(summaries), "", f"front over {n_cases} cases ({seconds:.0f} s):",
             front_table(scr, anchors), ""]
    if chosen is None:
        lines.append(f"chosen: none of the settings computes at most {args.max_share:.0%} of the prompt")
    else:
        meets = (chosen["kl_mean"] <= args.kl_target and chosen["kl_worst"] <= DEFAULT_WORST_TARGET)
        lines.append(f"chosen (the cheapest front setting within 10% of the lowest mean KL at most "
                     f"{args.max_share:.0%} computed buys): {chosen['setting']}: "
                     f"mean KL {chosen['kl_mean']:.5f}, median {chosen['kl_median']:.5f}, "
                     f"p90 {chosen['kl_case_p90']:.5f}, worst case {chosen['kl_worst']:.4f}, computed "
                     f"{chosen['computed_share']:.1%}; {'meets' if meets else 'misses'} mean <= {args.kl_target:g} "
                     f"and worst <= {DEFAULT_WORST_TARGET:g}")
    lines.append(f"front: {', '.join(s['setting'] for s in scr if s['setting'] in pareto(scr))}")
    return "\n".join(lines)


def length_table(results: Sequence, lengths: Sequence[int]) -> str:
    """Per chat length of --long-cases, each setting's summary over that length's cases: mean KL over
    the last positions and at the last (answer) position, the worst case, the share of the prompt
    computed, and both KLs against the first fp8 anchor's (x: below 1 is more exact than fp8 K/V)."""
    lines = ["by length:", "| tokens | setting | cases | mean KL | last-position KL | worst case | computed "
             "| x fp8 per tensor (mean, last) |", "|---|---|---|---|---|---|---|---|"]
    for tokens in lengths:
        rows = [r for r in results if r.case.endswith(f"-{tokens}")]
        by_setting = {label: summarize([r for r in rows if r.setting == label])
                      for label in dict.fromkeys(r.setting for r in rows)}
        anchor = by_setting.get(ANCHOR_LABEL)
        for label, summary in by_setting.items():
            ratio = "-"
            if anchor and anchor["kl_mean"] and anchor["kl_answer"]:
                ratio = f"{summary['kl_mean'] / anchor['kl_mean']:.2f}, {summary['kl_answer'] / anchor['kl_answer']:.2f}"
            lines.append(f"| {tokens} | {label} | {summary['cases']} | {summary['kl_mean']:.5f} | "
                         f"{summary['kl_answer']:.5f} | {summary['kl_worst']:.4f} | {summary['computed_share']:.1%} "
                         f"| {ratio} |")
    return "\n".join(lines)


def facts_main(args) -> int:
    """`kvsplice fidelity --task facts`: SCR without selective recompute (K=6, tail=16), with the
    server default's and with every `--fact-seams` length, against exact recompute, on `--max-cases`
    questions (default: 4 of each kind), or the `--case` ones, and the fp8 K/V anchors unless
    `--no-anchor`. Writes facts.json and facts.md to --out; returns 0, or 2 for an unknown
    question name (message on stderr)."""
    per_kind = max(1, -(-args.max_cases // len(KINDS))) if args.max_cases else 4
    try:
        facts = select_facts(fact_cases(per_kind=per_kind)[: args.max_cases or None], args.case)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = fact_settings(ReuseConfig(), args.fact_seams, args.removed_seams)
    harness = Harness(args.model, gen_tokens=1)
    started = time.perf_counter()
    results = run_facts(harness, settings, facts, anchor=not args.no_anchor)
    table = facts_table(results)
    print(f"{len(facts)} questions ({time.perf_counter() - started:.0f} s):\n{table}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "facts.md").write_text(table + "\n")
    (out_dir / "facts.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(fidelity_main())
