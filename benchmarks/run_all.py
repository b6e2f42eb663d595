"""Regenerate docs/BENCHMARKS.md: run every benchmark, keep its printed figures, assemble the page.

    python benchmarks/run_all.py                    # everything (about an hour on 2 CPU cores)
    python benchmarks/run_all.py --only engine_speed,match_cost
    python benchmarks/run_all.py --assemble-only    # rebuild the page from the stored outputs

Each benchmark's stdout is stored whole in docs/benchmarks/<name>.txt; the page is rebuilt from all
stored outputs, so `--only` refreshes some sections and keeps the others as they were last measured.
The page shows each output's summary lines only (`Benchmark.keep`), with the exact command that
produced them, the setting it was measured at, its date and its CPU, and stays under PAGE_BUDGET
bytes; its headline figures are docs/benchmarks/headlines.md, which the README quotes word for word.
Assembling reads nothing but the stored files: the same files give the same page.
Superseded runs and experiments that were not kept live in docs/BENCHMARKS_HISTORY.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench.machine import cpu_line

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "docs" / "BENCHMARKS.md"
HEADLINES = OUTPUTS / "headlines.md"
PAGE_BUDGET = 40_000  # bytes: a page for users, not a log
TABLE_RULE = re.compile(r"^\|[-:| ]+\|$")

# The settings a section was measured at, as the page names them (against `kvsplice serve` with no flags).
FLOAT32 = "`--dtype float32` (in-process engine)"
HARNESS = ("`kvsplice fidelity` at float32; each row sends its own SCR settings: the default is `seams 8, "
           "openings 1`.")
SCR_30_NOV = "SCR of 30 November: no seams, no message openings"
SCR_16 = "SCR default of then: 16 seam tokens, no message openings"
# what the fidelity runs show: their front table (the per-case log lines before it stay in the stored output)
FRONT_START = r"^front over"
FRONT_COLUMNS = ("setting", "computed", "mean KL", "p90", "worst case", "answer KL")


@dataclass(frozen=True)
class Benchmark:
    """One section of the page. `area`: the part of kvsplice it measures (not printed). `setting`: what
    its figures were measured at, where that differs from the defaults. `keep`: regular expressions of
    the stored output's lines the page shows (none: every line); a kept table header brings its rule.
    `columns`: the table columns shown (none: all). `start`: the output is shown from the first line
    that matches it on."""

    name: str
    title: str
    area: str
    command: str
    shows: str
    setting: str
    keep: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    start: str | None = None


BENCHMARKS = (
    Benchmark("engine_speed", "Engine speed against transformers (same weights, same process)", "engine core",
              "python benchmarks/engine_speed.py --repeats 5 --out runs/engine_speed.json",
              "Prefill tokens/s of one 2,048-token prompt and decode tokens/s at 1 and 8 concurrent requests "
              "against transformers on the same weights. Goals: prefill >= 1.0x, 8-way decode >= 2x "
              "transformers' one-at-a-time generate().",
              f"{FLOAT32}, as transformers; measured before the fast path and "
              "`--dtype auto` existed."),
    Benchmark("serve_load", "Server under load: 32 clients x 4 turns", "server",
              "python benchmarks/serve_load.py --out runs/serve_load.json",
              "32 concurrent streaming chat clients, 4 turns each, on the default model: errors (must be 0), "
              "throughput, TTFT, share of prompt tokens from cache.",
              f"{FLOAT32}; {SCR_30_NOV}; measured before the fast path existed.",
              (r"^(requests|errors|wall_s|\w+_per_s|ttft|latency|cached)",)),
    Benchmark("soak", "Soak: hostile and ordinary traffic against one server", "reliability",
              "python benchmarks/soak.py --out runs/soak.json",
              "One `kvsplice serve` (default model, two API keys) under 900 s of mixed traffic: agent turns "
              "with edits, dropped streams, clients that give up, hostile requests. 5xx must be 0, RSS flat, "
              "no slot leaked.",
              f"`kvsplice serve` defaults (`--dtype auto`: bf16 on this CPU, `--weight-format auto`); {SCR_16}.",
              (r"^requests:", r"^5xx", r"^RSS MiB", r"^RSS growth", r"^idle", r"^verdict")),
    Benchmark("disk_tier", "Disk tier", "disk tier",
              "python benchmarks/disk_tier.py; python benchmarks/tier_restart.py; "
              "python benchmarks/hit_rate_sweep.py --tier-compare --counts 32 --num-slots 2000 --min-tokens 250 "
              "--max-tokens 500 --turns 3 --max-output-tokens 8 --dtype auto",
              "Goals: 4K load >= 20x prefill, decode p99 <= 1.2x, 90% reuse after SIGKILL, 4/32 pool <= 1.2x.",
              "`--dtype auto` (tier_restart.py: float32), load 1-2.",
              (r"^load warm", r"^decode p99", r"^(after|replies)", r"^small pool, no tier,",
               r"^small pool \+ disk tier,")),
    Benchmark("match_cost", "Session matching at scale: 1,000 sessions, 8K and 128K prompts", "session matching",
              "python benchmarks/match_cost.py",
              "Session matching without ids among 1,000 tracked sessions sharing a 2K-token system prompt: "
              "match + plan for an edited 8K and 128K-token conversation, against an 8K prefill. Goals: <= 50 "
              "ms at 128K, <= 5% of the prefill at 8K.",
              f"Matching does not depend on the recompute settings; the 8K prefill it is compared with: {FLOAT32}.",
              (r"^\d+ sessions", r"^\s+tokens", r"^\s+\d+ ", r"^index", r"^goal", r"^prefill")),
    Benchmark("scr_edit", "SCR on edited turns: computed tokens and TTFT", "SCR",
              "python benchmarks/scr_edit.py --out runs/scr_edit.json",
              "Edited multi-turn conversations on the default model: prompt tokens computed per edited turn "
              "and TTFT for SCR, prefix caching alone and the lower bound (changed + appended tokens).",
              f"{FLOAT32}; {SCR_30_NOV}.",
              (r"^\| (edit|all)",)),
    Benchmark("edit_cost", "An edited turn against the tokens it computes", "SCR",
              "python benchmarks/edit_cost.py --repeats 3",
              "Built-in edit cases (per case, with relocation and forward: docs/benchmarks/edit_cost.txt).",
              "Defaults, in-process, 1 thread, CPU seconds.",
              (r"^ratio",)),
    Benchmark("fidelity", "SCR fidelity against exact recompute", "SCR / report",
              "kvsplice fidelity --k 0,1,2,4,6,8 --tails 4,8,16,32 --seams 0 --front-tails 16 --no-anchor "
              "--out runs/fidelity",
              "Built-in edit cases (1.5K-4K-token agent chats, default model): KL(exact || SCR) over the last "
              "32 prompt positions, top-1 and greedy agreement, over K and tail, and the NO_REROTATE control. "
              "Targets at K=6, tail=16: mean KL <= 0.005 nats, top-1 >= 99%, NO_REROTATE >= 100x worse.",
              "`kvsplice fidelity` (the engine at float32); SCR without selective recompute (`--seams 0`, no message "
              "openings), to isolate K and the tail. The default's own row is in the next section.",
              (r"^\| setting \| mean KL", r"^\| (scr off|K=[1246] tail=16|K=6 tail=(4|32)|NO_REROTATE)"),
              ("setting", "mean KL (nats)", "max KL", "top-1", "relocated", "prefilled")),
    Benchmark("fidelity_front", "Selective recompute: the fidelity front", "fidelity guard",
              "kvsplice fidelity --seams 8,16,32 --openings 1 "
              "--front-tails 16 --gen-tokens 4 --out runs/fidelity_front",
              "The built-in edit cases: KL(exact || SCR) against the share of the prompt computed, for seam "
              "lengths with and without the message openings (K=6, tail=16), and fp8 K/V anchors (exact K/V "
              "stored as float8 e4m3). Targets at the default: mean KL <= 0.0015 nats within 8% computed, worst "
              "case <= 0.03.",
              f"{HARNESS} The run also measured two recompute-share policies, since removed; their rows are in "
              "the history.",
              (r"^front over", r"^\| setting \| computed", r"^\| (fp8 K/V per tensor|K=6 tail=16 \||seams (8|16)[ ,])",
               r"^chosen"), FRONT_COLUMNS, FRONT_START),
    Benchmark("fidelity_fresh", "Selective recompute on fresh workload cases", "fidelity guard",
              "kvsplice fidelity --workload-seed 11 --relocating --seams 8,16 --openings 1,2 "
              "--front-tails 16 --gen-tokens 4 --out runs/fidelity_fresh",
              "Workload-generator cases of seed 11 (with the built-in cases, the set the default was chosen "
              "on): the 17 of 28 whose edit leaves content to relocate, with a question about the removed "
              "result after each deletion or replacement. Same targets.",
              HARNESS,
              (r"^front over", r"^\| setting \| computed", r"^\| (fp8 K/V per tensor|K=6 tail=16 \||seams (8|16)(, openings 1)? \|)",
               r"^chosen"), FRONT_COLUMNS, FRONT_START),
    Benchmark("fidelity_seed37", "Selective recompute on a third workload seed, measured after the default was set",
              "fidelity guard",
              "kvsplice fidelity --workload-seed 37 --relocating --seams 8 --openings 1 "
              "--front-tails 16 --gen-tokens 4 --out runs/fidelity_seed37",
              "Seed 37, drawn only after the default was chosen (20 of 23 cases): the default, its two parts "
              "alone and the fp8 anchors. Same targets.",
              HARNESS,
              (r"^front over", r"^\| setting \| computed", r"^\| (fp8 K/V per tensor|K=6|seams)"),
              FRONT_COLUMNS, FRONT_START),
    Benchmark("fidelity_facts", "Fact tracking: current, stale and deleted facts", "fidelity guard",
              "kvsplice fidelity --task facts --out runs/fidelity_facts",
              "Agent transcripts with one passphrase in a tool result or the notes, then updated, deleted or "
              "kept, then asked for. Targets: stale answers no more often than exact recompute; the "
              "deleted-fact questions' answer-position KL halved.",
              "`kvsplice fidelity --task facts` (the engine at float32); the default is the row `default (seams 8, "
              "openings 1, heads 0)`.",
              (r"^\d+ questions", r"^\| setting \| kind", r"^\| [^|]+ \| all \|"),
              ("setting", "follows current", "follows stale/deleted", "answer KL", "mean KL", "computed")),
    Benchmark("scr_replay", "Agent-trace replay, SCR on vs off", "report",
              "python benchmarks/scr_replay.py --out runs/scr_replay",
              "One synthetic context-editing agent trace replayed against SCR on and SCR off (`kvsplice report "
              "RUN_ON --vs RUN_OFF`): tokens by compute type, prefilled tokens, prefill FLOPs, TTFT.",
              f"{FLOAT32}; {SCR_30_NOV}.", (r"^trace", r"^\|", r"^prefill FLOPs"),
              ("turns", "requests", "prompt tokens", "relocated (SCR on)", "prefilled on", "prefilled off",
               "prefilled drop")),
    Benchmark("scr_replay_early", "Finding conversations without session ids: edits before token 1024",
              "session matching",
              "python benchmarks/scr_replay.py --edits early --runs ids,auto --conversations 10 --max-turns 8 "
              "--out runs/scr_replay_early",
              "An agent trace whose every turn past 1,024 tokens edits its start, replayed with session ids "
              "and without: edited turns matched (goal 100%) and prefilled tokens of both (goal: equal).",
              f"{FLOAT32}; SCR of 1 December, before the message openings (matching does not depend on them).",
              (r"^\|", r"^Edited")),
    Benchmark("hit_rate_sweep", "The hit rate is the workload", "report",
              "python benchmarks/hit_rate_sweep.py --out runs/sweep",
              "Concurrent agent conversations against one fixed KV pool: prefix hit rate, relocated share and "
              "TTFT as conversations grow and eviction starts.",
              f"{FLOAT32}; {SCR_30_NOV}."),
    Benchmark("router_policies", "Routing policy and reuse: 3 replicas behind sglang-router", "scale-out",
              "python benchmarks/router_policies.py --out runs/router_policies.json",
              "One edited multi-session workload (9 conversations) through sglang-router 0.3.2 with each "
              "policy over 3 replicas: reuse, prefilled tokens and TTFT per policy.",
              f"The tiny random test model (tests/tiny_model.py), float32; {SCR_30_NOV}.",
              (r"^\|",),
              ("policy", "requests (failed)", "prefix share", "relocated share", "prefilled tokens",
               "TTFT p50 / p90 ms", "replicas per conversation")),
    Benchmark("hybrid_fidelity", "SCR on a trained hybrid: state modes against exact recompute", "hybrid",
              "python benchmarks/hybrid_fidelity.py --out runs/hybrid_fidelity.json",
              "The built-in edit cases on the trained hybrid: the fork / checkpoint / none state modes against "
              "exact recompute.",
              "models/hybrid-mini at float32; hybrids run SCR without selective recompute (it needs every layer to "
              "be attention); state checkpoints every 256 tokens, the policy of 30 November.", (),
              ("setting", "mean KL (nats)", "max KL", "top-1", "greedy exact", "relocated", "prefilled")),
    Benchmark("hybrid_checkpoints", "Hybrid state checkpoints at message boundaries: prefill per edited turn",
              "hybrid",
              "python benchmarks/hybrid_checkpoints.py --out runs/hybrid_checkpoints.json",
              "Context-editing agent conversations on the trained hybrid with each state checkpoint policy and "
              "on the dense model: prompt tokens prefilled per edited turn. Goal: with message checkpoints no "
              "more than the dense model plus the checkpoint granularity.",
              "Token counts (greedy, one thread); SCR without selective recompute on both models (hybrids do "
              "not run it), so they differ by the state gap alone.",
              (r"^\d+ conversations", r"^\| (model|dense|hybrid) "),
              ("model", "mode", "checkpoint policy", "prefilled / edited turn", "extra vs dense", "states kept (max)")),
    Benchmark("gemma3_scr", "Gemma 3 270M: SCR on 8K-, 16K- and 32K-token edited chats, sliding-window layers",
              "sliding window",
              "python benchmarks/gemma3.py --skip-exact --skip-speed --memory-lengths 32768 --window-check 0 "
              "--scr-lengths 8192,16384,32768 --threads 1",
              "Agent chats of 8K, 16K and 32K tokens, each edited once (a tool result deleted or replaced by a "
              "note, a note inserted, reasoning stripped): KL over the last 32 positions and at the last one against exact "
              "recompute, SCR's default against the exact K/V in fp8; the share computed; the K/V memory of one "
              "32K-token request.",
              "`--dtype auto` (bf16), the GGUF's blocks, Gemma's turns "
              "(benchmarks/templates/gemma3_turns.jinja); a pool of 4x turn 1 + 4,096 slots.",
              (r"^\| tokens \| all-full", r"^\| 32768 \|", r"^\| tokens \| setting",
               r"^\| \d+ \| (default|fp8 K/V per tensor)")),
    Benchmark("weight_formats", "Weight formats: fidelity against the fp32 model", "fast decode",
              "python benchmarks/weight_formats.py",
              "Each --dtype / --weight-format on the built-in edit cases, whole prompt computed: KL(fp32 dense "
              "|| format) over the last 32 prompt positions, top-1 and greedy agreement.",
              "Each format as its row names it (`bfloat16 auto` is what `--dtype auto --weight-format auto` runs "
              "on a CPU with bf16 matmul), against float32 dense; no SCR.",
              (r"^\d+ edit cases", r"^dtype", r"^bfloat16")),
    Benchmark("vs_llamacpp", "Against llama.cpp's llama-server on the same GGUF", "fast decode",
              "python benchmarks/vs_llamacpp.py --out runs/vs_llamacpp.json",
              "Both servers on the default model's Q4_1 GGUF, one busy at a time, the same token ids: cold "
              "prefill, decode for 1 and 8 streams, inter-token latency while 4 others prefill 2K prompts, "
              "edited-turn TTFT (SCR against `--cache-reuse 16`), whole agent turns; goals in the notes.",
              "`kvsplice serve` with no flags (`--dtype auto`: bf16 here, `--weight-format auto`: int4 "
              "projections, `--compile-decode auto`: compiled where its trial measures it faster).",
              (r"^measure ", r"^(cold|decode|ITL|TTFT|edited|agent)[ ,]")),
    Benchmark("gemma3_vs_llamacpp", "Gemma 3 270M against llama-server: 32K-token prompts and edits",
              "sliding window",
              "python benchmarks/gemma3_vs_llamacpp.py --out runs/gemma3_vs_llamacpp.json",
              "Both servers on Gemma 3 270M's Q4_K_M GGUF, one busy at a time, the same token ids: cold "
              "prefill at 2K, 8K and 32K tokens, decode for 1 and 8 streams, and the edited turn of a 32K-token "
              "agent chat (a tool result deleted; reasoning stripped) after its turn 1, with what each server "
              "reused.",
              "`kvsplice serve --model <the GGUF>`, no other flags (`--dtype auto`: bf16 here, `--weight-format "
              "auto`: the GGUF's own blocks); llama-server `-np 8 -c 8x33280 --cache-reuse 16`.",
              (r"^\| measure", r"^\| (cold|decode|edited)", r"^  (delete|strip)")),
    Benchmark("startup", "Start-up: /health and the compiled decode step", "fast decode",
              "python benchmarks/startup.py --timeout-s 600",
              "A fresh `kvsplice serve`, empty compile cache then warm: time to /health and to the compiled "
              "step.",
              "`kvsplice serve`, no flags.",
              (r"^load average at start", r"cache: (/health|compiled|requests d)")),
    Benchmark("decode_threads", "Decode threads in the server", "fast decode",
              "python benchmarks/decode_threads.py",
              "`kvsplice serve` with each --decode-threads value, alternated twice: median gap between "
              "streamed tokens of one request, 8-stream tokens/s.",
              "`kvsplice serve` defaults (bf16 here, `--weight-format auto`) with each `--decode-threads` value; "
              "decode only, no SCR.",
              (r"^load average", r"^--decode-threads", r"^\s+\d+\s")),
    Benchmark("structured_outputs", "Structured outputs: the grammar mask's cost per decode step", "agent API",
              "python benchmarks/structured_outputs.py --batch 1 8 --decode-tokens 48 --requests 50 --repeats 2 "
              "--out runs/structured_outputs.json",
              "Grammar-constrained decoding (xgrammar): the mask's time per step against the sampler's, whole "
              "decodes with and without a json_schema, and 50 strict json_schema replies validated.",
              f"{FLOAT32}.", (r"^(decode|mask|validity)",)),
    Benchmark("agent_loop", "An agent loop through the openai client and LangChain", "agent API",
              "python examples/agent_loop.py",
              "Two tool-calling turns and a final answer after the agent drops its first tool result, through "
              "the openai client (LangChain's ChatOpenAI gives the same accounting): where each turn's K/V "
              "came from.",
              f"{FLOAT32}; {SCR_16}.",
              (r"^openai", r"^OK")),
    Benchmark("agent_harnesses", "Agent CLIs on kvsplice: Codex CLI, Claude Code, opencode", "agent API",
              "python benchmarks/agent_harnesses.py --turns 3 --task chat --reply-tokens 512 --out runs/agent_harnesses",
              "Each CLI through 3 turns (later ones resume the session; short questions the 135M model answers "
              "and ends) on SmolLM2-135M-Instruct: per CLI, its 4xx, 5xx and stream errors; per turn, its exit, "
              "requests and where their prompt tokens came from.",
              "defaults plus YaRN x2 (`--hf-overrides`, 16K), Claude Code with its tools Bash, Read, Edit and "
              "Write (`--tools`), replies at most 512 tokens; each CLI run alone.",
              (r"^\| harness \| turn \| CLI exit", r"^\| \w+ \| \d+ \| exit ",
               r"^\| harness \| turns ok", r"^\| \w+ \| \d+/\d+ \|")),
)


INTRO = """\
# kvsplice benchmarks

What kvsplice was measured doing, with the command behind every figure. **The defaults** are those
of `kvsplice serve` with no flags: SCR with at most 6 relocated spans (K=6), a recomputed tail of 16 tokens per span, selective recompute of the first 8 tokens of each relocated span
(`--scr-seam-tokens 8`) and of every message opening inside an edited span (role, line break, first
content token: `--scr-message-start-tokens 1`); `--dtype auto` (bf16 where the CPU has avx512_bf16
/ amx_bf16), `--weight-format auto` (with bf16, the GGUF's 4-bit groups), `--compile-decode auto` (the compiled
step where a trial at start-up finds it faster), `--fused-relocation auto` (a compiled kernel
turns relocated bf16 keys).

Each section gives its setting, date and CPU. A setting other than the defaults is named:
`--dtype float32` where a script builds the engine in its own process (float32 is the default
there), `--compile-decode`, or the SCR default of the day it ran. Ratios are against a baseline in
the same run. TTFT is noisiest.

The page shows summary lines; each whole output is in `docs/benchmarks/<name>.txt`.
Rebuild it with `python benchmarks/run_all.py` (about an hour), `--only NAME,...` or
`--assemble-only` (stored outputs only). Superseded runs and experiments not kept:
[BENCHMARKS_HISTORY.md](BENCHMARKS_HISTORY.md).
"""


def machine_line() -> str:
    import torch
    return (f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"Python {platform.python_version()}")


def run(bench: Benchmark) -> str:
    """Run one benchmark from the repository root; return its stdout (with the exit status noted)."""
    done = subprocess.run(bench.command, shell=True, cwd=ROOT, capture_output=True, text=True)
    text = done.stdout.strip()
    if done.returncode != 0:
        text += f"\n\n[exit status {done.returncode}]\n{done.stderr.strip()[-2000:]}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"measured {stamp} on {machine_line()}\n\n{text}\n"


def measured_on(first_line: str) -> str:
    """'DATE on CPU' from a stored output's first line ('measured DATE on CPU; torch ...')."""
    stamp, _, machine = first_line.removeprefix("measured ").partition(" on ")
    cpu = re.split(r"[;,] torch ", machine)[0]
    cpu, _, flags = cpu.partition(", flags: ")
    if flags:
        cpu += " (bf16 matmul)" if re.search(r"avx512_bf16|amx_bf16", flags) else " (no bf16 matmul: auto is float32)"
    if cpu.startswith("x86_64, "):
        cpu += " (model not recorded)"
    return f"{stamp} on {cpu}"


def excerpt(lines: list[str], keep: tuple[str, ...], columns: tuple[str, ...]) -> list[str]:
    """The lines of `lines` that match one of `keep` (all when `keep` is empty), each kept table header
    with its rule line, and of every table only the `columns` named (all when none is named); the
    benchmarks' notes on files they wrote are left out."""
    shown: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("wrote ") or (keep and not any(re.search(p, line) for p in keep)):
            continue
        shown.append(line)
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if keep and line.startswith("|") and TABLE_RULE.match(following) and not TABLE_RULE.match(line):
            shown.append(following)
    while shown and not shown[0].strip():
        shown.pop(0)
    return select_columns(shown, columns) if columns else shown


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def select_columns(lines: list[str], columns: tuple[str, ...]) -> list[str]:
    """`lines` with every markdown table cut to the columns whose header is in `columns`."""
    out: list[str] = []
    chosen: list[int] = []
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            chosen = []
            out.append(line)
            continue
        row = cells(line)
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if TABLE_RULE.match(following) and not TABLE_RULE.match(line):
            chosen = sorted({row.index(name) for name in columns if name in row})
        picked = [row[j] for j in chosen if j < len(row)] if chosen else row
        out.append("|" + "|".join("---" if TABLE_RULE.match(line) else f" {c} " for c in picked) + "|")
    return out


def section(bench: Benchmark) -> list[str]:
    """One section of the page: title, what it measures, setting, date and CPU, command, output, notes."""
    parts = [f"## {bench.title}", "", bench.shows, ""]
    stored = OUTPUTS / f"{bench.name}.txt"
    if not stored.exists():
        return parts + [f"Setting: {bench.setting}", "", "```bash", bench.command, "```", "", "Not measured yet.", ""]
    first, *rest = stored.read_text().rstrip().splitlines()
    if bench.start is not None:
        rest = rest[next((i for i, line in enumerate(rest) if re.search(bench.start, line)), 0):]
    parts += [f"Setting: {bench.setting} Measured {measured_on(first)}.", "",
              "```bash", bench.command, "```", "", "```", *excerpt(rest, bench.keep, bench.columns), "```"]
    notes = OUTPUTS / f"{bench.name}.notes.md"
    if notes.exists():
        parts += ["", notes.read_text().rstrip()]
    return parts + [""]


def assemble() -> str:
    """The whole page from the stored outputs, notes and headlines (nothing else is read)."""
    parts = [INTRO, "## Headline figures", "", HEADLINES.read_text().rstrip(), ""]
    for bench in BENCHMARKS:
        parts += section(bench)
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated benchmark names")
    parser.add_argument("--assemble-only", action="store_true",
                        help="run no benchmark: rebuild the page from the stored outputs")
    args = parser.parse_args()
    names = {b.name for b in BENCHMARKS}
    chosen = names if args.only is None else set(args.only.split(","))
    if chosen - names:
        print(f"unknown benchmark(s): {sorted(chosen - names)}; known: {sorted(names)}", file=sys.stderr)
        return 2
    OUTPUTS.mkdir(parents=True, exist_ok=True)
    if not args.assemble_only:
        for bench in BENCHMARKS:
            if bench.name in chosen:
                print(f"running {bench.name}: {bench.command}", flush=True)
                (OUTPUTS / f"{bench.name}.txt").write_text(run(bench))
    page = assemble()
    PAGE.write_text(page)
    size = len(page.encode())
    print(f"wrote {PAGE} ({size:,} bytes)")
    if size > PAGE_BUDGET:
        print(f"the page is over its budget of {PAGE_BUDGET:,} bytes: shorten the notes or the kept lines",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
