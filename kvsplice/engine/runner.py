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
    """What one chunk produced: the sampled token (if it sampled) and prompt logprobs for the
    prompt offsets it computed (offset o carries the logprob of prompt token o + 1)."""

    token_id: int | None
    logprob: TokenLogprob | None
    prompt_logprobs: dict[int, TokenLogprob]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool):
        self.model = model
        self.pool = pool

    def build_batch(self, chunks: list[Chunk]) -> tuple[ForwardBatch, list[list[int]]]:
        """Flatten chunks into a ForwardBatch; also returns, per chunk, the flat logit-row
        indices (into the logits tensor) in order of its offsets that have logits."""
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
            wanted = self._logit_offsets(chunk)
            first_row = len(rows)
            rows.extend(start + offsets.index(o) for o in wanted)
            rows_per_chunk.append(list(range(first_row, len(rows))))
            start += len(offsets)
        batch = ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), tuple(seqs),
                             torch.tensor(rows, dtype=torch.int64))
        return batch, rows_per_chunk

    @staticmethod
    def _logit_offsets(chunk: Chunk) -> list[int]:
        req = chunk.req
        if req.wants_prompt_logprobs:
            wanted = [o for o in chunk.offsets if o < len(req.prompt_ids) - 1]
        else:
            wanted = []
        if chunk.samples:
            wanted.append(chunk.offsets[-1])
        return wanted

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> list[ChunkResult]:
        """One forward over all chunks, then sampling. Writes the chunks' K/V into the pool."""
        batch, rows_per_chunk = self.build_batch(chunks)
        logits = self.model(batch, self.pool).float()
        sample_rows = [rows[-1] for chunk, rows in zip(chunks, rows_per_chunk) if chunk.samples]
        sampling = [c for c in chunks if c.samples]
        tokens, token_lps = [], []
        if sampling:
            tokens, token_lps = sample(logits[sample_rows], [c.req.params for c in sampling],
                                       [c.req.generator for c in sampling])
        results, k = [], 0
        for chunk, rows in zip(chunks, rows_per_chunk):
            prompt_lps = self._prompt_logprobs(chunk, logits, rows)
            if chunk.samples:
                results.append(ChunkResult(tokens[k], token_lps[k], prompt_lps))
                k += 1
            else:
                results.append(ChunkResult(None, None, prompt_lps))
        return results

    @staticmethod
    def _prompt_logprobs(chunk: Chunk, logits: torch.Tensor, rows: list[int]) -> dict[int, TokenLogprob]:
        req = chunk.req
        if not req.wants_prompt_logprobs:
            return {}
        offsets = [o for o in chunk.offsets if o < len(req.prompt_ids) - 1]
        if not offsets:
            return {}
        targets = torch.tensor([req.prompt_ids[o + 1] for o in offsets], dtype=torch.int64)
        lps = logprobs_of(logits[rows[: len(offsets)]], targets, req.params.prompt_logprobs)
        return dict(zip(offsets, lps))
