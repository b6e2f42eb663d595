"""ReuseStats (usage.reuse) and the prefill FlopsModel."""

import pytest

from kvsplice.reuse.accounting import AccountingError, FlopsModel, ReuseStats
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import diff_tokens
from kvsplice.reuse.plan import make_plan


def stats(**changes):
    values = dict(prefix_tokens=100, relocated_tokens=400, prefilled_tokens=50, relocated_spans=2,
                  session="matched", fallback=None, changed=18, span_tails=32, unchosen_spans=0, uncached_unchanged=0)
    values.update(changes)
    return ReuseStats(**values)


def test_check_accepts_the_identity_and_rejects_the_rest():
    stats().check(550)
    with pytest.raises(AccountingError):
        stats().check(551)
    with pytest.raises(AccountingError):
        stats(changed=17).check(550)  # breakdown does not sum
    with pytest.raises(AccountingError):
        stats(relocated_spans=0).check(550)
    with pytest.raises(AccountingError):
        stats(prefix_tokens=-1, prefilled_tokens=51, changed=19).check(550)


def test_as_dict_is_the_usage_reuse_object():
    assert stats().as_dict() == {
        "prefix_tokens": 100, "relocated_tokens": 400, "prefilled_tokens": 50, "relocated_spans": 2,
        "session": "matched", "fallback": None,
        "changed": 18, "span_tails": 32, "unchosen_spans": 0, "uncached_unchanged": 0,
        "recomputed": 0, "prefill_flops": 0, "saved_flops": 0, "disk_tokens": 0,
        "window_relocated": 0, "window_recomputed": 0,
    }


def test_check_bounds_the_layer_type_counters():
    stats(window_relocated=400).check(550)
    stats(relocated_tokens=384, prefilled_tokens=66, recomputed=16, window_relocated=100,
          window_recomputed=16).check(550)
    with pytest.raises(AccountingError, match="window_relocated"):
        stats(window_relocated=401).check(550)
    with pytest.raises(AccountingError, match="window_relocated"):
        stats(window_relocated=-1).check(550)
    with pytest.raises(AccountingError, match="window_recomputed"):
        stats(window_recomputed=1).check(550)


def test_from_plan_result_with_and_without_plan():
    old = list(range(500))
    new = [9999] * 5 + old[50:]
    result = make_plan(old, new, diff_tokens(old, new), prefix_len=0, old_kv_len=500, cfg=ReuseConfig())
    planned = ReuseStats.from_plan_result(result, prompt_len=len(new), prefix_len=0, session="matched")
    planned.check(len(new))
    assert (planned.relocated_tokens, planned.relocated_spans, planned.span_tails, planned.changed) == (434, 1, 16, 5)
    off = make_plan(old, new, [], prefix_len=0, old_kv_len=500, cfg=ReuseConfig(enabled=False))
    plain = ReuseStats.from_plan_result(off, prompt_len=len(new), prefix_len=0, session="off")
    plain.check(len(new))
    assert (plain.relocated_tokens, plain.prefilled_tokens, plain.fallback) == (0, len(new), "disabled")


TINY = FlopsModel(num_layers=2, hidden_size=8, num_heads=2, head_dim=4, non_embedding_params=1000, vocab_size=50)


def test_tokens_flops_by_hand():
    # 2 tokens: linear 2*1000 each; attention 4*2 layers*2 heads*4 dims = 64 per key; contexts 1 and 2
    assert TINY.tokens_flops([1, 2]) == 2 * 2 * 1000 + 64 * 3
    assert TINY.tokens_flops([1, 2], logits_tokens=1) == 2 * 2 * 1000 + 64 * 3 + 2 * 8 * 50
    with pytest.raises(ValueError):
        TINY.tokens_flops([0])


def test_prefill_flops_matches_per_token_sum_and_counts_the_head_once():
    ranges = [(3, 7), (10, 12)]
    contexts = [pos + 1 for start, end in ranges for pos in range(start, end)]
    assert TINY.prefill_flops(12, ranges) == TINY.tokens_flops(contexts, logits_tokens=1)
    assert TINY.prefill_flops(13, ranges) == TINY.tokens_flops(contexts)  # last token not computed: no logits
    full = TINY.prefill_flops(12, [(0, 12)])
    assert full == TINY.tokens_flops(range(1, 13), logits_tokens=1)
    assert TINY.saved_flops(12, 3, ranges) == TINY.prefill_flops(12, [(3, 12)]) - TINY.prefill_flops(12, ranges) > 0
    with pytest.raises(ValueError):
        TINY.prefill_flops(12, [(0, 5), (4, 8)])


def test_hybrid_counts_only_full_attention_layers():
    hybrid = FlopsModel(num_layers=4, hidden_size=8, num_heads=2, head_dim=4, non_embedding_params=0,
                        vocab_size=50, attention_layers=1)
    assert hybrid.tokens_flops([10]) == 4 * 1 * 2 * 4 * 10
    with pytest.raises(ValueError):
        FlopsModel(num_layers=0, hidden_size=8, num_heads=2, head_dim=4, non_embedding_params=0, vocab_size=50)
