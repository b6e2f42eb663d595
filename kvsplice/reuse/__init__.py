"""Suffix Cache Reuse (SCR): keep the K/V of tokens that survive an edit in the middle of a context.

An agent edits its context: B becomes B', x is deleted, D is appended. Standard prefix caching
reuses only A and recomputes everything after the first changed token. SCR relocates the
surviving spans C1, C2 (their cached K/V move to new positions, keys re-rotated by
delta = dst_pos - src_pos) and computes only B', the last `tail` tokens of each span, and D:

    before  old_ids  [ A ][ B  ][ C1 ............ ][ x ][ C2 ............ ]
                                |                        |
                                | delta = len(B') - len(B)
                                v                        v  delta - len(x)
    after   new_ids  [ A ][ B' ][ C1 .......][t ][ C2 .......][t ][ D ]
                      radix  computed  relocated computed relocated computed

    t = span tail (recomputed); everything from C1's first relocated token on is approximate K/V.

Modules, in call order (pure Python over int lists, no torch; relocate.py, the tensor part,
lives next to them):
    config.py         ReuseConfig, the KVREUSE_* environment table, per-request overrides
    session.py        SessionStore: which tracked conversation a request continues, by id or content
    fingerprint.py    content-defined chunks of a token sequence, hashed (the index's keys)
    session_index.py  SessionIndex: chunk hash -> the sessions holding it, per namespace
    session_match.py  verification of a candidate by the diff, and the ambiguity rule
    diff.py           diff_tokens: verified equal runs between old_ids and new_ids
    plan.py           make_plan -> SpanPlan of Keep spans (validate() checks the invariants)
    accounting.py     ReuseStats (usage.reuse) and FlopsModel
"""
