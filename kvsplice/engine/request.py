"""Req: one generation request inside the engine, and RequestOutput: what the engine emits.

A request's sequence is `prompt_ids + output_ids`. Offsets into it double as RoPE positions
(a relocated span's keys are re-rotated to their new offsets, so this stays true under SCR).
`seq_slots[offset]` is the KV slot of each token that has (or will get) K/V.

Length algebra on one axis (offsets into the sequence):

    0            prefix_len                                  prompt_len        kv_len..
    [ radix hit  | relocated spans and to-compute offsets    ][ decode ............ ]
                   `pending` = the offsets still to compute, increasing

The last sampled token never has K/V (it has not been fed yet), so kv_len == len(seq) - 1 once
decoding has started.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvsplice.cache.radix import TreeNode
from kvsplice.layers.logits_processors import LogitsState
from kvsplice.layers.sampler import TokenLogprob
from kvsplice.reuse.accounting import ReuseStats
from kvsplice.reuse.scr_request import ScrRequest
from kvsplice.sampling_params import SamplingParams


@dataclass(frozen=True)
class StateReuse:
    """Where a hybrid request's linear-layer state came from.

    `radix_match`: tokens the radix tree matched; `checkpoint_depth`: the depth of the deepest
    checkpoint within that match, the one resumed from (0: started from the zero state); it is
    the request's prefix hit. `mode`: the SCR state mode ("fork", "checkpoint", "none"), or
    "prefix" when SCR did not splice; `splices`: segments that started from a loaded state;
    `loaded_from`: for each splice, the old-sequence length of the state loaded (None: kept the
    running state).
    """

    radix_match: int
    checkpoint_depth: int
    mode: str = "prefix"
    splices: int = 0
    loaded_from: tuple[int | None, ...] = ()


class Namespace(NamedTuple):
    """The cache namespace of a request: the tenant that sent it (`owner`, set by the server from the
    API key; None without authentication) and its `cache_salt`. Radix entries and SCR sessions are
    keyed by it, so two namespaces never share K/V; a client chooses its salt but never its owner."""

    owner: str | None
    cache_salt: str | None


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """One step's news about a request (a delta; the final one has `finished=True`).

    `prompt_logprobs` comes on the first output only (one entry per prompt token; the first is
    None because nothing predicts token 0). `reuse` says where the prompt's K/V came from. A request
    that failed inside the engine ends with finish_reason "error" and the message in `error`.
    """

    rid: str
    new_token_ids: tuple[int, ...]
    new_text: str
    logprobs: tuple[TokenLogprob, ...]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None
    prompt_tokens: int
    completion_tokens: int
    reuse: ReuseStats
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    ttft_s: float | None = None
    prompt_logits: dict[int, torch.Tensor] | None = None   # offset -> fp32 logits, if kept
    state_reuse: StateReuse | None = None                  # hybrid models only
    error: str | None = None                               # why it failed (finish_reason "error")
    queue_s: float | None = None                           # arrival -> first admission, once admitted


@dataclass
class Req:
    """Mutable engine-side state of one request (owned by the scheduler)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: Namespace = Namespace(None, None)
    session_id: str | None = None
    arrival_s: float = 0.0
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    seq_slots: torch.Tensor | None = None          # int64 [capacity] once admitted
    pending: list[int] = field(default_factory=list)  # offsets still to compute, increasing
    prefix_len: int = 0
    prefix_node: TreeNode | None = None            # radix node locked by this request
    owned_from: int = 0                            # seq_slots[owned_from:num_slotted] are its own
    num_slotted: int = 0                           # offsets [0, num_slotted) have a slot
    generator: torch.Generator | None = None
    logits_state: LogitsState | None = None        # penalties, bias, min_tokens, grammar (if any)
    reuse: ReuseStats = field(default_factory=lambda: ReuseStats(0, 0, 0, 0, "off"))
    scr: ScrRequest | None = None                  # per-request SCR state, if any
    prompt_logprobs: list[TokenLogprob | None] | None = None
    keep_last_logits: int = 0                      # keep raw logits of the last N prompt offsets
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    admitted_s: float | None = None                # perf_counter time of the first admission
    first_token_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    # hybrid models: the working StatePool slot, checkpoint slots to fill {prefix length: slot},
    # states to load before computing an offset (SCR splices) {offset: slot}, and the report
    state_slot: int | None = None
    ckpt_slots: dict[int, int] = field(default_factory=dict)
    splice_loads: dict[int, int] = field(default_factory=dict)
    state_reuse: StateReuse | None = None
    # hybrid models: offsets where the prompt's messages start (increasing, within the prompt), from
    # the chat template; the checkpoint policy may save the linear layers' state there
    message_offsets: tuple[int, ...] = ()
    # disk tier: whether its reads were started (kvsplice.engine.tier_reads), prompt tokens loaded
    # from it at admission
    tier_reads_started: bool = False
    disk_tokens: int = 0
    # windowed pool (sliding-window models): own offsets below this have had their window trimmed,
    # and the boundaries whose windows it keeps (None until first trimmed)
    window_trimmed: int = 0
    window_checkpoints: tuple[int, ...] | None = None

    @property
    def seq_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        """True when the only offset left to compute is the last sampled token."""
        return bool(self.output_ids) and len(self.pending) == 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
