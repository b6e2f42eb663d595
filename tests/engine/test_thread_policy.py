"""ThreadPolicy: steps with decode rows on decode_threads, prefill-only steps on compute_threads."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import build_engine
from kvsplice.sampling_params import SamplingParams
from kvsplice.utils.thread_policy import ThreadPolicy
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_policy_picks_by_step_kind_and_caps_at_compute_threads(two_threads):
    policy = ThreadPolicy.from_config(1)
    assert (policy.threads_for(decoding=True), policy.threads_for(decoding=False)) == (1, 2)
    assert ThreadPolicy.from_config(8).decode_threads == 2       # never more than the other steps get
    unset = ThreadPolicy.from_config(None)
    assert unset.threads_for(decoding=True) == unset.threads_for(decoding=False) == 2


def test_engine_runs_decode_steps_on_decode_threads(tmp_path, two_threads):
    engine = build_engine(EngineConfig(model=str(make_tiny_model_dir(tmp_path / "m")), num_slots=512,
                                       decode_threads=1))
    engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    seen = []
    while engine.has_work():
        engine.step()
        seen.append(engine.runner.threads.step_threads)
    assert seen[0] == 2 and set(seen[1:]) == {1}, seen    # the prefill step, then decode-only steps
    engine.add_request(list(range(50, 90)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.runner.threads.step_threads == 2       # a prefill step gets every thread back
    engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()                                        # the first one's decode row + the new prefill
    assert engine.runner.threads.step_threads == 1
    assert torch.get_num_threads() == 2                  # the lm_head ran last, on every thread


def test_decode_threads_are_checked_and_the_cli_default_is_every_thread(two_threads):
    from kvsplice.cli import build_parser, engine_config_from_args

    with pytest.raises(ValueError, match="decode_threads"):
        EngineConfig(decode_threads=0)
    assert EngineConfig().decode_threads is None
    parse = lambda *argv: engine_config_from_args(build_parser().parse_args(["serve", *argv]), {})  # noqa: E731
    assert parse().decode_threads is None and parse("--decode-threads", "auto").decode_threads is None
    assert parse("--decode-threads", "1").decode_threads == 1
