"""PrefillLane: prefill chunks computed on a thread of their own while the engine thread decodes,
so that tokens stream at the pace of decode-only steps while other requests prefill.

Why. Without it, a step carries prefill chunks next to the decode rows (kvsplice.engine.scheduler)
and every decoding request waits for them: a step with a prefill chunk beside a decode row costs
several decode-only steps (docs/BENCHMARKS_HISTORY.md, "Against llama.cpp's llama-server on the
same GGUF"). Most of it is paid again by every step of a chunked prefill: reading the weights in
bf16 (as costly at 16 rows as at 1) and the chunk's attention over its whole context. With a
lane, decode steps run alone on the engine thread and the prefill goes on the lane's thread in
chunks of up to `max_batch_tokens`, which read the weights once for many tokens and never hold a
decode step back.

    engine thread (N - L threads):  decode | decode | decode | decode | decode | decode ...
    lane thread   (L threads):      [ prefill job: chunks, up to max_batch_tokens ] [ next job ]
                                    ^ started by a step that finds the lane idle while requests decode
                                                           ^ taken back by the first step that finds it done

What each side touches while a job runs. The job's requests are `Scheduler.held`: no step schedules,
preempts or frees them (an abort first waits for the job: `Engine.abort`). The lane's forward
writes K/V only into those requests' own pending slots and reads their contexts (prefix entries
they hold locked); the engine thread's decode steps write their own requests' slots and the
DecodeArena, which a lane forward never uses. Both read the model's weights. The job's sampling
runs on the lane thread too: its requests' generators and grammar states are touched by nobody
else until the job is taken back. Everything else (scheduler, cache manager, radix tree, SCR
sessions) stays on the engine thread.

Threads. torch's intra-op thread count belongs to the calling OS thread (OpenMP's nthreads ICV):
the lane thread sets L once; the engine thread's steps take N - L while a job runs and N
otherwise (kvsplice.utils.thread_policy). L = 1 keeps libgomp's count of threads at the cores (a
thread whose regions run on one thread starts no team), so the engine thread's workers keep
spinning (see kvsplice.engine.compute_thread).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.engine.compute_thread import ComputeThread
from kvsplice.engine.runner import ChunkResult
from kvsplice.engine.scheduler import Chunk


@dataclass(frozen=True)
class LaneJob:
    """One forward on the lane: its chunks and the future of their results."""

    chunks: tuple[Chunk, ...]
    future: "concurrent.futures.Future[list[ChunkResult]]"


@dataclass(frozen=True)
class TakenJob:
    """A finished job: its chunks and either their results or the exception the forward raised."""

    chunks: tuple[Chunk, ...]
    results: Optional[list[ChunkResult]]
    error: Optional[BaseException]


def _own_thread_count(threads: int) -> None:
    """Give the calling thread `threads` intra-op threads for good.

    torch sets a thread's count lazily, at its first parallel op (or get_num_threads), from the
    count the process last set on any thread; a set_num_threads before that is overwritten then.
    So the lazy set-up is triggered first. Without it the lane took the engine thread's 2 threads
    whenever that thread had set 2 last, and the process then held more OpenMP threads than cores:
    every later decode step was measured slower (libgomp stops its workers spinning, see
    kvsplice.engine.compute_thread; docs/BENCHMARKS_HISTORY.md, "Against llama.cpp's llama-server
    on the same GGUF")."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


class PrefillLane:
    """Runs `run(chunks)` (ModelRunner.run_lane) on a thread of its own, one job at a time, on
    `threads` intra-op threads. Called from the engine thread only. `jobs`: jobs started so far."""

    def __init__(self, threads: int, run: Callable[[list[Chunk]], list[ChunkResult]]):
        if threads < 1:
            raise ValueError(f"a prefill lane needs at least one thread, got {threads}")
        self._run = run
        self._thread = ComputeThread(name="kvsplice-prefill")
        self._thread.run(lambda: _own_thread_count(threads))
        self.job: Optional[LaneJob] = None
        self.jobs = 0

    @property
    def busy(self) -> bool:
        """True from `start` until `take` hands the job back (finished or not)."""
        return self.job is not None

    def start(self, chunks: Sequence[Chunk]) -> None:
        """Begin computing `chunks` on the lane. RuntimeError while a job is in hand."""
        if self.job is not None:
            raise RuntimeError("the prefill lane already has a job")
        job_chunks = list(chunks)
        self.jobs += 1
        self.job = LaneJob(tuple(job_chunks), self._thread.submit(lambda: self._run(job_chunks)))

    def take(self, block: bool) -> Optional[TakenJob]:
        """The job, once finished (`block`: wait for it), and the lane is idle again; None when
        there is no job, or it is still running and not `block`."""
        job = self.job
        if job is None or (not block and not job.future.done()):
            return None
        error = job.future.exception()   # (waits for the job)
        self.job = None
        return TakenJob(job.chunks, None if error is not None else job.future.result(), error)

    def close(self) -> None:
        """Let the lane thread end after its job (returns at once)."""
        self._thread.close()
