"""Attention-guided selective recompute, probed with a pure-torch SCR emulator (not an engine policy).

For each deleted-fact question of the fact task: the engine's plan (diff, keeps, seams, message
openings), relocated K/V re-rotated as the engine does, a dense-attention forward of the computed
rows that records the last prompt position's attention (head mean, per layer), then the relocated
tokens it attends to most (mean over the first d layers) recomputed in every layer. Prints the
answer-position KL(exact || SCR) and the computed share (the scoring forward itself not counted).

    python benchmarks/fidelity_attention_probe.py --out runs/fidelity_attention_probe
"""
from types import SimpleNamespace

import torch

from kvsplice.bench.fidelity import LOGIT_POSITIONS, TURN1_REPLY_TOKENS, Harness
from kvsplice.bench.fidelity_metrics import kl_per_position
from kvsplice.bench.edit_cases import fill_reply
from kvsplice.engine.llm import LLM
from kvsplice.sampling_params import SamplingParams
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import diff_tokens, common_prefix_len
from kvsplice.reuse.plan import make_plan
from kvsplice.reuse.recompute import seam_offsets, in_edited_keeps
from kvsplice.reuse.message_starts import MessageStarts
from kvsplice.layers.rotary import apply_rope
from kvsplice.reuse.relocate import relocate

torch.set_grad_enabled(False)

class Emu:
    """The default model's Decoder run layer by layer over a dense K/V copy `[layers, positions,
    kv_heads, head_dim]`: only the rows asked for are computed, the others read as given."""

    def __init__(self, model=None):
        self.h = Harness(model, gen_tokens=1)
        self.m = self.h.reference.runner.model
        self.tok = self.h.tokenizer
        self.ms = MessageStarts(self.tok)
        self.collect = 0
        self.cfg = self.m.cfg

    def reply(self, ids):
        out = LLM(engine=self.h.reference).generate([ids], SamplingParams(max_tokens=TURN1_REPLY_TOKENS, temperature=0.0, ignore_eos=True))[0]
        return out

    def forward(self, ids, rows, K=None, V=None):
        """Compute `rows` (increasing offsets of `ids`) in every layer over K/V (zeros when None; copied,
        not written); returns the rows' logits and the K/V with the rows' entries written. With
        `self.collect` = Q, `self.attn` holds per layer the head-mean attention of the last Q rows."""
        m, cfg = self.m, self.cfg
        T = len(ids)
        if K is None:
            K = torch.zeros(cfg.num_layers, T, cfg.num_kv_heads, cfg.head_dim)
            V = torch.zeros_like(K)
        else:
            K, V = K.clone(), V.clone()
        r = torch.tensor(rows)
        x = m.model.embed_tokens(torch.tensor(ids)[r])
        cos, sin = m.rotary.cos_sin(r)
        group = cfg.num_heads // cfg.num_kv_heads
        maxp = int(r.max()) + 1
        mask = torch.arange(maxp)[None, :] <= r[:, None]   # [n, maxp]
        self.attn = []
        for li, layer in enumerate(m.model.layers):
            a = layer.self_attn
            hx = layer.input_layernorm(x)
            n = hx.shape[0]
            q = a.q_proj(hx).view(n, a.num_heads, a.head_dim)
            k, v = a.project_kv(hx, cos, sin)
            q = apply_rope(q, cos, sin)
            K[li, r], V[li, r] = k, v
            kk = K[li, :maxp].repeat_interleave(group, dim=1)  # [maxp, H, d]
            vv = V[li, :maxp].repeat_interleave(group, dim=1)
            s = torch.einsum('nhd,thd->hnt', q.float(), kk.float()) * a.scale
            s = s.masked_fill(~mask[None], float('-inf'))
            p = torch.softmax(s, -1)
            if self.collect:
                self.attn.append(p[:, -self.collect:].mean(0))  # [Q, maxp]
            o = torch.einsum('hnt,thd->nhd', p, vv.float()).reshape(n, -1)
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = m.lm_head(m.model.norm(x)).float()
        return logits, K, V

    def setup(self, case, cfg=None):
        cfg = cfg or ReuseConfig(enabled=True)
        tok = self.tok
        t1 = tok.apply_chat_template(list(case.turn1), add_generation_prompt=True)
        first = self.reply(t1)
        old = t1 + list(first.token_ids)
        t2 = tok.apply_chat_template(fill_reply(case.turn2, first.text), add_generation_prompt=True)
        if case.answer_prefix:
            t2 += tok.encode(case.answer_prefix, add_special_tokens=False)
        old_kv_len = len(old) - 1
        _, Ko, Vo = self.forward(old[:old_kv_len], list(range(old_kv_len)))
        exact_logits, Ke, Ve = self.forward(t2, list(range(len(t2))))
        runs = diff_tokens(old, t2, fastdiff_min=cfg.fastdiff_min, cdc_target=cfg.cdc_target)
        prefix = common_prefix_len(t1, t2)
        res = make_plan(old, t2, runs, prefix_len=prefix, old_kv_len=old_kv_len, cfg=cfg)
        plan = res.plan
        T = len(t2)
        # old K/V in slots [0, old_kv_len), the new prompt's in [old_kv_len, old_kv_len + T): the
        # engine's relocate() copies and re-rotates between them as it does between pool slots
        pool = SimpleNamespace(k=torch.cat([Ko, torch.zeros_like(Ke)], 1), v=torch.cat([Vo, torch.zeros_like(Ve)], 1))
        pool.k[:, old_kv_len:old_kv_len + prefix], pool.v[:, old_kv_len:old_kv_len + prefix] = Ko[:, :prefix], Vo[:, :prefix]
        for kp in plan.keeps:
            relocate(pool, torch.arange(kp.src_pos, kp.src_end), old_kv_len + torch.arange(kp.dst_pos, kp.dst_end),
                     kp.delta, self.m.rotary)
        K, V = pool.k[:, old_kv_len:], pool.v[:, old_kv_len:]
        return dict(t2=t2, plan=plan, K=K, V=V, exact=exact_logits, T=T)

    def default_recompute(self, s, seams=8, openings=1, removed=0):
        plan = s['plan']
        extra = set(seam_offsets(plan, seams, removed))
        if openings:
            extra |= set(in_edited_keeps(plan, self.ms.openings(s['t2'], openings, range(s['T']))))
        return sorted(extra)

    def rows(self, s, recompute):
        p = s['plan'].with_recomputed(sorted(set(recompute)))
        return [o for a, b in p.computed_ranges for o in range(a, b)]

    def run(self, s, recompute):
        """(answer-position KL, mean KL over the last LOGIT_POSITIONS positions, computed share) with
        the plan's computed rows plus `recompute` computed over the relocated K/V."""
        rows = self.rows(s, recompute)
        logits, _, _ = self.forward(s['t2'], rows, s['K'], s['V'])
        last = range(s['T'] - LOGIT_POSITIONS, s['T'])
        kl = kl_per_position({o: s['exact'][o] for o in last}, dict(zip(last, logits[-LOGIT_POSITIONS:])))
        return kl[s['T'] - 1], sum(kl.values()) / len(kl), len(rows) / s['T']

    def relocated(self, s, recompute):
        rec = set(recompute)
        return [o for kp in s['plan'].keeps for o in range(kp.dst_pos, kp.dst_end) if o not in rec]


def main() -> int:
    import argparse, json, time
    from pathlib import Path
    from kvsplice.bench.fact_cases import fact_cases
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fidelity_attention_probe")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    emu = Emu(args.model)
    facts = {f.case.name: f for f in fact_cases()}
    names = [f"{k}-{i}" for k in ("delete_result", "replace_note") for i in range(4)]
    out = {}
    for name in names:
        started = time.time()
        s = emu.setup(facts[name].case)
        row = {"base": emu.run(s, [])}
        default = emu.default_recompute(s)
        row["default"] = emu.run(s, default)
        emu.collect = 1
        emu.forward(s["t2"], emu.rows(s, default), s["K"], s["V"])
        emu.collect = 0
        attention = torch.stack([a[-1] for a in emu.attn])   # [layers, positions]
        relocated = torch.tensor(emu.relocated(s, default))
        for depth in (30, 16, 8, 4):
            score = attention[:depth, relocated].mean(0)
            for share in (0.02, 0.05, 0.1, 0.2):
                top = relocated[score.topk(round(share * len(relocated))).indices].tolist()
                row[f"layers<{depth} share {share}"] = emu.run(s, default + top)
        out[name] = row
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
