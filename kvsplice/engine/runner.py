"""ModelRunner: turns a step's chunks into one ForwardBatch, runs the model, samples.

Per chunk it asks for logits only where they are needed: the last row when the chunk samples
the request's next token, and every prompt row when prompt logprobs were asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.window_pool import WindowedKVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.config import EngineConfig
from kvsplice.engine.request import Req
from kvsplice.engine.scheduler import Chunk
from kvsplice.engine.step_budget import StepBudget
from kvsplice.layers.forward_batch import ForwardBatch, LinearSeq, Segment, SeqSlice
from kvsplice.layers.logits_processors import accept_tokens, process_logits
from kvsplice.layers.sampler import TokenLogprob, logprobs_of, sample
from kvsplice.layers.shape_bucket import PADDED_DTYPES
from kvsplice.models.decoder import Decoder
from kvsplice.models.fast_decode import FastDecoder
from kvsplice.models.quantize import WeightFormat, apply_weight_format, resolve_weight_format
from kvsplice.utils.thread_policy import ThreadPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkResult:
    """What one chunk produced: the sampled token (if it sampled), prompt logprobs for the prompt
    offsets it computed (offset o carries the logprob of prompt token o + 1), and the raw logits
    of the prompt offsets the request asked to keep (`Req.keep_last_logits`)."""

    token_id: int | None
    logprob: TokenLogprob | None
    prompt_logprobs: dict[int, TokenLogprob]
    prompt_logits: dict[int, torch.Tensor]


class ModelRunner:
    """Runs chunks through `model`; `states` is the StatePool of a hybrid model (None otherwise).

    With `config.fast_path` and an eligible model, every step runs on a FastDecoder built from
    `model` (and decode rows read their contexts from a DecodeArena); otherwise on `model`
    itself, the reference. Construction rounds `model`'s weights to `config.weight_format`
    (in place), so both paths compute the same model. Each step's wall time is reported to
    `budget` (the scheduler's StepBudget), if given. `failpoints` (tests) may make the forward or
    the sampling raise. `decode_builder`: what builds the compiled decode step, with
    `config.compile_decode` "on" (default: inductor).
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, states: StatePool | None = None,
                 config: EngineConfig | None = None, budget: StepBudget | None = None, failpoints=None,
                 decode_builder=None):
        config = config or EngineConfig()
        self.model = model
        self.pool = pool
        self.states = states
        self.budget = budget
        self.failpoints = failpoints
        self.fast: FastDecoder | None = None
        self.arena: DecodeArena | None = None
        self.weight_format = WeightFormat("dense", "dense")
        self.threads = ThreadPolicy.from_config(config.decode_threads, config.prefill_lane_threads)
        compiles = config.compile_decode == "on"   # build_engine resolves auto
        if isinstance(model, Decoder):
            self.weight_format = resolve_weight_format(config.weight_format, model)
            if model.applied_weight_format != self.weight_format:   # once: rounding again moves weights
                apply_weight_format(model, self.weight_format)
                model.applied_weight_format = self.weight_format
            if config.fast_path and states is None and FastDecoder.supports(model.cfg):
                if compiles and not config.decode_arena_tokens:
                    raise ValueError("--compile-decode needs the DecodeArena (--decode-arena-tokens above 0)")
                self.fast = self._fast_decoder(model, compiles, decode_builder)
                if config.decode_arena_tokens:   # the compiled graphs take arenas of 2 rows or more
                    # a windowed pool's sliding layers decode over rings of W columns, not the context
                    rings = ((pool.sliding_layers, pool.window) if isinstance(pool, WindowedKVPool) else ((), None))
                    self.arena = DecodeArena(model.cfg.num_kv_layers, pool.k.shape[2], pool.k.shape[3], pool.k.dtype,
                                             config.decode_arena_tokens, device=pool.k.device,
                                             min_rows=2 if compiles else 1, ring_layers=rings[0], ring_width=rings[1])
            elif config.fast_path and states is None:
                logger.warning("the fast path does not implement %s (%s): every batch runs on the reference Decoder",
                               model.cfg.model_type, FastDecoder.refusal(model.cfg))
        if compiles and self.fast is None:
            raise ValueError("--compile-decode needs the fast path: an attention-only model (not one whose every "
                             "layer slides), and no --no-fast-path")

    def min_computed_tokens(self) -> int:
        """The fewest prompt tokens a request must compute after a prefix hit for them to get the
        bits a cold prefill gives them: 1 (the last, for its logits) in fp32 or without few-row
        kernels; in bf16 / fp16 one more than the most rows a few-row kernel multiplies, since up to
        there the packed kernel computes them with other bits than the dense, row-tiled path a
        longer prefill takes (kvsplice.layers.quant_linear, "Batch invariance")."""
        if self.fast is None or self.fast.embed.dtype not in PADDED_DTYPES:
            return 1
        return 1 + self.fast.few_row_limit

    def _fast_decoder(self, model: Decoder, compiles: bool, decode_builder) -> FastDecoder:
        """The FastDecoder of `model` in this runner's weight format: without compiled decode, the
        one an earlier runner built on the same Decoder (packing the weights again would quantize
        their packed copies again, and the engines would compute with different weights)."""
        key = (self.weight_format.projections, self.weight_format.lm_head)
        if not compiles and key in model.fast_decoders:
            return model.fast_decoders[key]
        fast = FastDecoder(model, *key, compile_decode=compiles, threads=self.threads, decode_builder=decode_builder)
        if not compiles:
            model.fast_decoders[key] = fast
        return fast

    def build_batch(self, chunks: list[Chunk], use_arena: bool = True) -> tuple[ForwardBatch, list[dict[int, int]]]:
        """Flatten chunks into a ForwardBatch; also returns, per chunk (in `chunks` order),
        {offset: row of the logits tensor} for the offsets whose logits are needed.

        With a DecodeArena (and `use_arena`), the decode chunks it holds come first, in its row
        order, as `arena_rows` (no SeqSlice each); the other chunks follow as before.
        """
        arena_chunks: list[Chunk] = []
        if self.arena is not None and use_arena:
            decoding = {id(c.req): c for c in chunks if c.req.is_decoding and len(c.offsets) == 1}
            held = self.arena.assign([c.req for c in decoding.values()], self.pool)
            arena_chunks = [decoding[id(req)] for req in held]
        in_arena = {id(c) for c in arena_chunks}
        others = [c for c in chunks if id(c) not in in_arena]
        ids, pos, slots, seqs, rows = self._arena_rows(arena_chunks)
        rows_of: dict[int, dict[int, int]] = {id(c): {c.offsets[0]: r} for r, c in enumerate(arena_chunks)}
        start = len(arena_chunks)
        for chunk in others:
            req, offsets = chunk.req, chunk.offsets
            seq = req.seq_ids
            offsets_t = torch.tensor(offsets, dtype=torch.int64)
            ids.append(torch.tensor([seq[o] for o in offsets], dtype=torch.int64))
            pos.append(offsets_t)
            slots.append(req.seq_slots[offsets_t])
            ctx_len = offsets[-1] + 1
            seqs.append(SeqSlice(start, len(offsets), req.seq_slots[:ctx_len],
                                 torch.arange(ctx_len, dtype=torch.int64)))
            row_of = {o: start + i for i, o in enumerate(offsets)}
            wanted = self._logit_offsets(chunk)
            rows_of[id(chunk)] = {o: len(rows) + i for i, o in enumerate(wanted)}
            rows.extend(row_of[o] for o in wanted)
            start += len(offsets)
        linear = tuple(linear_seq(c.req, c.offsets) for c in chunks) if self.states is not None else ()
        batch = ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), tuple(seqs),
                             torch.tensor(rows, dtype=torch.int64), linear, arena_rows=len(arena_chunks))
        if isinstance(self.pool, WindowedKVPool):   # the sliding layers' view, in window slots
            batch = dataclasses.replace(batch, window=self.pool.translate(batch))
        return batch, [rows_of[id(c)] for c in chunks]

    @staticmethod
    def _arena_rows(arena_chunks: list[Chunk]):
        """The flat-tensor parts of the arena decode rows, built in one go (one token each)."""
        if not arena_chunks:
            return [], [], [], [], []
        reqs = [c.req for c in arena_chunks]
        ids = torch.tensor([req.output_ids[-1] for req in reqs], dtype=torch.int64)
        pos = torch.tensor([req.seq_len - 1 for req in reqs], dtype=torch.int64)
        slots = torch.stack([req.seq_slots[req.seq_len - 1] for req in reqs])
        return [ids], [pos], [slots], [], list(range(len(reqs)))

    @staticmethod
    def _logit_offsets(chunk: Chunk) -> list[int]:
        """Offsets of `chunk` that need logits, increasing: the prompt-logprob offsets, the kept
        prompt offsets, and the last one when the chunk samples."""
        req = chunk.req
        prompt_len = len(req.prompt_ids)
        keep_from = prompt_len - req.keep_last_logits
        wanted = {o for o in chunk.offsets
                  if (req.wants_prompt_logprobs and o < prompt_len - 1) or keep_from <= o < prompt_len}
        if chunk.samples:
            wanted.add(chunk.offsets[-1])
        return sorted(wanted)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], beside_lane: bool = False) -> list[ChunkResult]:
        """One forward over all chunks, then sampling. Writes the chunks' K/V into the pool.
        `beside_lane`: a prefill-lane job runs meanwhile (fewer threads, `ThreadPolicy`)."""
        started = time.perf_counter()
        try:
            batch, rows_per_chunk = self.build_batch(chunks)
            if self.failpoints is not None:
                self.failpoints.check("forward", [c.req.rid for c in chunks])
            decode_rows = sum(1 for c in chunks if c.req.is_decoding and len(c.offsets) == 1)
            self.threads.apply(decoding=decode_rows > 0, beside_lane=beside_lane)
            logits = self._forward(batch, beside_lane)
        except BaseException:
            if self.arena is not None:
                self.arena.clear()   # its rows may be half written; they refill from the pool
            raise
        results = self._results(chunks, logits, rows_per_chunk)
        if self.budget is not None:
            self.budget.observe(time.perf_counter() - started, decode_rows, batch.num_tokens - decode_rows)
        return results

    @property
    def supports_lane(self) -> bool:
        """True when `run_lane` may run beside `run` (the fast path of an attention-only model:
        a forward then writes nothing but its own requests' slots)."""
        return self.fast is not None and self.states is None

    @torch.inference_mode()
    def run_lane(self, chunks: list[Chunk]) -> list[ChunkResult]:
        """`run` for the prefill lane's thread (kvsplice.engine.prefill_lane), beside the engine
        thread's `run`: prefill chunks only, without the DecodeArena, on the calling thread's own
        intra-op threads, and nothing fed to the StepBudget (its steps are not decode steps'
        neighbours). Writes the chunks' K/V into the pool."""
        batch, rows_per_chunk = self.build_batch(chunks, use_arena=False)
        if self.failpoints is not None:
            self.failpoints.check("forward", [c.req.rid for c in chunks])
        logits = self.fast.logits(self.fast.final_hidden(batch, self.pool))
        return self._results(chunks, logits, rows_per_chunk)

    def _forward(self, batch: ForwardBatch, beside_lane: bool) -> torch.Tensor:
        if self.fast is not None:
            # beside a lane job the eager step is the faster one (measured: docs/benchmarks/vs_llamacpp.notes.md)
            hidden = self.fast.final_hidden(batch, self.pool, self.arena, allow_compiled=not beside_lane)
            self.threads.apply_head()
            return self.fast.logits(hidden)
        if self.states is None:
            return self.model(batch, self.pool).float()
        return self.model(batch, self.pool, self.states).float()

    def _results(self, chunks: list[Chunk], logits: torch.Tensor,
                 rows_per_chunk: list[dict[int, int]]) -> list[ChunkResult]:
        """Sample every sampling chunk at once, then gather each chunk's logprobs and kept logits."""
        sampling = [(c, rows) for c, rows in zip(chunks, rows_per_chunk) if c.samples]
        if self.failpoints is not None:
            self.failpoints.check("sample", [c.req.rid for c, _ in sampling])
        tokens, token_lps = [], []
        if sampling:
            sample_rows = [rows[c.offsets[-1]] for c, rows in sampling]
            raw = logits[sample_rows]
            # grammar masks, penalties, logit_bias, min_tokens: one batched pass, raw kept for logprobs
            logits_states = [c.req.logits_state for c, _ in sampling]
            tokens, token_lps = sample(process_logits(raw, logits_states), [c.req.params for c, _ in sampling],
                                       [c.req.generator for c, _ in sampling], raw_logits=raw)
            accept_tokens(logits_states, tokens)
        results, k = [], 0
        for chunk, rows in zip(chunks, rows_per_chunk):
            prompt_lps = self._prompt_logprobs(chunk, logits, rows)
            kept = {o: logits[r].clone() for o, r in rows.items()
                    if o >= len(chunk.req.prompt_ids) - chunk.req.keep_last_logits and o < len(chunk.req.prompt_ids)}
            token, lp = (tokens[k], token_lps[k]) if chunk.samples else (None, None)
            k += chunk.samples
            results.append(ChunkResult(token, lp, prompt_lps, kept))
        return results

    @staticmethod
    def _prompt_logprobs(chunk: Chunk, logits: torch.Tensor, rows: dict[int, int]) -> dict[int, TokenLogprob]:
        req = chunk.req
        if not req.wants_prompt_logprobs:
            return {}
        offsets = [o for o in chunk.offsets if o < len(req.prompt_ids) - 1]
        if not offsets:
            return {}
        targets = torch.tensor([req.prompt_ids[o + 1] for o in offsets], dtype=torch.int64)
        lps = logprobs_of(logits[[rows[o] for o in offsets]], targets, req.params.prompt_logprobs)
        return dict(zip(offsets, lps))


def linear_seq(req: Req, offsets: list[int]) -> LinearSeq:
    """The linear layers' view of one chunk: its offsets cut into segments at every gap (the
    relocated tokens in between are not computed), after every offset that ends a checkpoint
    (`req.ckpt_slots`: the state after offset o is saved for length o + 1), and before every
    offset that starts from a loaded state (`req.splice_loads`).

        offsets   10 11 12 | 20 21 22 23 | 24 25        ckpt at length 24, splice load at 20
        segments  [0, 3)     [3, 7) save   [7, 9)
                             load
    """
    segments, start = [], 0
    for row, offset in enumerate(offsets):
        is_last = row == len(offsets) - 1
        if is_last or offsets[row + 1] != offset + 1 or offset + 1 in req.ckpt_slots \
                or offsets[row + 1] in req.splice_loads:
            first = offsets[start]
            segments.append(Segment(start, row + 1, req.splice_loads.get(first), req.ckpt_slots.get(offset + 1)))
            start = row + 1
    return LinearSeq(req.state_slot, tuple(segments))
