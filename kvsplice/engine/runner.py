"""ModelRunner: turns a step's chunks into one ForwardBatch, runs the model, samples.

Per chunk it asks for logits only where they are needed: the last row when the chunk samples
the request's next token, and every prompt row when prompt logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.engine.forward_batch import ForwardBatch, SeqSlice
from kvsplice.engine.scheduler import Chunk
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
    def __init__(self, model: torch.nn.Module, pool: KVPool):
        self.model = model
        self.pool = pool

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
        batch = ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), tuple(seqs),
                             torch.tensor(rows, dtype=torch.int64))
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
        logits = self.model(batch, self.pool).float()
        sampling = [(c, rows) for c, rows in zip(chunks, rows_per_chunk) if c.samples]
        tokens, token_lps = [], []
        if sampling:
            sample_rows = [rows[c.offsets[-1]] for c, rows in sampling]
            tokens, token_lps = sample(logits[sample_rows], [c.req.params for c, _ in sampling],
                                       [c.req.generator for c, _ in sampling])
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
