"""The checkpoint policy: its text form, the lengths it saves, message-offset checks, the eviction
rule, and what one checkpoint costs in memory on real hybrid shapes."""

from __future__ import annotations

import math

import pytest
import torch

from kvsplice.cache.checkpoint_policy import (MAX_MESSAGE_OFFSETS, CheckpointCandidate, CheckpointPolicy,
                                              check_message_offsets, least_useful, sequence_candidates)
from kvsplice.cache.state_pool import StatePool, state_slot_bytes
from kvsplice.layer_configs import LinearAttnConfig
from kvsplice.models.config import ModelConfig
from kvsplice.reuse.config import ReuseConfig


@pytest.mark.parametrize("text, messages, every", [
    ("messages", True, None), ("every:256", False, 256), ("messages+every:256", True, 256),
    (" Every:16 + MESSAGES ", True, 16),
])
def test_parse_and_describe(text, messages, every):
    policy = CheckpointPolicy.parse(text, max_states=8)
    assert (policy.messages, policy.every, policy.max_states) == (messages, every, 8)
    assert CheckpointPolicy.parse(policy.describe()) == CheckpointPolicy(messages, every)


@pytest.mark.parametrize("text", ["", "every", "every:0", "every:-3", "every:x", "every:9999999999", "messages+messages",
                                  "every:4+every:8", "message", "messages,every:4"])
def test_bad_policies_are_refused(text):
    with pytest.raises(ValueError):
        CheckpointPolicy.parse(text)
    with pytest.raises(ValueError, match="KVREUSE_SSM_CHECKPOINT_POLICY"):
        ReuseConfig.from_env({"KVREUSE_SSM_CHECKPOINT_POLICY": text})


def test_reuse_config_carries_the_policy_and_cap():
    config = ReuseConfig.from_env({"KVREUSE_SSM_CHECKPOINT_POLICY": "every:32",
                                   "KVREUSE_SSM_CHECKPOINT_MAX_STATES": "5"})
    assert config.checkpoints() == CheckpointPolicy(False, 32, 5)
    assert ReuseConfig().checkpoints() == CheckpointPolicy(True, 256, 64)
    with pytest.raises(ValueError, match="checkpoint_max_states"):
        ReuseConfig(checkpoint_max_states=-1)


def test_lengths():
    both = CheckpointPolicy(messages=True, every=4)
    assert both.lengths(10) == [4, 8]                        # no offsets: no message lengths, no prompt end
    assert both.lengths(10, (0, 3, 8)) == [3, 4, 8, 10]      # 0 is the zero state; 10 = the prompt's end
    assert CheckpointPolicy(messages=True, every=None).lengths(10, (3,)) == [3, 10]
    assert CheckpointPolicy(messages=False, every=None).lengths(10, (3,)) == []
    assert CheckpointPolicy(messages=False, every=5).lengths(10, (3,)) == [5]


def test_check_message_offsets():
    assert check_message_offsets(None, 5) == ()
    assert check_message_offsets([0, 2, 4], 5) == (0, 2, 4)
    for bad, what in [([2, 2], "increasing"), ([3, 1], "increasing"), ([5], "outside"), ([-1], "outside"),
                      ([1, True], "integers"), ([1.5], "integers"),
                      (list(range(MAX_MESSAGE_OFFSETS + 1)), "at most")]:
        with pytest.raises(ValueError, match=f"message_offsets: .*{what}"):
            check_message_offsets(bad, 5 if what == "outside" else 10_000)


def cand(depth, prev, nxt, access=1.0):
    return CheckpointCandidate(depth, prev, nxt, access, handle=depth)


def test_eviction_rule():
    # least recently used first, whatever the gaps
    assert least_useful([cand(100, 0, 200, access=2.0), cand(50, 40, 60, access=3.0)]).handle == 100
    # one path: the smallest (c - p) * (n - c) goes first; the path's deepest goes last
    path = [cand(10, 0, 20), cand(20, 10, 22), cand(22, 20, 100), cand(100, 22, None)]
    assert [c.removal_cost for c in path] == [100.0, 20.0, 156.0, math.inf]
    assert least_useful(path).handle == 20
    assert least_useful([path[3], cand(50, 0, None)]).handle == 50      # deepest ones: smaller gap first
    assert least_useful([]) is None


def test_sequence_candidates_sit_above_the_exact_path():
    got = sequence_candidates([50, 30, 70], below=[10, 25, 60], last_access=4.0, owner="s")
    assert [(c.depth, c.prev_depth, c.next_depth, c.handle) for c in got] == [
        (30, 25, 50, ("s", 30)), (50, 30, 70, ("s", 50)), (70, 60, None, ("s", 70))]
    assert all(c.last_access == 4.0 for c in got)


def test_slot_bytes_match_the_pool():
    lin = LinearAttnConfig("qwen3_5", conv_kernel=4, num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=6)
    for dtype in (torch.float32, torch.bfloat16):
        assert StatePool(2, 3, lin, dtype=dtype).bytes_per_slot() == state_slot_bytes(3, lin, dtype)


# Linear-attention shapes of real hybrids (their config.json keys); MoE does not change the state.
QWEN3_5_27B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                   num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                   linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4)
QWEN3_NEXT_80B = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                      num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0)


@pytest.mark.parametrize("hf, linear_layers, mib, kv_kib_per_token", [
    (QWEN3_5_27B, 48, 146.8125, 64),      # 16 full-attention layers x K,V x 4 heads x 256 x bf16
    (QWEN3_NEXT_80B, 36, 73.6875, 24),    # 12 full-attention layers x K,V x 2 heads x 256 x bf16
])
def test_checkpoint_bytes_of_real_hybrids(hf, linear_layers, mib, kv_kib_per_token):
    """One checkpoint (bf16 conv state, fp32 recurrent state) of a real hybrid, and how many tokens
    of its K/V that much memory would hold: the table in docs/ARCHITECTURE.md."""
    config = ModelConfig.from_hf_config(hf)
    assert config.num_linear_layers == linear_layers
    nbytes = state_slot_bytes(config.num_linear_layers, config.linear_attn, torch.bfloat16)
    assert nbytes / 2**20 == mib
    kv_bytes = config.num_kv_layers * 2 * config.num_kv_heads * config.head_dim * 2
    assert kv_bytes == kv_kib_per_token * 1024
    assert 64 * nbytes / 2**30 == pytest.approx(mib * 64 / 1024)   # the default cap of 64 checkpoints in GiB


def test_cli_flags(capsys):
    from kvsplice.cli import build_parser, main, reuse_config_from_args

    args = build_parser().parse_args(["serve", "--scr-checkpoint-policy", "Messages+every:128",
                                      "--scr-checkpoint-max-states", "9"])
    config = reuse_config_from_args(args, {"KVREUSE_SSM_CHECKPOINT_POLICY": "every:4"})
    assert config.checkpoints() == CheckpointPolicy(True, 128, 9)
    for bad in (["--scr-checkpoint-policy", "sometimes"], ["--scr-checkpoint-max-states", "-2"]):
        assert main(["serve", *bad]) == 2
        assert "checkpoint" in capsys.readouterr().err
