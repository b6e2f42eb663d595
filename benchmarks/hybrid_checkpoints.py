"""Prefilled tokens per edited turn on a hybrid, by state checkpoint policy, next to a dense model.

    python benchmarks/hybrid_checkpoints.py [--hybrid models/hybrid-mini] [--dense DEFAULT]
        [--conversations 4] [--seed 0] [--min-tokens 1500] [--max-tokens 4000] [--min-turns 6]
        [--max-turns 10] [--gen 4] [--max-states 64] [--threads 1] [--out runs/hybrid_checkpoints.json]

The workload generator's context-editing agent conversations (`kvsplice.bench.workload`) are rendered
through each model's chat template (hybrid-mini and the default model share SmolLM2's tokenizer and
template, so both see the same token ids), with the message offsets the chat endpoint computes
(`kvsplice.message_offsets`), and replayed turn by turn into an Engine in this process: prefix caching
(SCR off) and SCR (session id = the conversation), on the hybrid once per checkpoint policy
(every:256, messages, messages+every:256), on the dense model once (it needs no states). Each turn
generates --gen tokens (greedy); the next turn carries the trace's own assistant message, as an agent's
client does.

Token counts only (no timing: robust on a shared machine). Per setting: prefilled tokens per edited
turn (and per unedited turn), the extra against the dense model on the same turns, the re-prefill a
hybrid pays for want of a state (radix match - the checkpoint it resumed from), and the state slots kept
(radix checkpoints + SCR sessions' own states) with their bytes on this model and on a Qwen3.5-27B-sized
one. Prints a markdown table; writes every turn's figures to --out.

Then the cost of the message offsets themselves, on the last turn of each conversation and of one long
(12K-16K-token) conversation: the chat
endpoint's path (`message_offsets`: one tokenization with character offsets plus one template render
per message) and the brute-force reference (tokenize every prefix rendering), each as a ratio to
rendering and tokenizing the prompt once (the work every chat request does anyway), median of
--repeats runs in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.bench.trace import UNEDITED_KINDS, Conversation
from kvsplice.bench.workload import generate_traces
from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.engine.llm import build_engine
from kvsplice.message_offsets import message_offsets, message_offsets_reference
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

POLICIES = ("every:256", "messages", "messages+every:256")
QWEN3_5_27B_SLOT_MIB = 146.8125   # state_slot_bytes of 48 linear layers, 16 key / 48 value heads of 128


@dataclass
class TurnRecord:
    conversation: str
    turn: int
    edit: str
    prompt_tokens: int
    prefix_tokens: int
    relocated_tokens: int
    prefilled_tokens: int
    radix_match: int | None = None
    checkpoint_depth: int | None = None
    states_kept: int = 0


@dataclass
class SettingResult:
    model: str
    mode: str            # "prefix" | "scr"
    policy: str          # a checkpoint policy, or "-" for the dense model
    turns: list[TurnRecord] = field(default_factory=list)
    bytes_per_state: int = 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hybrid", default="models/hybrid-mini")
    parser.add_argument("--dense", default=None, help="dense model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--min-turns", type=int, default=6)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("--gen", type=int, default=4, help="tokens generated per turn")
    parser.add_argument("--max-states", type=int, default=64, help="checkpoint cap (state slots)")
    parser.add_argument("--num-slots", type=int, default=16_384, help="KV pool size (tokens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (counts do not depend on it; one is fastest on a busy machine)")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats of the offsets cost")
    parser.add_argument("--out", default="runs/hybrid_checkpoints.json")
    return parser


def engine_like(base: Engine, reuse: ReuseConfig, num_slots: int) -> Engine:
    """A fresh Engine (empty caches) around `base`'s loaded model; its StatePool holds the cap's
    checkpoints plus room for the running request (so the cap, not the pool, binds)."""
    config = EngineConfig(num_slots=num_slots, reuse=reuse, max_batch_tokens=2048,
                          num_state_slots=reuse.checkpoint_max_states + 64)
    return Engine(base.runner.model, base.model_config, base.tokenizer, config, name=base.name)


def replay(engine: Engine, conversations: list[Conversation], mode: str, gen: int) -> list[TurnRecord]:
    """Every conversation's turns in order, one request at a time; a record per turn."""
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    records = []
    for conversation in conversations:
        for number, turn in enumerate(conversation.turns):
            messages = [dict(m) for m in turn.messages]
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            offsets = message_offsets(engine.tokenizer, messages, ids)
            rid = engine.add_request(ids, params, session_id=conversation.id if mode == "scr" else None,
                                     scr=None if mode == "scr" else "off", message_offsets=offsets)
            last = None
            while engine.has_work():
                last = next((o for o in engine.step() if o.rid == rid and o.finished), last)
            records.append(_record(engine, conversation.id, number, turn.edit, last))
        engine.check_integrity()
    return records


def _record(engine: Engine, conversation: str, number: int, edit: str, out) -> TurnRecord:
    stats, state = out.reuse, out.state_reuse
    kept = 0
    if engine.cache.states is not None:
        kept = engine.cache.radix.num_checkpoints() + engine.reuse.private_state_slots()
    return TurnRecord(conversation, number, edit, out.prompt_tokens, stats.prefix_tokens, stats.relocated_tokens,
                      stats.prefilled_tokens, state.radix_match if state else None,
                      state.checkpoint_depth if state else None, kept)


def run_settings(args, conversations) -> list[SettingResult]:
    results = []
    hybrid = build_engine(EngineConfig(model=args.hybrid, num_slots=1024))
    dense = build_engine(EngineConfig(model=args.dense, num_slots=1024))
    for mode in ("prefix", "scr"):
        # selective recompute (seam tokens) runs on attention-only models only: the dense model goes
        # without it too, so the two differ by the hybrid's state gap alone
        reuse = ReuseConfig(enabled=mode == "scr", seam_tokens=0)
        print(f"dense {dense.name} {mode} ...", file=sys.stderr, flush=True)
        results.append(SettingResult("dense", mode, "-", replay(engine_like(dense, reuse, args.num_slots),
                                                                 conversations, mode, args.gen)))
        for policy in POLICIES:
            print(f"hybrid {mode} {policy} ...", file=sys.stderr, flush=True)
            engine = engine_like(hybrid, reuse.replace(checkpoint_policy=policy,
                                                       checkpoint_max_states=args.max_states), args.num_slots)
            result = SettingResult("hybrid", mode, policy, replay(engine, conversations, mode, args.gen),
                                   engine.cache.states.bytes_per_slot())
            results.append(result)
    return results


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def table(results: list[SettingResult]) -> str:
    """Markdown: one row per setting; 'extra' is against the dense model in the same mode, same turns."""
    dense = {r.mode: r for r in results if r.model == "dense"}
    lines = ["| model | mode | checkpoint policy | prefilled / edited turn | extra vs dense | state gap / edited turn"
             " | prefilled / unedited turn | extra vs dense | states kept (max) | MiB here | GiB at 27B size |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base = dense[r.mode]
        if [t.prompt_tokens for t in r.turns] != [t.prompt_tokens for t in base.turns]:
            raise SystemExit("the hybrid and the dense model tokenize the conversations differently")
        edited = [i for i, t in enumerate(r.turns) if t.edit not in UNEDITED_KINDS]
        unedited = [i for i, t in enumerate(r.turns) if t.edit in UNEDITED_KINDS and t.turn > 0]
        pre = [t.prefilled_tokens for t in r.turns]
        dense_pre = [t.prefilled_tokens for t in base.turns]
        gap = _mean(r.turns[i].radix_match - r.turns[i].checkpoint_depth for i in edited) \
            if r.model == "hybrid" else 0.0
        kept = max((t.states_kept for t in r.turns), default=0)
        lines.append(
            f"| {r.model} | {r.mode} | {r.policy} | {_mean(pre[i] for i in edited):.1f} | "
            f"{_mean(pre[i] - dense_pre[i] for i in edited):+.1f} | {gap:.1f} | "
            f"{_mean(pre[i] for i in unedited):.1f} | {_mean(pre[i] - dense_pre[i] for i in unedited):+.1f} | "
            f"{kept} | {kept * r.bytes_per_state / 2**20:.1f} | {kept * QWEN3_5_27B_SLOT_MIB / 1024:.1f} |")
    return "\n".join(lines)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def offsets_cost(tokenizer, conversations: list[Conversation], repeats: int) -> str:
    """Markdown: per conversation's last turn, the prompt's own render + tokenize time and the two
    offset computations as ratios to it (they must agree)."""
    lines = ["| messages | prompt tokens | render + tokenize ms | offsets (fast) | ratio | reference | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for conversation in conversations:
        messages = [dict(m) for m in conversation.turns[-1].messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if message_offsets(tokenizer, messages, ids) != message_offsets_reference(tokenizer, messages, ids):
            raise SystemExit("the fast and the reference message offsets disagree")
        base = _median_s(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True), repeats)
        fast = _median_s(lambda: message_offsets(tokenizer, messages, ids), repeats)
        ref = _median_s(lambda: message_offsets_reference(tokenizer, messages, ids), repeats)
        lines.append(f"| {len(messages)} | {len(ids)} | {1e3 * base:.1f} | {1e3 * fast:.1f} ms | {fast / base:.1f}x | "
                     f"{1e3 * ref:.1f} ms | {ref / base:.1f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    conversations = generate_traces(args.conversations, args.seed, min_tokens=args.min_tokens,
                                    max_tokens=args.max_tokens, min_turns=args.min_turns,
                                    max_turns=args.max_turns, max_output_tokens=max(args.gen, 8))
    turns = [t for c in conversations for t in c.turns]
    edited = sum(t.edit not in UNEDITED_KINDS for t in turns)
    results = run_settings(args, conversations)
    print(f"\n{len(conversations)} conversations, {len(turns)} turns ({edited} edited), seed {args.seed}; "
          f"{sum(t.prompt_tokens for t in results[0].turns)} prompt tokens in all; "
          f"checkpoint cap {args.max_states} states; {cpu_line()}\n")
    print(table(results))
    # plus one long conversation (12K-16K tokens, 30-40 turns) to show how the cost grows
    long_one = generate_traces(1, args.seed + 1, min_tokens=12_000, max_tokens=16_000, min_turns=30, max_turns=40)
    print("\nCost of the message offsets (last turn of each conversation, then a long one):\n")
    print(offsets_cost(build_engine(EngineConfig(model=args.hybrid, num_slots=64)).tokenizer,
                       conversations + long_one, args.repeats))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{**{k: v for k, v in vars(r).items() if k != "turns"},
                                "turns": [vars(t) for t in r.turns]} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
