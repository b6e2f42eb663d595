"""`fused_relocation` in the engine: "on" turns relocated bf16 keys with the compiled kernel and an
edited turn gives the same bits as with the eager turn; auto is decided by `build_engine`; a bad
value is refused."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import _fused_relocation
from kvsplice.layers.fused_turn import FusedTurn
from kvsplice.layers.rotary_move import turn_layer_keys_
from kvsplice.models.compile_choice import find_cpp_compiler
from tests.engine.test_scr import GREEDY, TURN1, TURN2, make_llm, model_dir  # noqa: F401 -- the fixture


@pytest.mark.skipif(find_cpp_compiler() is None, reason="no C++ compiler for inductor")
def test_an_edited_turn_is_the_same_with_the_fused_turn(model_dir):  # noqa: F811
    outputs = {}
    for mode in ("off", "on"):
        llm = make_llm(model_dir, dtype="bfloat16", fused_relocation=mode)
        turner = llm.engine.reuse.key_turner
        assert isinstance(turner, FusedTurn) if mode == "on" else turner is turn_layer_keys_
        llm.generate([TURN1], GREEDY, session_id="c")
        out = llm.generate([TURN2], GREEDY, session_id="c")[0]
        assert out.reuse.relocated_tokens > 0 and out.reuse.fallback is None
        outputs[mode] = (out.token_ids, [lp.logprob for lp in out.logprobs])
        llm.engine.check_integrity()
    assert outputs["on"] == outputs["off"]


@pytest.mark.parametrize("dtype, device, compiler, expected", [
    (torch.bfloat16, "cpu", "/usr/bin/g++", "on"),
    (torch.float16, "cpu", "/usr/bin/g++", "on"),
    (torch.float32, "cpu", "/usr/bin/g++", "off"),
    (torch.bfloat16, "cpu", None, "off"),
    (torch.bfloat16, "cuda", "/usr/bin/g++", "off"),
])
def test_auto_is_on_for_low_precision_keys_on_a_cpu_with_a_compiler(dtype, device, compiler, expected):
    config = EngineConfig(fused_relocation="auto", device=device)
    assert _fused_relocation(config, dtype, compiler) == expected
    for mode in ("on", "off"):   # taken as they are
        assert _fused_relocation(EngineConfig(fused_relocation=mode, device=device), dtype, compiler) == mode


def test_an_unknown_value_is_refused():
    with pytest.raises(ValueError, match="fused_relocation"):
        EngineConfig(fused_relocation="yes")
