"""ModelRunner: turns a step's chunks into one ForwardBatch, runs the model, samples.

Per chunk it asks for logits only where they are needed: the last row when the chunk samples
the request's next token, and every prompt row when prompt logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.engine.forward_batch import ForwardBatch, LinearSeq, Segment, SeqSlice
from kvsplice.engine.request import Req
from kvsplice.engine.scheduler import Chunk
from kvsplice.layers.logits_processors import accept_tokens, process_logits
from kvsplice.layers.sampler import TokenLogprob, logprobs_of, sample


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
    """Runs chunks through `model`; `states` is the StatePool of a hybrid model (None otherwise);
    `failpoints` (tests) may make the forward or the sampling raise."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, states: StatePool | None = None,
                 failpoints=None):
        self.model = model
        self.pool = pool
        self.states = states
        self.failpoints = failpoints

    def build_batch(self, chunks: list[Chunk]) -> tuple[ForwardBatch, list[dict[int, int]]]:
        """Flatten chunks into a ForwardBatch; also returns, per chunk, {offset: row of the
        logits tensor} for the offsets whose logits are needed."""
        ids, pos, slots, seqs, rows, rows_per_chunk = [], [], [], [], [], []
        start = 0
        for chunk in chunks:
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
            rows_per_chunk.append({o: len(rows) + i for i, o in enumerate(wanted)})
            rows.extend(row_of[o] for o in wanted)
            start += len(offsets)
        linear = tuple(linear_seq(c.req, c.offsets) for c in chunks) if self.states is not None else ()
        batch = ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), tuple(seqs),
                             torch.tensor(rows, dtype=torch.int64), linear)
        return batch, rows_per_chunk

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
    def run(self, chunks: list[Chunk]) -> list[ChunkResult]:
        """One forward over all chunks, then sampling. Writes the chunks' K/V into the pool."""
        batch, rows_per_chunk = self.build_batch(chunks)
        if self.failpoints is not None:
            self.failpoints.check("forward", [c.req.rid for c in chunks])
        if self.states is None:
            logits = self.model(batch, self.pool).float()
        else:
            logits = self.model(batch, self.pool, self.states).float()
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
