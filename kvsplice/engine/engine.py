"""Engine: the step loop. add_request -> step() (schedule, run, postprocess) -> RequestOutputs.

Not thread-safe: one thread drives it (`kvsplice.engine.async_engine` for the server, the
caller's own thread for `LLM.generate`).

    add_request ─> Scheduler.waiting
    step:
      schedule     Scheduler.schedule_decodes (a slot each, preempting when the pool is full)
                   Scheduler.schedule_prefill (running requests' next chunks)
                   admission: Scheduler.next_to_admit ─> ReuseManager.admit (prefix match | SCR
                   plan + relocate, through the CacheManager) ─> Scheduler.start
      place        StepPlan (kvsplice.engine.step_plan): one forward here, or decodes here and
                   the prefill chunks as a job on the prefill lane
      run          ModelRunner.run (one forward; sampling)
      postprocess  detokenize, stop checks ─> RequestOutput deltas; a finished lane job too
    finish: ReuseManager.finish ─> CacheManager.release (exact part into the radix tree) ─> session

Failures: an exception while admitting, running or postprocessing a request fails only that
request (see `_fail`): its traceback is logged, everything it held is freed, and its final
RequestOutput carries `finish_reason="error"` and the message. A forward (or sampling) that fails
for a batch is re-run chunk by chunk to find the culprit (`_run`). An exception outside every
request's handling escapes `step()`; the caller decides whether the engine can go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvsplice.cache.checkpoint_policy import check_message_offsets
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.window_pool import WindowedKVPool, default_window_slots
from kvsplice.cache.state_pool import StatePool
from kvsplice.config import EngineConfig
from kvsplice.engine.cache_manager import CacheManager, open_disk_tier, owned_by, uses_window_pool
from kvsplice.engine.detokenizer import IncrementalDetokenizer
from kvsplice.structured.stop_patterns import StopPatterns
from kvsplice.engine.failpoints import Failpoints
from kvsplice.engine.prefill_lane import PrefillLane
from kvsplice.engine.request import Namespace, Req, ReqStatus, RequestOutput
from kvsplice.engine.reuse_manager import ReuseManager
from kvsplice.engine.runner import ChunkResult, ModelRunner
from kvsplice.engine.scheduler import Chunk, Scheduler
from kvsplice.engine.step_plan import BesideLane, OneForward
from kvsplice.layers.logits_processors import LogitsState
from kvsplice.layers.fused_turn import KeyTurner, build_fused_turn
from kvsplice.layers.rotary import LayerRotaries
from kvsplice.layers.rotary_move import pool_layer_rotaries, turn_layer_keys_
from kvsplice.layers.sampler import make_generator
from kvsplice.models.config import ModelConfig
from kvsplice.message_offsets import MessageStarts
from kvsplice.sampling_params import SamplingParams
from kvsplice.structured.grammar import GrammarCache
from kvsplice.structured.matcher import GrammarState
from kvsplice.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
TIER_READ_WAIT_S = 0.05   # an idle step waits at most this long for a queued request's tier reads


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; retry later (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """Request `rid` failed inside the engine (an unexpected exception while serving it, logged with
    its traceback); the other requests were not affected (HTTP 500 naming the request id)."""

    def __init__(self, rid: str, message: str):
        super().__init__(f"request {rid} failed: {message}")
        self.rid, self.message = rid, message


@dataclass
class EngineCounters:
    """Cumulative counters since start (exported at /metrics)."""

    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_tokens: int = 0
    relocated_tokens: int = 0
    prefilled_tokens: int = 0
    relocated_spans: int = 0
    disk_tokens: int = 0
    window_relocated: int = 0
    window_recomputed: int = 0
    preemptions: int = 0
    forward_steps: int = 0


def default_state_slots(config: EngineConfig) -> int:
    """State slots of a hybrid's StatePool when not given: a working state per running request,
    plus as many again for checkpoints and SCR sessions, at least 64."""
    return max(64, 2 * config.max_running + 2 * config.reuse.max_sessions)


def make_pool(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> KVPool | WindowedKVPool:
    """The KV pool: a WindowedKVPool for an attention-only model with both sliding-window and full
    layers (sliding layers hold only their windows, kvsplice.cache.window_pool), else the KVPool
    holding every layer for every token."""
    windows = [model_config.layer_window(layer_id) for layer_id in model_config.kv_layers]
    if uses_window_pool(model_config):
        window = next(w for w in windows if w is not None)
        longest = min(config.max_model_len or model_config.max_position_embeddings, config.num_slots)
        window_slots = default_window_slots(config.num_slots, window, config.max_batch_tokens, config.max_running,
                                            longest)
        return WindowedKVPool(config.num_slots, windows, model_config.num_kv_heads, model_config.head_dim,
                              window_slots, dtype=dtype, device=config.device)
    return KVPool(config.num_slots, model_config.num_kv_layers, model_config.num_kv_heads,
                  model_config.head_dim, dtype=dtype, device=config.device)


def relocation_rotary(model: torch.nn.Module, pool: KVPool | WindowedKVPool):
    """The RoPE SCR relocation turns `pool.k`'s keys with: the model's own, or, for a windowed pool
    (whose `k` holds the full layers only), the full layers' (the sliding ones are turned by
    `WindowedKVPool.relocate_window` with `window_rotary`)."""
    if isinstance(pool, WindowedKVPool) and isinstance(model.rotary, LayerRotaries):
        return LayerRotaries(model.cfg.layer_ropes, pool.full_layers)
    return model.rotary


def key_turner(config: EngineConfig, pool: KVPool | WindowedKVPool, rotary) -> KeyTurner:
    """What relocation turns `pool.k`'s keys with: the fused turn where `config.fused_relocation`
    is "on" and it builds with the eager turn's bits (`kvsplice.layers.fused_turn`; the outcome
    logged once), else the eager `turn_layer_keys_`. Side effect: compiles (seconds)."""
    if config.fused_relocation != "on" or rotary is None:
        return turn_layer_keys_
    layers, _, heads, head_dim = pool.k.shape
    choice = build_fused_turn(pool.k.dtype, heads, head_dim, pool_layer_rotaries(rotary, layers))
    logger.info("%s", choice.reason)
    return choice.turner


def window_rotary(model: torch.nn.Module, pool: KVPool | WindowedKVPool):
    """The RoPE of the sliding layers of a windowed pool (None for any other pool)."""
    if not isinstance(pool, WindowedKVPool):
        return None
    if isinstance(model.rotary, LayerRotaries):
        return LayerRotaries(model.cfg.layer_ropes, pool.sliding_layers)
    return model.rotary


class Engine:
    """The step loop over one model. `failpoints`: a test seam (kvsplice.engine.failpoints) that
    makes chosen stages fail; None (the default) costs nothing. `decode_builder`: what builds the
    compiled decode step (kvsplice.models.compiled_decode; default inductor)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, tokenizer: Tokenizer,
                 config: EngineConfig, name: str = "model", failpoints: Failpoints | None = None,
                 decode_builder=None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        dtype = next(model.parameters()).dtype
        pool = make_pool(config, model_config, dtype)
        states = None
        if model_config.is_hybrid:
            states = StatePool(config.num_state_slots or default_state_slots(config), model_config.num_linear_layers,
                               model_config.linear_attn, dtype=dtype, device=config.device)
        tier = open_disk_tier(config.disk_tier, model, model_config, dtype, config)
        self.cache = CacheManager(pool, config.prefix_cache, states, config.reuse.checkpoints(), tier,
                                  tenant_share=config.tenant_kv_share)
        self.failpoints = failpoints
        rotary = relocation_rotary(model, pool)
        self.reuse = ReuseManager(self.cache, model_config, config.reuse, rotary=rotary,
                                  window_rotary=window_rotary(model, pool), key_turner=key_turner(config, pool, rotary),
                                  failpoints=failpoints, message_starts=MessageStarts(tokenizer))
        self.scheduler = Scheduler(config, self.cache)
        self.cache.running = lambda: self.scheduler.running
        self.runner = ModelRunner(model, pool, states, config, self.scheduler.budget, failpoints=failpoints,
                                  decode_builder=decode_builder)
        # a prompt served from the prefix cache computes its last tokens with the bits a cold prefill
        # gives them (bf16 few-row kernels would not): the same request, cached or not, samples alike
        self.cache.min_computed = self.runner.min_computed_tokens()
        self.lane: PrefillLane | None = None
        if 0 < config.prefill_lane_threads < torch.get_num_threads() and self.runner.supports_lane:
            self.lane = PrefillLane(config.prefill_lane_threads, self.runner.run_lane)
        # where a step's chunks run (kvsplice.engine.step_plan)
        self.placement = (OneForward(self.scheduler.budget, config.max_batch_tokens) if self.lane is None
                          else BesideLane(self.lane, config.max_batch_tokens))
        self._lane_outputs: list[RequestOutput] = []   # of a job taken back between steps
        self.grammars = GrammarCache(tokenizer, model_config.vocab_size, tokenizer.eos_token_ids,
                                     compile_timeout_s=config.grammar_compile_timeout)
        self.counters = EngineCounters()
        self._reqs: dict[str, Req] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[Req] = []
        self._failed: dict[str, str] = {}   # rid -> error message, until its final output is out
        self._solo: set[str] = set()        # hybrids: rids to run in a forward of their own (see _run)
        self._rid_counter = itertools.count()

    # ----- requests in ------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                    cache_salt: str | None = None, session_id: str | None = None,
                    scr: str | dict | None = None, keep_last_logits: int = 0, owner: str | None = None,
                    message_offsets: list[int] | tuple[int, ...] | None = None) -> str:
        """Queue a request; returns its id.

        `owner`: the tenant the request belongs to (the server derives it from the API key); with
        `cache_salt` it forms the request's cache namespace: K/V, prefixes and SCR sessions are
        shared only within one (owner, cache_salt).

        `keep_last_logits`: return, in the first RequestOutput, the raw next-token logits of the
        last N prompt positions that are computed (not those served from a cache), for fidelity
        measurements. Raises ValueError for input that can never be served (empty prompt, unknown
        token ids, too long for the context or the pool) and QueueFullError when the queue is full.

        `message_offsets`: offsets into the prompt where its messages start (strictly increasing,
        within the prompt, else ValueError; the chat endpoint computes them from the template). On a
        hybrid model the checkpoint policy saves the linear layers' state there; others ignore them.
        """
        rid = rid or f"req-{next(self._rid_counter)}"
        self._validate(rid, prompt_ids, params)
        offsets = check_message_offsets(message_offsets, len(prompt_ids))
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        req = Req(rid, list(prompt_ids), params, namespace=Namespace(owner, cache_salt), session_id=session_id,
                  arrival_s=time.perf_counter(), generator=make_generator(params.seed),
                  keep_last_logits=keep_last_logits, message_offsets=offsets)
        req.logits_state = self._logits_state(prompt_ids, params)
        req.scr = self.reuse.request_config(scr, cache_salt)
        detok = IncrementalDetokenizer(
            lambda ids, skip=params.skip_special_tokens: self.tokenizer.decode(ids, skip_special_tokens=skip),
            params.stop, context_ids=prompt_ids[-5:],
            stop_patterns=StopPatterns(params.stop_regex) if params.stop_regex else None)
        # registered only once everything is built: a constructor that raises leaves no trace
        self._reqs[rid], self._detoks[rid] = req, detok
        self.scheduler.add(req)
        self.reuse.start_tier_reads(req)
        return rid

    def _logits_state(self, prompt_ids: list[int], params: SamplingParams) -> LogitsState | None:
        """Per-request logits processing (None if none); compiles its grammar (cached: the server
        compiled it already). ValueError for a grammar that does not compile or a bad logit_bias id."""
        grammar = None if params.structured is None else GrammarState(self.grammars.compile(params.structured))
        return LogitsState.create(params, prompt_ids, self.model_config.vocab_size, self.tokenizer.eos_token_ids,
                                  grammar)

    def _validate(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        named = [t for t in params.logprob_token_ids or () if t >= vocab]
        if named:
            raise ValueError(f"logprob_token_ids: token id {named[0]} is outside the vocabulary [0, {vocab})")
        limit = min(self.max_model_len, self.config.num_slots)
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the context limit of {limit} tokens")

    def abort(self, rid: str) -> bool:
        """Stop a request wherever it is; its slots are freed and a final output with
        finish_reason 'abort' comes out of the next `step()`. False if the id is unknown."""
        req = self._reqs.get(rid)
        if req is not None and req.rid in self.scheduler.held:
            self._lane_outputs += self._take_lane(block=True)   # the lane is writing its slots
        if req is None or req.status is ReqStatus.FINISHED:
            return False
        self._finish(req, "abort")
        self._aborted.append(req)
        return True

    # ----- the step ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted) or bool(self._lane_outputs)

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule (decodes, prefill chunks, admissions), run, postprocess; return
        the outputs it produced (aborted and failed requests' final outputs included). Raises only
        for failures outside every request's handling."""
        if self.failpoints is not None:
            self.failpoints.check("step")
        outputs = [self._output(r, (), "", ()) for r in self._aborted]
        self._aborted.clear()
        outputs += self._lane_outputs + self._take_lane(block=False)   # frees the lane for this step
        self._lane_outputs = []
        decodes, prefills = self._schedule()
        if not decodes and not prefills:
            self._fail_window_starved()
        plan = self.placement.place(decodes, prefills)                     # schedule, place
        if plan.to_lane:
            self.scheduler.held.update(c.req.rid for c in plan.to_lane)
            self.lane.start(plan.to_lane)
        outputs += self._postprocess_all(self._run(plan.here, plan.beside_lane))   # run, postprocess
        outputs += self._take_lane(block=plan.wait_for_lane)                   # a lane job that is done
        outputs += [self._output(req, (), "", ()) for req in self._take_failed()]
        if not self.scheduler.has_work():
            self.check_integrity()
        elif not self.scheduler.running and self.cache.reads is not None:
            # only requests waiting for their tier reads: wait for one (briefly) instead of spinning
            self.cache.reads.wait_any([r.rid for r in self.scheduler.waiting], TIER_READ_WAIT_S)
        return outputs

    def _schedule(self) -> tuple[list[Chunk], list[Chunk]]:
        """This step's decode chunks and prefill chunks: every decoding request (given its slot),
        then, within the placement's prefill budget, running requests' next chunks and the
        admissions."""
        decodes, preempted = self.scheduler.schedule_decodes()
        self.counters.preemptions += preempted
        budget = self.placement.prefill_budget(len(decodes))
        prefills = self.scheduler.schedule_prefill(budget)
        return decodes, prefills + self._admit_waiting(budget - sum(len(c.offsets) for c in prefills))

    def _fail_window_starved(self) -> None:
        """A step that schedules nothing while requests run (none held by the prefill lane) means
        every one of them waits for window slots (a windowed pool). While the radix tree has
        unlocked entries, each step evicts some (the room may come); once it has none, nothing will
        free a window: no request progresses, so none trims one. Then the newest of them fails with
        the reason (the others go on with what it held) instead of the engine spinning forever."""
        starved = [req for req in self.scheduler.running if req.pending]
        if (self.cache.windows is None or not starved or self.scheduler.held
                or self.cache.radix.evictable_size() > 0):
            return
        self._fail(starved[-1], RuntimeError(
            f"the sliding-window layers' pool ({self.cache.windows.window_allocator.num_slots} window slots) has no "
            f"room for this request's next chunk and nothing running will free any: raise --num-slots"),
            "prefill scheduling")

    def _admit_waiting(self, budget: int) -> list[Chunk]:
        """Admission: waiting requests, first come first served, each given its slots
        (`_admit`) and started with a first chunk, while `budget` tokens are left; the first that
        cannot be admitted now ends it. A request whose disk-tier reads are still running is
        passed over (it waits, the others go on: `kvsplice.engine.tier_reads`)."""
        chunks: list[Chunk] = []
        while budget > 0 and (req := self.scheduler.next_to_admit(self.reuse.tier_ready)) is not None:
            if not self._admit(req):
                break
            chunk = self.scheduler.start(req, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= len(chunk.offsets)
        return chunks

    def _postprocess_all(self, done: list[tuple[Chunk, ChunkResult]]) -> list[RequestOutput]:
        outputs = []
        for chunk, result in done:
            if (out := self._postprocess_or_fail(chunk, result)) is not None:
                outputs.append(out)
        return outputs

    def _take_lane(self, block: bool) -> list[RequestOutput]:
        """Take back the lane's finished job (`block`: wait for it) and postprocess it: the
        outputs. A job whose forward raised is re-run here chunk by chunk, as `_run` does."""
        taken = self.lane.take(block) if self.lane is not None else None
        if taken is None:
            return []
        self.scheduler.held.difference_update(c.req.rid for c in taken.chunks)
        self.counters.forward_steps += 1
        chunks = list(taken.chunks)
        if taken.error is None:
            done = list(zip(chunks, taken.results))
        elif len(chunks) == 1:
            self._fail(chunks[0].req, taken.error, "forward")
            done = []
        else:
            logger.warning("a prefill-lane forward of %d requests failed (%r); isolating the culprit",
                           len(chunks), taken.error)
            done = [pair for chunk in chunks for pair in self._run_batch([chunk])]
        return self._postprocess_all(done)

    def _run(self, chunks: list[Chunk], beside_lane: bool = False) -> list[tuple[Chunk, ChunkResult]]:
        """The step's forward and sampling, (chunk, result) for the chunks that succeeded.

        A forward is one call for the whole batch, so an exception does not say whose chunk caused
        it. Dense models: every chunk is re-run alone at once; one that fails alone is failed, the
        others go on. This is sound because a forward writes K/V only into its chunks' own slots
        (offsets still pending, never shared with the radix tree), so a re-run overwrites whatever
        the failed one half-wrote with the same values, and a chunk's result depends only on its
        own request. Hybrid models: the linear layers update each request's state in place layer
        by layer, so a failed forward leaves states half-advanced and a re-run would be wrong;
        every request of the batch is preempted instead (re-admission recomputes it exactly) and
        marked to run alone next time (`_solo`) until one forward of its own succeeds. Either way
        each innocent request advances at least one step per failure, so none starves; a seeded
        random sample drawn by the failed call is drawn again (its generator may have advanced).
        """
        solo = [c for c in chunks if c.req.rid in self._solo]
        shared = [c for c in chunks if c.req.rid not in self._solo]
        done = self._run_batch(shared, beside_lane) if shared else []
        for chunk in solo:
            done += self._run_batch([chunk], beside_lane)
            self._solo.discard(chunk.req.rid)
        if chunks:
            self.counters.forward_steps += 1
        return done

    def _run_batch(self, chunks: list[Chunk], beside_lane: bool = False) -> list[tuple[Chunk, ChunkResult]]:
        try:
            return list(zip(chunks, self.runner.run(chunks, beside_lane)))
        except Exception as exc:  # noqa: BLE001 -- isolated below, never ignored
            if len(chunks) == 1:
                self._fail(chunks[0].req, exc, "forward")
                return []
            rids = [c.req.rid for c in chunks]
            logger.warning("a forward of %d requests failed (%r); isolating the culprit among %s",
                           len(chunks), exc, rids)
        if self.runner.states is not None:
            for chunk in chunks:
                self.scheduler.preempt(chunk.req)
                self.counters.preemptions += 1
                self._solo.add(chunk.req.rid)
            return []
        return [pair for chunk in chunks for pair in self._run_batch([chunk], beside_lane)]

    def _postprocess_or_fail(self, chunk: Chunk, result: ChunkResult) -> RequestOutput | None:
        try:
            return self._postprocess(chunk, result)
        except Exception as exc:  # noqa: BLE001 -- fails this request only
            self._fail(chunk.req, exc, "postprocess")
            return None

    def _postprocess(self, chunk: Chunk, result: ChunkResult) -> RequestOutput | None:
        req = chunk.req
        if req.prompt_logprobs is not None:
            for offset, lp in result.prompt_logprobs.items():
                req.prompt_logprobs[offset + 1] = lp
        req.prompt_logits.update(result.prompt_logits)
        req.pending = req.pending[len(chunk.offsets):]
        self.cache.trim_window(req)   # a windowed pool: tokens that left every window give theirs back
        if result.token_id is None:
            return None
        if req.first_token_s is None:
            req.first_token_s = time.perf_counter()
        token = result.token_id
        req.output_ids.append(token)
        detok = self._detoks[req.rid]
        if self.failpoints is not None:
            self.failpoints.check("detokenize", [req.rid])
        # a stopping token (eos, stop_token_ids) is counted but never shown, as in vLLM
        text = "" if self._stops_on_token(req, token) else detok.add(token)
        reason = self._stop_reason(req, token)
        if reason is None:
            req.pending = [req.seq_len - 1]
        else:
            text += detok.flush()
            self._finish(req, reason)
        lps = (result.logprob,) if req.params.logprobs is not None else ()
        return self._output(req, (token,), text, lps)

    def _stops_on_token(self, req: Req, token: int) -> bool:
        params = req.params
        return (not params.ignore_eos and token in self.tokenizer.eos_token_ids) or token in params.stop_token_ids

    def _stop_reason(self, req: Req, token: int) -> str | None:
        params = req.params
        if self._stops_on_token(req, token) or self._detoks[req.rid].stopped:
            return "stop"
        if len(req.output_ids) >= params.max_tokens or req.seq_len >= self.max_model_len:
            return "length"
        return None

    # ----- admission, finish ----------------------------------------------------------
    def _admit(self, req: Req) -> bool:
        """Give `req` its slots (`ReuseManager.admit`): True once it has them. An exception fails
        `req` (it leaves the queue) and answers False, which ends this step's admissions."""
        if req.wants_prompt_logprobs and req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * len(req.prompt_ids)
        first_time = req.num_preemptions == 0
        try:
            admitted = self.reuse.admit(req, update_stats=first_time)
        except Exception as exc:  # noqa: BLE001 -- fails this request only
            self._fail(req, exc, "admission")
            return False
        if not admitted:
            return False
        if first_time:
            req.admitted_s = time.perf_counter()
            self._count_admission(req)
        return True

    def _count_admission(self, req: Req) -> None:
        c, stats = self.counters, req.reuse
        c.prompt_tokens += len(req.prompt_ids)
        c.prefix_tokens += stats.prefix_tokens
        c.relocated_tokens += stats.relocated_tokens
        c.prefilled_tokens += stats.prefilled_tokens
        c.relocated_spans += stats.relocated_spans
        c.disk_tokens += stats.disk_tokens
        c.window_relocated += stats.window_relocated
        c.window_recomputed += stats.window_recomputed

    def _finish(self, req: Req, reason: str) -> None:
        """`req` ends ("stop", "length", "abort" or "error"): its slots go back (into the radix
        tree and its SCR session only for a normal end), it leaves the scheduler."""
        req.finish_reason = reason
        if req.seq_slots is not None:
            self.reuse.finish(req, cache=reason not in ("abort", "error"))
        else:
            self.reuse.forget(req)
        self.scheduler.remove(req)
        self._solo.discard(req.rid)
        req.status = ReqStatus.FINISHED
        self.counters.generation_tokens += len(req.output_ids)
        if reason == "abort":
            self.counters.requests_aborted += 1
        elif reason == "error":
            self.counters.requests_failed += 1
        else:
            self.counters.requests_finished += 1

    def _fail(self, req: Req, exc: BaseException, stage: str) -> None:
        """`req` raised `exc` during `stage`: log the traceback, free everything it holds (slots,
        radix locks, state slots, its session's in-flight mark: nothing of it is cached, its K/V
        may be half written), and queue its final output with the error. Then the pool must still
        add up; if it does not (a failure left a leak behind), AssertionError escapes: the engine
        cannot go on safely."""
        message = f"{type(exc).__name__} during {stage}: {exc}"
        logger.error("request %s failed during %s", req.rid, stage, exc_info=exc)
        if req.status is not ReqStatus.FINISHED:
            self._finish(req, "error")
        self._failed[req.rid] = message
        self.check_integrity()

    def _take_failed(self) -> list[Req]:
        """Failed requests whose final output is still to be emitted (`_output` clears them)."""
        return [self._reqs[rid] for rid in self._failed]

    def _output(self, req: Req, tokens: tuple[int, ...], text: str, lps: tuple) -> RequestOutput:
        finished = req.status is ReqStatus.FINISHED
        first = len(req.output_ids) == len(tokens) and bool(tokens)
        prompt_lps = tuple(req.prompt_logprobs) if first and req.prompt_logprobs is not None else None
        ttft = None if req.first_token_s is None else req.first_token_s - req.arrival_s
        queue = None if req.admitted_s is None else req.admitted_s - req.arrival_s
        out = RequestOutput(req.rid, tokens, text, lps, finished, req.finish_reason,
                            len(req.prompt_ids), len(req.output_ids), req.reuse, prompt_lps, ttft,
                            dict(req.prompt_logits) if first and req.keep_last_logits else None,
                            req.state_reuse, queue_s=queue,
                            error=self._failed.pop(req.rid, None) if finished else None)
        if finished:
            self._reqs.pop(req.rid, None)
            self._detoks.pop(req.rid, None)
        return out

    # ----- inspection -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool conservation over requests, the radix tree and SCR sessions (AssertionError)."""
        self.cache.check_integrity(self.scheduler.running, private=self.reuse.private_slots(),
                                   private_states=self.reuse.private_state_slots())

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def slots_in_use(self) -> int:
        """Slots held by requests and sessions (not free, not reclaimable cache)."""
        return self.cache.held_by(self.scheduler.running) + self.reuse.private_slots()

    def close(self) -> None:
        """Let the prefill lane's thread end (it holds the model); the engine must not step after."""
        if self.lane is not None:
            self.lane.close()
        if self.cache.reads is not None:
            self.cache.reads.close()
        if self.cache.tier is not None:
            self.cache.tier.close()   # finishes the queued writes

    def flush_cache(self, owner: str | None = None) -> None:
        """Drop every unlocked radix entry and idle session (SGLang's /flush_cache), and every entry
        of the disk tier; with `owner`, only those of that tenant's namespaces (a tenant's own
        flush: every cache_salt it used, nobody else's). Running requests keep their K/V."""
        if owner is None:
            self.reuse.drop_idle_sessions()
        else:
            self.reuse.drop_idle_sessions(lambda namespace: owned_by(namespace, owner))
        self.cache.flush(owner)
