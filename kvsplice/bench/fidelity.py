"""SCR fidelity: how far Suffix Cache Reuse moves the model's outputs from a full recompute.

For each edit case (`kvsplice.bench.edit_cases`) and each SCR setting:

    turn 1   SCR engine, session_id=case   prompt + greedy reply (16 tokens) -> the session's sequence
    turn 2   SCR engine, same session      edited prompt (with THAT reply), keep_last_logits=32, greedy N
    exact    engine with prefix_cache=False, the same turn 2 prompt, keep_last_logits=32, greedy N

Metrics over the last 32 prompt positions (always computed: each case ends with a >= 40-token user
message): KL(exact || SCR) in nats from float64 log_softmax, mean, median and p90, KL at the last
position (the answer position), and top-1 agreement; over the N generated tokens: the fraction
equal before the first divergence and an exact-match flag; the relocated / prefilled / recomputed
token counts of turn 2 and its share of the prompt computed (`kvsplice.bench.fidelity_front`).

The fp8 anchors (`Harness.fp8`): the exact K/V of turn 2's prompt, stored as float8 e4m3 and read
back, and the last 32 positions computed against them; their KL against exact is what production
engines accept for halving KV memory. Two scalings, as vLLM offers them: per tensor with scale 1
(`kv_cache_dtype="fp8"` without calibration, vLLM's and SGLang's default) and per KV head with a
calibrated scale (amax / 448 of each head's K or V in each layer, llm-compressor's per-head scheme).

All engines share one loaded Decoder (the checkpoint is read once); each case gets a fresh Engine
(its own pool, radix tree and sessions), and every setting starts from turn 1's prompt in the radix
tree and nothing else (see `Harness`). `kvsplice fidelity --task facts` runs the fact-tracking task
instead (`kvsplice.bench.fact_cases`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from kvsplice.bench.edit_cases import EditCase, fill_reply
from kvsplice.bench.fidelity_front import summarize
from kvsplice.bench.fidelity_metrics import (greedy_prefix_fraction, kl_per_position, percentile,  # noqa: F401
                                             top1_agreement)
from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.engine.llm import LLM, GenerationResult, build_engine
from kvsplice.engine.request import Namespace
from kvsplice.message_offsets import message_offsets
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

LOGIT_POSITIONS = 32
TURN1_REPLY_TOKENS = 16
DEFAULT_KS = (0, 1, 2, 4, 6, 8)
DEFAULT_TAILS = (4, 8, 16, 32)
BASE_K, BASE_TAIL = 6, 16
DEFAULT_SEAMS = (8, 16, 32)
DEFAULT_FRONT_TAILS = (16, 4)
POOL_SLOTS = 8_192  # the reference engine: one prompt of up to ~8K tokens at a time
ANCHOR_LABEL = "fp8 K/V per tensor (e4m3, scale 1)"
PER_HEAD_LABEL = "fp8 K/V per head (e4m3, amax scale)"
FP8_E4M3_MAX = 448.0  # largest finite float8 e4m3fn value
DEFAULT_KL_TARGET = 0.0015   # the fp8 level the issue of record names; reported, not chosen by
DEFAULT_WORST_TARGET = 0.03
NO_NAMESPACE = Namespace(None, None)  # the harness's requests carry no owner and no cache_salt


@dataclass(frozen=True)
class Setting:
    """One SCR configuration under test. max_spans == 0 means SCR off (plain prefix caching).
    `seam_tokens`, `removed_seam_tokens`, `message_start_tokens`: selective recompute (always sent,
    so a server default never leaks into a setting). `no_rerotate`: the control experiment
    (`ReuseConfig.no_rerotate`, no request field: such a setting runs on an engine of its own)."""

    label: str
    max_spans: int
    tail: int
    no_rerotate: bool = False
    seam_tokens: int = 0
    removed_seam_tokens: int = 0
    message_start_tokens: int = 0

    def request_scr(self) -> str | dict:
        """The per-request `scr` field for this setting ("off" when K == 0)."""
        if self.max_spans == 0:
            return "off"
        return {"max_spans": self.max_spans, "tail": self.tail, "seam_tokens": self.seam_tokens, "removed_seam_tokens": self.removed_seam_tokens,
                "message_start_tokens": self.message_start_tokens}


@dataclass(frozen=True)
class CaseResult:
    """Fidelity of one case under one setting (see the module docstring for each metric).
    `computed_tokens`: the prompt tokens computed (prefilled)."""

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
    kl_median: float = 0.0
    kl_answer: float = 0.0
    recomputed_tokens: int = 0
    computed_tokens: float = 0.0
    prefill_flops: int = 0
    full_flops: int = 1


def sweep_settings(ks: Sequence[int] = DEFAULT_KS, tails: Sequence[int] = DEFAULT_TAILS) -> list[Setting]:
    """The K / tail sweep: every K at tail=16, every tail at K=6, and the NO_REROTATE control (K=6,
    tail=16); no selective recompute."""
    settings = [Setting(f"K={k} tail={BASE_TAIL}" if k else "scr off", k, BASE_TAIL) for k in ks]
    settings += [Setting(f"K={BASE_K} tail={t}", BASE_K, t) for t in tails if t != BASE_TAIL]
    settings.append(Setting(f"NO_REROTATE K={BASE_K} tail={BASE_TAIL}", BASE_K, BASE_TAIL, no_rerotate=True))
    return settings


def front_settings(max_spans: int = BASE_K, tails: Sequence[int] = (BASE_TAIL,), seams: Sequence[int] = (),
                   removed_seams: Sequence[int] = (), openings: Sequence[int] = ()) -> list[Setting]:
    """The selective-recompute sweep: SCR off, then per tail SCR without recompute, every seam
    length > 0 alone and with every longer seam of `removed_seams` after removed text, SCR without
    seams and every seam length with every count of `openings` (the first content tokens of every
    message recomputed, labelled ", openings N")."""
    settings = [Setting("scr off", 0, tails[0])]
    for tail in tails:
        suffix = f" tail={tail}" if len(tails) > 1 else ""
        settings.append(Setting(f"K={max_spans} tail={tail}", max_spans, tail))
        settings += [Setting(f"K={max_spans} tail={tail}, openings {m}", max_spans, tail, message_start_tokens=m)
                     for m in openings if m > 0]
        for n in (n for n in seams if n > 0):
            settings.append(Setting(f"seams {n}{suffix}", max_spans, tail, seam_tokens=n))
            settings += [Setting(f"seams {n}, {r} after removed{suffix}", max_spans, tail, seam_tokens=n,
                                 removed_seam_tokens=r) for r in removed_seams if r > n]
            settings += [Setting(f"seams {n}, openings {m}{suffix}", max_spans, tail, seam_tokens=n,
                                 message_start_tokens=m) for m in openings if m > 0]
    return settings


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """`x` stored as float8 e4m3fn (x / scale, saturated at +-448 as vLLM's cast does) and read
    back (* scale) in x's dtype; `scale` broadcasts against x."""
    stored = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


def per_head_scale(x: torch.Tensor) -> torch.Tensor:
    """One scale per KV head of `x [tokens, heads, dim]`: its amax / 448, shaped [1, heads, 1]."""
    return x.abs().amax(dim=(0, 2), keepdim=True).float().clamp_min(1e-12) / FP8_E4M3_MAX


FP8_ANCHORS = ((ANCHOR_LABEL, lambda x: fp8_round_trip(x)),
               (PER_HEAD_LABEL, lambda x: fp8_round_trip(x, per_head_scale(x))))


# ----- running ------------------------------------------------------------------------------
def turn1_prompt(tokenizer, case: EditCase, chat_template: Optional[str] = None) -> list[int]:
    """Turn 1's prompt ids of `case` (the model's chat template, or `chat_template`; generation
    prompt added)."""
    return tokenizer.apply_chat_template(list(case.turn1), add_generation_prompt=True, chat_template=chat_template)


def turn2_prompt(tokenizer, case: EditCase, reply: str, chat_template: Optional[str] = None) -> list[int]:
    """Turn 2's prompt ids of `case` with turn 1's reply `reply` in its placeholder, then the
    case's answer prefix (when it has one)."""
    ids = tokenizer.apply_chat_template(fill_reply(case.turn2, reply), add_generation_prompt=True,
                                        chat_template=chat_template)
    if case.answer_prefix:
        ids += tokenizer.encode(case.answer_prefix, add_special_tokens=False)
    return ids


class Harness:
    """One loaded model: an exact-reference engine (prefix_cache=False) and, per case, a fresh SCR
    engine around the same Decoder.

    Within a case every setting runs under its own session id with per-request `scr` settings.
    Turn 1's prompt is prefilled once and its radix path locked by the harness; after each setting
    `flush_cache` drops every session and every other radix entry, so each setting starts from the
    state a fresh engine has after prefilling turn 1's prompt (exact K/V either way). The
    NO_REROTATE control is an engine setting, not a request's: its settings run on a second case
    engine built with it, prepared the same way.
    """

    def __init__(self, model: Optional[str] = None, gen_tokens: int = 32, base: Optional[ReuseConfig] = None,
                 dtype: str = "float32", chat_template: Optional[str] = None, max_prompt_tokens: int = 0):
        """`chat_template`: Jinja source rendering the cases' messages in place of the model's own
        (a base model has none); `max_prompt_tokens`: the longest prompt a case will have, when
        above the reference pool's default POOL_SLOTS."""
        slots = max(POOL_SLOTS, max_prompt_tokens + gen_tokens + LOGIT_POSITIONS + 64)
        self.reference = build_engine(EngineConfig(model=model, prefix_cache=False, num_slots=slots,
                                                   dtype=dtype))   # every engine shares its Decoder's dtype
        self.tokenizer = self.reference.tokenizer
        self.chat_template = chat_template
        self.gen_tokens = gen_tokens
        self.base = base or ReuseConfig()
        self._exact_cache: dict[tuple[int, ...], GenerationResult] = {}

    def _engine(self, config: EngineConfig) -> Engine:
        ref = self.reference
        return Engine(ref.runner.model, ref.model_config, ref.tokenizer, config, name=ref.name)

    def case_engine(self, turn1_tokens: int = 4096, no_rerotate: bool = False) -> Engine:
        """A fresh Engine (own pool, tree, sessions) around the reference's Decoder, SCR on (keys
        relocated without re-rotation with `no_rerotate`), with room for turn 1, one session and
        turn 2 of a case whose turn 1 has `turn1_tokens` tokens."""
        slots = 4 * turn1_tokens + 4096
        reuse = self.base.replace(enabled=True, no_rerotate=no_rerotate)
        return self._engine(EngineConfig(num_slots=slots, reuse=reuse))

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

    def fp8(self, prompt_ids: list[int]) -> dict[str, GenerationResult]:
        """The fp8 anchors (FP8_ANCHORS), by label: prefill all but the last LOGIT_POSITIONS tokens
        exactly (once), store their K/V in every layer as fp8 and read them back, then compute the
        last positions (and the greedy tokens) against them. The last positions' own K/V stay fp32
        within their forward (32 of thousands of context entries)."""
        engine = self._engine(EngineConfig(num_slots=2 * len(prompt_ids) + self.gen_tokens + 64,
                                           reuse=self.base.replace(enabled=False)))
        llm = LLM(engine=engine)
        head = prompt_ids[:-LOGIT_POSITIONS]
        llm.generate([head], self._params(1))
        match = engine.cache.radix.match_prefix(head, NO_NAMESPACE)
        engine.cache.radix.lock(match.node)
        pool = engine.cache.pool
        exact_k, exact_v = pool.k[:, match.slots].clone(), pool.v[:, match.slots].clone()
        results = {}
        for label, round_trip in FP8_ANCHORS:
            for layer in range(pool.k.shape[0]):
                pool.k[layer, match.slots] = round_trip(exact_k[layer])
                pool.v[layer, match.slots] = round_trip(exact_v[layer])
            results[label] = llm.generate([prompt_ids], self._params(self.gen_tokens),
                                          keep_last_logits=LOGIT_POSITIONS)[0]
            engine.flush_cache()   # keeps the locked head, drops what the last positions added
        return results

    def turn1_ids(self, case: EditCase) -> list[int]:
        """Turn 1's prompt of `case`, rendered with the harness's chat template."""
        return turn1_prompt(self.tokenizer, case, self.chat_template)

    def offsets(self, messages: Sequence[dict], prompt_ids: list[int]) -> list[int]:
        """Where `messages` start in `prompt_ids` (their rendering with the generation prompt), as
        the server passes them with a chat request (`kvsplice.message_offsets`): the engine keeps
        checkpoints there (sliding-window K/V, hybrid states)."""
        def render(prefix, add_generation_prompt):
            return self.tokenizer.render_chat(list(prefix), None, add_generation_prompt, self.chat_template)
        return message_offsets(self.tokenizer, messages, prompt_ids, render=render)

    def turn2_ids(self, llm: LLM, setting: Setting, case: EditCase) -> tuple[list[int], GenerationResult]:
        """Turn 1 of `case` under `setting` in its session; returns turn 2's prompt and the SCR turn 2."""
        scr = setting.request_scr()
        session_id = f"{case.name}/{setting.label}"
        turn1_ids = self.turn1_ids(case)
        first = llm.generate([turn1_ids], self._params(TURN1_REPLY_TOKENS), session_id=session_id, scr=scr,
                             message_offsets=[self.offsets(case.turn1, turn1_ids)])[0]
        turn2_ids = turn2_prompt(self.tokenizer, case, first.text, self.chat_template)
        offsets = self.offsets(fill_reply(case.turn2, first.text), turn2_ids)
        second = llm.generate([turn2_ids], self._params(self.gen_tokens), session_id=session_id, scr=scr,
                              keep_last_logits=LOGIT_POSITIONS, message_offsets=[offsets])[0]
        llm.engine.flush_cache()
        return turn2_ids, second

    def result(self, setting: Setting, case: EditCase, turn2_ids: list[int], second: GenerationResult) -> CaseResult:
        """The CaseResult of `second` (turn 2 of `case` under `setting`) against the exact turn 2."""
        return compare(setting.label, case.name, self.exact(turn2_ids), second, second.reuse.prefilled_tokens,
                       self.full_flops(len(turn2_ids)))

    def full_flops(self, prompt_len: int) -> int:
        """FLOPs of computing every token of a prompt of `prompt_len` tokens."""
        return self.reference.reuse.flops.prefill_flops(prompt_len, [(0, prompt_len)])

    def run_anchors(self, case: EditCase, turn2_ids: list[int]) -> list[CaseResult]:
        """The fp8 anchors on turn 2 of `case` (computed share 1: a full prefill, K/V stored in fp8)."""
        full = self.full_flops(len(turn2_ids))
        return [_replace(compare(label, case.name, self.exact(turn2_ids), out, len(turn2_ids), full),
                         prefill_flops=full) for label, out in self.fp8(turn2_ids).items()]

    def case_outputs(self, case: EditCase, settings: Sequence[Setting]) -> list[tuple[list[int], GenerationResult]]:
        """Turn 2's prompt and SCR result under every setting of `case`, on one fresh engine per
        value of `no_rerotate` (see the class docstring)."""
        turn1_ids = self.turn1_ids(case)
        llms: dict[bool, LLM] = {}
        locked = []
        try:
            outputs = []
            for setting in settings:
                if setting.no_rerotate not in llms:
                    llm = llms[setting.no_rerotate] = LLM(engine=self.case_engine(len(turn1_ids), setting.no_rerotate))
                    # prefill turn 1's prompt once
                    llm.generate([turn1_ids], self._params(1), message_offsets=[self.offsets(case.turn1, turn1_ids)])
                    radix = llm.engine.cache.radix
                    locked.append((radix, radix.match_prefix(turn1_ids, NO_NAMESPACE).node))
                    radix.lock(locked[-1][1])
                outputs.append(self.turn2_ids(llms[setting.no_rerotate], setting, case))
            return outputs
        finally:
            for radix, node in locked:
                radix.unlock(node)

    def run_case(self, case: EditCase, settings: Sequence[Setting], anchor: bool = False) -> list[CaseResult]:
        """Every setting on `case` (`case_outputs`) against the exact turn 2; with `anchor`, the fp8
        anchors last (on the turn 2 prompt of the first setting, or of SCR off)."""
        outputs = self.case_outputs(case, list(settings) or [Setting("scr off", 0, BASE_TAIL)])
        results = [self.result(setting, case, ids, out) for setting, (ids, out) in zip(settings, outputs)]
        if anchor:
            results += self.run_anchors(case, outputs[0][0])
        return results


def _replace(result: CaseResult, **changes) -> CaseResult:
    return CaseResult(**{**asdict(result), **changes})


def compare(label: str, case_name: str, exact: GenerationResult, approx: GenerationResult,
            computed_tokens: float = 0.0, full_flops: int = 1) -> CaseResult:
    """The CaseResult of `approx` (turn 2 under setting `label`) against `exact` (full recompute of
    the same prompt)."""
    if exact.prompt_token_ids != approx.prompt_token_ids:
        raise ValueError(f"{case_name}: exact and SCR prompts differ")
    per_position = kl_per_position(exact.prompt_logits, approx.prompt_logits)
    kls = list(per_position.values())
    stats, prompt_tokens = approx.reuse, len(approx.prompt_token_ids)
    return CaseResult(
        setting=label, case=case_name, prompt_tokens=prompt_tokens,
        prefix_tokens=stats.prefix_tokens, relocated_tokens=stats.relocated_tokens,
        prefilled_tokens=stats.prefilled_tokens, relocated_spans=stats.relocated_spans,
        fallback=stats.fallback, kl_mean=sum(kls) / len(kls), kl_p90=percentile(kls, 0.9), kl_max=max(kls),
        top1_agreement=top1_agreement(exact.prompt_logits, approx.prompt_logits),
        greedy_prefix_frac=greedy_prefix_fraction(exact.token_ids, approx.token_ids),
        greedy_exact=exact.token_ids == approx.token_ids,
        kl_median=statistics.median(kls), kl_answer=per_position[max(per_position)],
        recomputed_tokens=stats.recomputed,
        computed_tokens=computed_tokens, prefill_flops=stats.prefill_flops, full_flops=full_flops,
    )


# ----- reports ------------------------------------------------------------------------------
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
    lines = ["| setting | case | prompt | prefix | relocated (spans) | prefilled (recomputed) | mean KL | "
             "p90 KL | answer KL | top-1 | greedy prefix |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.setting} | {r.case} | {r.prompt_tokens} | {r.prefix_tokens} | "
                     f"{r.relocated_tokens} ({r.relocated_spans}) | {r.prefilled_tokens} ({r.recomputed_tokens}) | "
                     f"{r.kl_mean:.5f} | {r.kl_p90:.5f} | {r.kl_answer:.5f} | "
                     f"{r.top1_agreement:.3f} | {r.greedy_prefix_frac:.3f} |")
    return "\n".join(lines)


def run_sweep(harness: Harness, settings: Sequence[Setting], cases: Sequence[EditCase],
              log=print, anchor: bool = False) -> tuple[list[CaseResult], list[dict]]:
    """Every setting over every case (and the fp8 anchors with `anchor`); returns the per-case
    results and one summary per setting, the anchors' last (FP8_ANCHORS order)."""
    results: list[CaseResult] = []
    for case in cases:
        started = time.perf_counter()
        rows = harness.run_case(case, settings, anchor=anchor)
        results += rows
        log(f"{case.name}: " + ", ".join(f"{r.setting} KL {r.kl_mean:.4f}" for r in rows)
            + f"  ({time.perf_counter() - started:.1f} s)")
    labels = [s.label for s in settings] + ([label for label, _ in FP8_ANCHORS] if anchor else [])
    summaries = [summarize([r for r in results if r.setting == label]) for label in labels]
    return results, summaries
