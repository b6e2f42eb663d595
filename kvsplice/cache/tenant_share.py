"""TenantShare: the most cached K/V one tenant may keep in the pool before its own entries go first.

A tenant here is a cache namespace: the engine's (API-key owner, cache_salt). With a share F
(`--tenant-kv-share F`, 0 < F <= 1), each namespace's cap is F x the pool's slots; the namespace's
*held* size is the slots its radix nodes hold (evictable, or locked by its SCR sessions and its
running requests' matched prefixes). Eviction for room then runs in two phases:

    pool: 1000 slots, F = 0.4, cap = 400                  evict(300) is asked for
    namespace A   held 300  [ a1 | a2 | a3 ]              under its cap: not touched in phase 1
    namespace B   held 700  [ b1 | b2 | b3 | b4 | b5 ]    over by 300
                              ^ least recently used

    phase 1 (over-share first)  least recently used evictable leaves of namespaces *over* their
                                cap, one leaf at a time, re-checking the cap after each: b1, b2, ...
                                until the room is made or no over-cap namespace has an evictable
                                leaf left (B stops being a candidate once it is at or under 400)
    phase 2 (plain LRU)         least recently used evictable leaf of anyone, A included

So a namespace that floods the pool evicts its own history before anyone else's, while the pool
stays work-conserving: when no one is over, or the over-cap K/V is all locked, eviction is plain
LRU as without a share. Nothing locked is ever evicted for a share: running requests keep theirs,
and an SCR session's path goes only when its session is dropped (over-share namespaces' idle
sessions first, `kvsplice.engine.reuse_manager`). F = 1 is no share at all (phase 1 never finds a
namespace over the whole pool).

The disk tier applies the same share to its bytes (`DiskTierConfig.namespace_share`): a put that
would take its namespace over F x the budget evicts that namespace's own entries first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShare:
    """`share` of a pool of `num_slots` slots that one namespace may hold before phase 1 takes its
    leaves first. Raises ValueError unless 0 < share <= 1 and num_slots >= 1."""

    num_slots: int
    share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"tenant_kv_share must be in (0, 1], got {self.share}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")

    @property
    def cap(self) -> int:
        """Slots one namespace may hold (at least 1)."""
        return max(1, int(self.num_slots * self.share))

    @property
    def enabled(self) -> bool:
        """False for a share of the whole pool (then no namespace is ever over it)."""
        return self.share < 1.0

    def is_over(self, held: int) -> bool:
        """Whether a namespace holding `held` slots is over its cap."""
        return self.enabled and held > self.cap
