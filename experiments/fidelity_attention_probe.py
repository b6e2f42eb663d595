"""Attention-guided selective recompute, probed with a pure-torch SCR emulator (not an engine policy).

For each deleted-fact question of the fact task: the engine's plan (diff, keeps, seams, message
openings), relocated K/V re-rotated as the engine does, a dense-attention forward of the computed
rows that records the last prompt position's attention (head mean, per layer), then the relocated
tokens it attends to most (mean over the first d layers) recomputed in every layer. Prints the
answer-position KL(exact || SCR) and the computed share (the scoring forward itself not counted).

    python experiments/fidelity_attention_probe.py --out runs/fidelity_attention_probe
"""
import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from kvsplice.bench.fact_cases import fact_cases
from kvsplice.bench.fidelity import LOGIT_POSITIONS, TURN1_REPLY_TOKENS, Harness, turn1_prompt, turn2_prompt
from kvsplice.bench.fidelity_metrics import kl_per_position
from kvsplice.engine.llm import LLM
from kvsplice.layers.rotary import apply_rope
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import common_prefix_len, diff_tokens
from kvsplice.message_offsets import MessageStarts
from kvsplice.reuse.plan import SpanPlan, make_plan
from kvsplice.reuse.recompute import in_edited_keeps, seam_offsets
from kvsplice.reuse.relocate import relocate
from kvsplice.sampling_params import SamplingParams

QUESTIONS = [f"{kind}-{number}" for kind in ("delete_result", "replace_note") for number in range(4)]
DEPTHS = (30, 16, 8, 4)
SHARES = (0.02, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class Turn2:
    """Turn 2 of one question, ready to emulate: its prompt ids, the engine's plan, the K/V as SCR
    leaves them before any row is computed (prefix copied, keeps relocated and re-rotated; zeros
    elsewhere) and the exact full-recompute logits of every position."""

    ids: list[int]
    plan: SpanPlan
    k: torch.Tensor       # [layers, positions, kv_heads, head_dim]
    v: torch.Tensor
    exact: torch.Tensor   # [positions, vocab]


class Emulator:
    """The default model's Decoder run layer by layer over a dense K/V copy: only the rows asked
    for are computed, the others read as given."""

    def __init__(self, model=None):
        self.harness = Harness(model, gen_tokens=1)
        self.model = self.harness.reference.runner.model
        self.message_starts = MessageStarts(self.harness.tokenizer)
        self.cfg = ReuseConfig(enabled=True)   # the server default, as the engine plans with it

    def forward(self, ids, rows, k=None, v=None, collect: int = 0):
        """Compute `rows` (increasing offsets of `ids`) in every layer over `k`/`v` (zeros when
        None; copied, not written). Returns the rows' logits, the K/V with the rows' entries
        written and, per layer, the head-mean attention `[collect, positions]` of the last
        `collect` rows (an empty list when 0)."""
        model, cfg = self.model, self.model.cfg
        if k is None:
            k = torch.zeros(cfg.num_layers, len(ids), cfg.num_kv_heads, cfg.head_dim)
            v = torch.zeros_like(k)
        k, v, rows = k.clone(), v.clone(), torch.tensor(rows)
        x = model.model.embed_tokens(torch.tensor(ids)[rows])
        cos, sin = model.rotary.cos_sin(rows)
        group = cfg.num_heads // cfg.num_kv_heads
        seen = int(rows.max()) + 1
        causal = torch.arange(seen)[None, :] <= rows[:, None]   # [rows, seen]
        attention = []
        for number, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            hidden = layer.input_layernorm(x)
            q = apply_rope(attn.q_proj(hidden).view(len(rows), attn.num_heads, attn.head_dim), cos, sin)
            k[number, rows], v[number, rows] = attn.project_kv(hidden, cos, sin)
            keys = k[number, :seen].repeat_interleave(group, dim=1).float()    # [seen, heads, dim]
            values = v[number, :seen].repeat_interleave(group, dim=1).float()
            scores = torch.einsum("nhd,thd->hnt", q.float(), keys) * attn.scale
            weights = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), -1)
            if collect:
                attention.append(weights[:, -collect:].mean(0))
            x = x + attn.o_proj(torch.einsum("hnt,thd->nhd", weights, values).reshape(len(rows), -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.model.norm(x)).float(), k, v, attention

    def turn2(self, case) -> Turn2:
        """Turn 1 with the model's greedy reply, then turn 2 planned and relocated as the engine
        does; the exact turn 2 computed in full."""
        tokenizer = self.harness.tokenizer
        turn1_ids = turn1_prompt(tokenizer, case)
        reply = LLM(engine=self.harness.reference).generate(
            [turn1_ids], SamplingParams(max_tokens=TURN1_REPLY_TOKENS, temperature=0.0, ignore_eos=True))[0]
        old = turn1_ids + list(reply.token_ids)
        ids = turn2_prompt(tokenizer, case, reply.text)
        old_kv_len = len(old) - 1
        _, old_k, old_v, _ = self.forward(old[:old_kv_len], list(range(old_kv_len)))
        exact, exact_k, exact_v, _ = self.forward(ids, list(range(len(ids))))
        runs = diff_tokens(old, ids, fastdiff_min=self.cfg.fastdiff_min, cdc_target=self.cfg.cdc_target)
        prefix = common_prefix_len(turn1_ids, ids)
        plan = make_plan(old, ids, runs, prefix_len=prefix, old_kv_len=old_kv_len, cfg=self.cfg).plan
        # old K/V in slots [0, old_kv_len), the new prompt's in [old_kv_len, old_kv_len + T): the
        # engine's relocate() copies and re-rotates between them as it does between pool slots
        pool = SimpleNamespace(k=torch.cat([old_k, torch.zeros_like(exact_k)], 1),
                               v=torch.cat([old_v, torch.zeros_like(exact_v)], 1))
        pool.k[:, old_kv_len:old_kv_len + prefix] = old_k[:, :prefix]
        pool.v[:, old_kv_len:old_kv_len + prefix] = old_v[:, :prefix]
        for keep in plan.keeps:
            relocate(pool, torch.arange(keep.src_pos, keep.src_end),
                     old_kv_len + torch.arange(keep.dst_pos, keep.dst_end), keep, self.model.rotary)
        return Turn2(ids, plan, pool.k[:, old_kv_len:], pool.v[:, old_kv_len:], exact)

    def default_recompute(self, turn: Turn2) -> list[int]:
        """What the engine's default setting recomputes (as ReuseManager._plan_recompute chooses
        them): seams and the message openings in the spans from the first edit on."""
        cfg = self.cfg
        offsets = set(seam_offsets(turn.plan, cfg.seam_tokens, cfg.removed_seam_tokens))
        openings = self.message_starts.openings(turn.ids, cfg.message_start_tokens, range(len(turn.ids)))
        return sorted(offsets | set(in_edited_keeps(turn.plan, openings)))

    @staticmethod
    def rows(turn: Turn2, recompute) -> list[int]:
        """The computed rows of the plan with `recompute` recomputed as well."""
        return [o for start, end in turn.plan.with_recomputed(recompute).computed_ranges for o in range(start, end)]

    def run(self, turn: Turn2, recompute) -> tuple[float, float, float]:
        """(answer-position KL, mean KL over the last LOGIT_POSITIONS positions, computed share) with
        the plan's computed rows plus `recompute` computed over the relocated K/V."""
        rows = self.rows(turn, recompute)
        logits, _, _, _ = self.forward(turn.ids, rows, turn.k, turn.v)
        last = range(len(turn.ids) - LOGIT_POSITIONS, len(turn.ids))
        kl = kl_per_position({o: turn.exact[o] for o in last}, dict(zip(last, logits[-LOGIT_POSITIONS:])))
        return kl[len(turn.ids) - 1], sum(kl.values()) / len(kl), len(rows) / len(turn.ids)


def probe(emulator: Emulator, case) -> dict[str, tuple[float, float, float]]:
    """Every selection on one question: none, the default, and the default plus the top SHARES of
    the relocated tokens by the answer's attention averaged over the first DEPTHS layers."""
    turn = emulator.turn2(case)
    default = emulator.default_recompute(turn)
    row = {"base": emulator.run(turn, []), "default": emulator.run(turn, default)}
    _, _, _, attention = emulator.forward(turn.ids, emulator.rows(turn, default), turn.k, turn.v, collect=1)
    answer_attention = torch.stack([layer[-1] for layer in attention])   # [layers, positions]
    amended = turn.plan.with_recomputed(default)
    relocated = torch.tensor([o for keep in amended.keeps for o in range(keep.dst_pos, keep.dst_end)
                              if o not in set(amended.recomputed)])
    for depth in DEPTHS:
        score = answer_attention[:depth, relocated].mean(0)
        for share in SHARES:
            top = relocated[score.topk(round(share * len(relocated))).indices].tolist()
            row[f"layers<{depth} share {share}"] = emulator.run(turn, default + top)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fidelity_attention_probe")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    emulator = Emulator(args.model)
    facts = {fact.case.name: fact for fact in fact_cases()}
    out = {}
    for name in QUESTIONS:
        started = time.time()
        out[name] = probe(emulator, facts[name].case)
        print(name, f"({time.time() - started:.0f} s)", flush=True)
    lines = ["| setting | answer KL (8 questions) | computed (scoring forward not counted) |", "|---|---|---|"]
    for key in next(iter(out.values())):
        answer = sum(r[key][0] for r in out.values()) / len(out)
        computed = sum(r[key][2] for r in out.values()) / len(out)
        lines.append(f"| {key} | {answer:.6f} | {100 * computed:.1f}% |")
    print("\n".join(lines))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "attention_probe.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
