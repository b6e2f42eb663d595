"""ScrRequest: the SCR state of one request in the engine (`Req.scr`), from its admission to the
update of its session; kvsplice.engine.reuse_manager fills it in."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsplice.reuse.accounting import SessionKind
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import EqualRun
from kvsplice.reuse.plan import SpanPlan
from kvsplice.reuse.session import Session


@dataclass
class ScrRequest:
    """Per-request SCR state: its settings, its session once attached, the plan it runs.
    `miss`: why no existing session matched (the fallback reason of a new session); `runs` /
    `runs_of`: the diff the match verified with, and the session sequence it was computed
    against (reused by the plan while the session still holds that very sequence); `fork`: the
    finished request's K/V go to a new session and the matched one keeps its own (see
    ReuseManager._attach_session)."""

    cfg: ReuseConfig
    session: Session | None = None
    kind: SessionKind = "new"
    plan: SpanPlan | None = None
    fallback: str | None = None
    diff_stats: dict = field(default_factory=dict)
    miss: str | None = None
    runs: tuple[EqualRun, ...] | None = None
    runs_of: list[int] | None = None
    fork: bool = False
