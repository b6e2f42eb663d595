"""GrammarState (one request's place in its grammar) and the token bitmask of a whole batch.

Per decode step, for the rows of the batch that are constrained:

    fill_bitmask(states) -> bitmask [R, ceil(V / 32)] int32   one xgrammar call for all rows
    apply_bitmask(logits, bitmask)                             one kernel call: disallowed -> -inf
    ... sample ...
    state.accept(token)                                        advance each matcher by its token

Bit j of word w in a row allows token 32 * w + j (xgrammar's layout). `apply_bitmask_reference` is
the plain torch version the tests compare the kernel with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvsplice.structured.grammar import load_xgrammar


class GrammarState:
    """One request's matcher over its compiled grammar. Not thread-safe: the engine thread owns it."""

    def __init__(self, compiled_grammar):
        self.matcher = load_xgrammar().GrammarMatcher(compiled_grammar)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False if the grammar does not allow it (the matcher is unchanged)."""
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match."""
        return bool(self.matcher.is_terminated())


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(states: list[GrammarState], vocab_size: int) -> Tensor:
    """The allowed-token bitmask [len(states), ceil(vocab_size / 32)] of every state, filled by one
    xgrammar call (which spreads the rows over its threads)."""
    xgr = load_xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    xgr.BatchGrammarMatcher("auto").batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
    return bitmask


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """In place: logits [R, V] (fp32) at tokens the bitmask [R, words] disallows become -inf."""
    load_xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1])


def allowed_tokens_reference(bitmask: Tensor, vocab_size: int) -> Tensor:
    """Bool [R, vocab_size]: token t of row r is allowed iff bit t % 32 of word t // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int64)
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_reference(logits: Tensor, bitmask: Tensor) -> None:
    """Pure-torch `apply_bitmask`."""
    allowed = allowed_tokens_reference(bitmask, logits.shape[1]).to(logits.device)
    logits.masked_fill_(~allowed, float("-inf"))
