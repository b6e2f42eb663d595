"""--compile-decode auto as a pure function of what is checked at start, and the compile cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsplice.models.compile_choice import (TRIAL_CALLS, SpeedTrial, choose_compile_decode, compile_cache_dir,
                                            compile_cache_key, cpu_identity, model_identity)

AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
FIT = dict(cpu_flags=AMX, compiler="/usr/bin/g++", weight_format="int4", dtype="bfloat16", fast_path=None)


def test_auto_compiles_where_every_fact_says_it_is_faster():
    choice = choose_compile_decode("auto", **FIT)
    assert choice.enabled and "amx_bf16" in choice.reason and "int4" in choice.reason
    assert choose_compile_decode("auto", **{**FIT, "cpu_flags": frozenset({"avx512_bf16"}),
                                            "weight_format": "int8"}).enabled


@pytest.mark.parametrize("change, said", [
    (dict(cpu_flags=frozenset({"avx2", "avx512f"})), "native bf16"),
    (dict(cpu_flags=frozenset()), "native bf16"),                      # /proc/cpuinfo unreadable
    (dict(compiler=None), "C++ compiler"),
    (dict(weight_format="dense"), "dense, not int4 / int8 / GGUF blocks"),
    (dict(dtype="float32"), "float32, not bfloat16"),
    (dict(fast_path="qwen3_next is not an attention-only model the fast path runs"), "attention-only"),
])
def test_auto_stays_eager_and_says_why(change, said):
    choice = choose_compile_decode("auto", **{**FIT, **change})
    assert not choice.enabled and said in choice.reason


def test_every_missing_fact_is_named_and_on_off_are_taken_as_given():
    choice = choose_compile_decode("auto", cpu_flags=frozenset(), compiler=None, weight_format="dense",
                                   dtype="float32", fast_path=None)
    assert choice.reason.count(";") == 3
    assert choose_compile_decode("on", **{**FIT, "compiler": None}).enabled
    assert not choose_compile_decode("off", **FIT).enabled
    with pytest.raises(ValueError, match="compile_decode"):
        choose_compile_decode("yes", **FIT)


def test_the_cache_key_changes_with_each_input():
    base = ("2.13.0", model_identity("m", {"num_hidden_layers": 30}), {"layers": 30, "threads": [[2], [1, 2]]},
            cpu_identity("AVX512", AMX))
    key = compile_cache_key(*base)
    assert key == compile_cache_key(*base) and len(key) == 16
    changed = [("2.14.0", *base[1:]),
               (base[0], model_identity("m", {"num_hidden_layers": 31}), *base[2:]),   # its config.json
               (base[0], model_identity("n", {"num_hidden_layers": 30}), *base[2:]),
               (base[0], base[1], {"layers": 30, "threads": [[1], [1, 2]]}, base[3]),
               (base[0], base[1], {"layers": 31, "threads": [[2], [1, 2]]}, base[3]),
               (*base[:3], cpu_identity("AVX2", AMX)),
               (*base[:3], cpu_identity("AVX512", AMX - {"amx_bf16"}))]
    assert len({key, *(compile_cache_key(*inputs) for inputs in changed)}) == len(changed) + 1
    assert compile_cache_dir(Path("/c"), key) == Path("/c/inductor") / key


class _Clock:
    """A clock the timed calls advance: each step costs what it is told to."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, cost: float):
        def call(*args):
            self.now += cost
        return call


def _trial(eager_cost: float, compiled_costs: tuple[float, ...], failing: int | None = None) -> SpeedTrial:
    clock = _Clock()
    compiled = [clock.step(cost) for cost in compiled_costs]

    def compiled_step(graph, *args):
        if graph == failing:
            raise RuntimeError("refused")
        compiled[graph]()

    trial = SpeedTrial(lambda graph, *args: clock.step(eager_cost)(), compiled_step,
                       [(graph,) for graph in range(len(compiled_costs))], ["1 row", "2-8 rows"], clock=clock)
    while not trial.done:
        trial.step()
    return trial


def test_the_speed_trial_switches_in_only_graphs_faster_by_the_margin():
    verdict = _trial(10.0, (8.0, 9.8)).verdict()
    assert verdict.use_compiled == (True, False)
    assert "1 row: compiled 8000.0 ms against eager 10000.0 ms (0.80x): compiled" in verdict.reason
    assert "(0.98x): eager" in verdict.reason
    assert _trial(10.0, (7.0, 7.0)).verdict().reason.startswith("the compiled step serves;")
    slower = _trial(10.0, (12.0, 10.0)).verdict()
    assert slower.use_compiled == (False, False) and slower.reason.startswith("the eager step stays (not 5% faster)")


def test_a_compiled_call_that_fails_leaves_its_graph_eager():
    trial = _trial(10.0, (8.0, 8.0), failing=1)
    verdict = trial.verdict()
    assert verdict.use_compiled == (True, False) and "the compiled call failed: RuntimeError: refused" in verdict.reason
    assert len(trial.times[(0, "compiled")]) == TRIAL_CALLS   # the first round is not timed


def test_a_speed_trial_needs_a_label_per_input():
    with pytest.raises(ValueError):
        SpeedTrial(print, print, [(1,)], ["a", "b"])
