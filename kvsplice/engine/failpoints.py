"""Failpoints: a test seam that makes the engine raise (or wait) at a named stage, for chosen requests.

    failpoints = Failpoints()
    failpoints.fail("forward", rid="req-3")           # the next forward that holds req-3 raises
    reached = failpoints.pause("step", release)       # the engine thread waits at its next step
    engine = Engine(model, model_config, tokenizer, config, failpoints=failpoints)

Stages, in call order (STAGES):

    step        the top of Engine.step, outside every request's handling (a failure here is the
                step loop's own; repeated, it stops the engine)
    match       SCR: which session, and the exact prefix       \\
    diff        SCR: old_ids against new_ids                    > planning: a failure falls back to
    plan        SCR: spans to relocate, validated               /  prefix caching
    relocate    SCR: copy K/V to the new slots, re-rotate keys
    forward     the model's forward over a step's chunks        \\ consulted with the rids of a
    sample      choosing each chunk's next token                / whole batch: any armed one fires
    detokenize  the new token's text, stop strings

Without a Failpoints object (the default) the engine pays one `is None` test per stage and
request. `kvsplice serve` arms failpoints from `KVSPLICE_FAILPOINTS` (for tests of the server
process itself): "stage" or "stage=rid", comma-separated; each fires every time it is reached.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

STAGES = ("step", "match", "diff", "plan", "relocate", "forward", "sample", "detokenize")
ENV_VAR = "KVSPLICE_FAILPOINTS"
PAUSE_LIMIT_S = 60.0  # a paused engine thread goes on by itself after this, so no test hangs forever


class InjectedFailure(RuntimeError):
    """Raised by an armed failpoint."""


@dataclass
class _Arm:
    """One armed failpoint: for `rid` (None: any request, or none at all), `times` more firings
    (None: every time) once `skip` matching hits have passed; with `release`, it waits for that
    event (after setting `reached`) instead of raising."""

    rid: str | None
    times: int | None
    skip: int = 0
    release: threading.Event | None = None
    reached: threading.Event | None = None


class Failpoints:
    """Armed failpoints by stage. Thread-safe: tests arm them while the engine thread runs."""

    def __init__(self) -> None:
        self._arms: dict[str, list[_Arm]] = {}
        self._lock = threading.Lock()
        self.fired: dict[str, int] = {}   # stage -> times it raised or paused

    def fail(self, stage: str, rid: str | None = None, times: int | None = 1, after: int = 0) -> None:
        """Make `stage` raise InjectedFailure when it is reached for `rid` (any request if None),
        `times` times (None: every time), after letting the first `after` such hits pass."""
        self._arm(stage, _Arm(rid, times, after))

    def pause(self, stage: str, release: threading.Event, rid: str | None = None) -> threading.Event:
        """Make the engine thread wait at `stage` (once) until `release` is set; returns an event
        that is set when it starts waiting."""
        reached = threading.Event()
        self._arm(stage, _Arm(rid, 1, 0, release, reached))
        return reached

    def clear(self) -> None:
        """Disarm everything."""
        with self._lock:
            self._arms.clear()

    def _arm(self, stage: str, arm: _Arm) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown failpoint stage {stage!r}; stages: {', '.join(STAGES)}")
        with self._lock:
            self._arms.setdefault(stage, []).append(arm)

    def check(self, stage: str, rids: Iterable[str] = ()) -> None:
        """Called by the engine at `stage` for the requests `rids`: raise or wait if armed."""
        arm = self._take(stage, list(rids))
        if arm is None:
            return
        if arm.release is not None:
            arm.reached.set()
            arm.release.wait(PAUSE_LIMIT_S)
            return
        target = f" for request {arm.rid}" if arm.rid is not None else ""
        raise InjectedFailure(f"injected failure at stage {stage!r}{target}")

    def _take(self, stage: str, rids: list[str]) -> _Arm | None:
        """The first arm of `stage` matching `rids`, with one firing used up."""
        with self._lock:
            arms = self._arms.get(stage, [])
            for arm in arms:
                if arm.rid is None or arm.rid in rids:
                    if arm.skip > 0:
                        arm.skip -= 1
                        continue
                    if arm.times is not None:
                        arm.times -= 1
                        if arm.times <= 0:
                            arms.remove(arm)
                    self.fired[stage] = self.fired.get(stage, 0) + 1
                    return arm
        return None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Failpoints | None:
        """Failpoints armed by `KVSPLICE_FAILPOINTS` ("stage" or "stage=rid", comma-separated, each
        firing every time), or None when it is unset or empty. ValueError for an unknown stage."""
        spec = environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        failpoints = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            stage, _, rid = item.partition("=")
            try:
                failpoints.fail(stage.strip(), rid.strip() or None, times=None)
            except ValueError as exc:
                raise ValueError(f"{ENV_VAR}={spec!r}: {exc}") from None
        return failpoints
