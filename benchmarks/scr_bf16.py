"""SCR fidelity by compute dtype, and how much of it relocation explains.

For each edit case (the built-in ones that relocate, `kvsplice.bench.edit_cases`) and each dtype:

    turn 1   SCR engine (the server's default ReuseConfig), session_id=case, greedy 16 tokens
    turn 2   served:   the edited prompt in the same session, as the engine serves it
             turned_by_delta: the same, with every relocated key turned by the delta from the
                       stored (rounded) key and rounded again: the relocation before move_keys
             exact_kv: the same, with every relocated slot's K/V replaced by the exact K/V of turn 2
                       (an engine with prefix caching that computed turn 2 in full) before any row is
                       computed: what SCR would score if relocation were free of error
    exact    a full recompute of turn 2 (no prefix cache)

and the KL(exact || SCR) at the last prompt position and over the last 32, with the share of the
prompt computed. The relocated slots are overwritten while the engine waits at its "forward"
failpoint (kvsplice.engine.failpoints), so the engine's own code runs unchanged.

    nice python benchmarks/scr_bf16.py --dtypes bfloat16 --cases replace_with_note,delete_tool_result

Measured before the two fixes below (2 shared Sapphire Rapids cores with avx512_bf16 / amx_bf16;
SmolLM2-135M, weights auto; those two cases; 5.0% of the prompt computed): KL at the last position /
mean over the last 32 positions
    served (move_keys)   0.00634 / 0.00234
    turned_by_delta      0.00444 / 0.00271
    exact_kv             0.00188 / 0.00184
exact_kv above zero meant the rows SCR computes differed from the full forward's even over exact
K/V. Two causes, both fixed: (1) every Engine built around one Decoder rounded its weights to int4
again and packed them again, and rounding int4 data a second time moves some weights (8% of them on
synthetic Q4_1 data: the scales are re-derived from rounded values), so the exact reference, the SCR engine and the
exact_kv engine computed three slightly different models (ModelRunner now rounds a Decoder once and
shares its FastDecoder); (2) oneDNN's bf16 matmul blocks rows 33..640 differently from 1..32 and
768+ (about 5e-5 of the outputs an ulp apart), so a row's bits depended on how many rows shared its
call (PackedLinear now runs bf16 products in calls of at most 32 rows, `quant_linear.ROW_TILE`).
Attention (SDPA with a position mask over scattered slots against the causal prefill) and RMSNorm
were measured row-count invariant (tests/layers/test_batch_invariance.py).

After both fixes (same machine, load 4-19; `kvsplice fidelity --dtype bfloat16 --relocating --seams 8
--openings 1 --front-tails 16 --gen-tokens 1 --no-anchor`, the 5 built-in cases): scr off (exact
recompute over the prefix cache) KL 0.00000, so the computed rows now match exactly; the default
(seams 8, openings 1) mean KL 0.00238, answer KL 0.0068, 5.3% computed, against 0.00064 / 0.0029 at
float32 (docs/benchmarks/fidelity_front.txt). Decoding turn 1's reply on the dense copy instead of
the int4 kernel left replace_with_note unchanged (0.0019), so what remains is in the relocated K/V
themselves (move_keys leaves about 13% of a moved key's elements an ulp off the fresh key) or in how
bf16 amplifies SCR's stale context. Separated since (docs/benchmarks/fidelity_front_bf16.notes.md):
relocated keys set to exactly round(R(dst) k_proj) of turn 1's captured projections score no better
(delete_tool_result 0.00274 against 0.00260 served, mean over the last 32), the dtypes' own exact
recomputes differ by 0.00104, and more recompute barely moves the bf16 figure: it is bf16 rounding
of turn 1's forward under the stale context, spread over every relocated token, not the relocation.
"""
import argparse
import json
import threading
import time
from pathlib import Path

import torch

from kvsplice.bench.edit_cases import builtin_cases, leaves_content_to_relocate
from kvsplice.bench.fidelity import LOGIT_POSITIONS, NO_NAMESPACE, TURN1_REPLY_TOKENS, turn1_prompt, turn2_prompt
from kvsplice.bench.fidelity_metrics import kl_per_position
from kvsplice.bench.machine import cpu_line
from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.engine.failpoints import Failpoints
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

VARIANTS = ("served", "turned_by_delta", "exact_kv")


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


class Bench:
    """One loaded model in one dtype: the exact reference and fresh engines around its Decoder."""

    def __init__(self, dtype: str):
        self.reference = build_engine(EngineConfig(prefix_cache=False, num_slots=8192, dtype=dtype))
        self.tokenizer = self.reference.tokenizer

    def engine(self, reuse: bool, failpoints: Failpoints | None = None) -> Engine:
        ref = self.reference
        config = EngineConfig(num_slots=20_000, reuse=ReuseConfig(enabled=reuse))
        return Engine(ref.runner.model, ref.model_config, ref.tokenizer, config, name=ref.name, failpoints=failpoints)

    def exact_kv(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[layers, len(ids), kv_heads, head_dim]` of `ids` computed in full."""
        engine = self.engine(reuse=False)
        LLM(engine=engine).generate([ids], greedy(1))
        slots = engine.cache.radix.match_prefix(ids, NO_NAMESPACE).slots
        return engine.cache.pool.k[:, slots].clone(), engine.cache.pool.v[:, slots].clone()

    def run_case(self, case, variants) -> list[dict]:
        """Every variant of `case` on one engine: turn 1's prompt prefilled once and locked, each
        variant in its own session (turn 1's reply, then turn 2), the cache flushed after it."""
        failpoints = Failpoints()
        engine = self.engine(reuse=True, failpoints=failpoints)
        llm = LLM(engine=engine)
        turn1_ids = turn1_prompt(self.tokenizer, case)
        llm.generate([turn1_ids], greedy(1))
        engine.cache.radix.lock(engine.cache.radix.match_prefix(turn1_ids, NO_NAMESPACE).node)
        exact, exact_kv, rows = {}, {}, []
        for variant in variants:
            session = f"{case.name}/{variant}"
            first = llm.generate([turn1_ids], greedy(TURN1_REPLY_TOKENS), session_id=session)[0]
            ids = turn2_prompt(self.tokenizer, case, first.text)
            key = tuple(ids)
            if key not in exact:
                exact[key] = LLM(engine=self.reference).generate([ids], greedy(1),
                                                                 keep_last_logits=LOGIT_POSITIONS)[0].prompt_logits
            if variant == "exact_kv" and key not in exact_kv:
                exact_kv[key] = self.exact_kv(ids)
            second = self._turn2(engine, llm, failpoints, ids, session, variant, exact_kv.get(key))
            engine.flush_cache()
            kl = kl_per_position(exact[key], second.prompt_logits)
            stats = second.reuse
            rows.append({"case": case.name, "variant": variant, "kl_last": kl[max(kl)],
                         "kl_mean32": sum(kl.values()) / len(kl), "computed": stats.prefilled_tokens / len(ids),
                         "relocated": stats.relocated_tokens, "fallback": stats.fallback})
        return rows

    @staticmethod
    def _turn2(engine: Engine, llm: LLM, failpoints: Failpoints, ids: list[int], session: str, variant: str,
               exact_kv):
        """Turn 2 under `variant`: as served, or with the relocated slots rewritten while the engine
        waits at its first forward (keys turned by the delta from the session's K/V, or the exact K/V)."""
        def run():
            return llm.generate([ids], greedy(1), session_id=session, keep_last_logits=LOGIT_POSITIONS)[0]
        if variant == "served":
            return run()
        release = threading.Event()
        reached = failpoints.pause("forward", release)
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=run()))
        worker.start()
        reached.wait()
        (req,) = engine.scheduler.running
        pool, old_slots = engine.cache.pool, req.scr.session.payload.slots()
        for keep in req.scr.plan.keeps:
            dst = req.seq_slots[keep.dst_pos:keep.dst_end]
            if variant == "exact_kv":
                pool.k[:, dst] = exact_kv[0][:, keep.dst_pos:keep.dst_end]
                pool.v[:, dst] = exact_kv[1][:, keep.dst_pos:keep.dst_end]
            else:   # one turn by the delta from the stored keys, the relocation before move_keys
                keys = pool.k[:, old_slots[keep.src_pos:keep.src_end]]
                layers, n, heads, dim = keys.shape
                flat = keys.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)
                flat = engine.reuse.rotary.rerotate(flat, torch.full((n,), keep.delta, dtype=torch.int64))
                pool.k[:, dst] = flat.reshape(n, layers, heads, dim).permute(1, 0, 2, 3)
        release.set()
        worker.join()
        return result["out"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cases", default=None, help="case names, comma-separated (default: every relocating one)")
    parser.add_argument("--out", default="runs/scr_bf16")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    names = args.cases.split(",") if args.cases else None
    cases = [c for c in builtin_cases() if leaves_content_to_relocate(c) and (names is None or c.name in names)]
    print(cpu_line(), flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        bench = Bench(dtype)
        for case in cases:
            started = time.time()
            for row in bench.run_case(case, args.variants.split(",")):
                rows.append({"dtype": dtype, **row})
                print(json.dumps(rows[-1]), flush=True)
            print(f"({time.time() - started:.0f} s)", flush=True)
    print("| dtype | variant | cases | last-position KL mean | max | mean KL, last 32 | computed |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for variant in args.variants.split(","):
            group = [r for r in rows if r["dtype"] == dtype and r["variant"] == variant]
            n = len(group)
            print(f"| {dtype} | {variant} | {n} | {sum(r['kl_last'] for r in group) / n:.5f} | "
                  f"{max(r['kl_last'] for r in group):.5f} | {sum(r['kl_mean32'] for r in group) / n:.5f} | "
                  f"{100 * sum(r['computed'] for r in group) / n:.1f}% |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "scr_bf16.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
