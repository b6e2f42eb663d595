"""SCR fidelity on hybrid (linear-attention) models: the state modes against exact recompute.

On a hybrid, full-attention layers relocate K/V as on a dense model, but the Gated DeltaNet layers
must resume from some saved state after each relocated span (`ReuseConfig.state_mode`):
fork (the previous sequence's final state), checkpoint (the previous turn's saved state nearest
before the span's old end), none (skip the relocated tokens). This harness runs the edit cases of
`kvsplice.bench.fidelity` (same turns, same metrics: KL over the last prompt positions, top-1
agreement, greedy agreement) once per mode and once with SCR off (plain prefix caching from the
deepest state checkpoint: exact), so the modes can be compared on a model with trained weights
(random weights say nothing about fidelity).

    from kvsplice.bench.fidelity_hybrid import fidelity_hybrid
    report = fidelity_hybrid("path/to/trained-hybrid", modes=("fork", "checkpoint", "none"))
    print(report["table"])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from kvsplice.bench.edit_cases import EditCase, builtin_cases
from kvsplice.bench.fidelity import BASE_K, BASE_TAIL, Harness, Setting, markdown_table, run_sweep
from kvsplice.reuse.config import STATE_MODES, ReuseConfig


@dataclass(frozen=True)
class HybridSetting(Setting):
    """A fidelity setting with the hybrid state mode sent in the request's `scr` field."""

    state_mode: str = "checkpoint"

    def request_scr(self) -> str | dict:
        """The per-request `scr` field: the dense setting plus `state_mode` ("off" when K == 0)."""
        scr = super().request_scr()
        return scr if scr == "off" else {**scr, "state_mode": self.state_mode}


def hybrid_settings(modes: Sequence[str], max_spans: int = BASE_K, tail: int = BASE_TAIL) -> list[HybridSetting]:
    """SCR off (the exact baseline, through prefix caching) and one setting per state mode.
    Raises ValueError for an unknown mode."""
    bad = [mode for mode in modes if mode not in STATE_MODES]
    if bad:
        raise ValueError(f"unknown state mode(s) {bad}; expected some of {list(STATE_MODES)}")
    settings = [HybridSetting("scr off", 0, tail)]
    settings += [HybridSetting(f"{mode} K={max_spans} tail={tail}", max_spans, tail, state_mode=mode)
                 for mode in modes]
    return settings


def fidelity_hybrid(model_dir: str, modes: Sequence[str] = STATE_MODES, cases: Optional[Sequence[EditCase]] = None,
                    max_spans: int = BASE_K, tail: int = BASE_TAIL, checkpoint_every: int = 256,
                    gen_tokens: int = 32, seed: int = 0, log=print) -> dict:
    """Run every state mode (and SCR off) over the edit cases on the hybrid model at `model_dir`.

    Returns {"results": [per-case dicts], "summaries": [one per setting], "table": markdown}.
    Raises ValueError if the model is not a hybrid or a mode is unknown. Loads the model once;
    each case runs on a fresh engine (see `kvsplice.bench.fidelity.Harness`).
    """
    settings = hybrid_settings(modes, max_spans, tail)
    harness = Harness(model_dir, gen_tokens=gen_tokens,
                      base=ReuseConfig(checkpoint_policy=f"every:{checkpoint_every}"))
    if not harness.reference.model_config.is_hybrid:
        raise ValueError(f"{model_dir} is not a hybrid (linear-attention) model")
    results, summaries = run_sweep(harness, settings, list(cases or builtin_cases(seed)), log=log)
    return {"results": [asdict(r) for r in results], "summaries": summaries, "table": markdown_table(summaries)}
