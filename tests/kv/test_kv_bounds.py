"""The KV vocabulary's work stays bounded on hostile sizes: descriptor counts come from a
formula (no block table of 10^9 tokens is built) and agree with the tables where those are
small; the shard plan by formula is the least-loaded rule written out.
(Found by issue 43, hostile round 4, group 1.)
"""

from __future__ import annotations

import pytest

from kvbench import errors
from kvbench.kv import cut as kc
from kvbench.kv.shards import heads_by_rank, shard_plan
from kvbench.model import get_dtype, resolve_model


def test_descriptor_counts_build_no_block_table(monkeypatch):
    """10^9 tokens in blocks of 16: the count is arithmetic. Before: a block table of 6.25e7
    ids per side was built to count one run (10^7 tokens took 7.7 s and 830 MB)."""
    model, dtype = resolve_model(None, None), get_dtype("bf16")
    small = {b: kc.count_pieces(model, dtype, 300, kc.Cut(16, "joint", b), merge_adjacent=True)
             for b in ("contiguous", "merged", "scattered")}

    def no_tables(kind, need, side, seed=0):
        raise AssertionError(f"built a {kind} block table of {need} ids to count pieces")

    monkeypatch.setattr(kc, "block_table", no_tables)
    blocks = 10**9 // 16
    for kind, runs in (("contiguous", 1), ("merged", 1), ("scattered", blocks)):
        c = kc.Cut(16, "joint", kind)
        assert kc.count_pieces(model, dtype, 10**9, c) == 80 * (1 if kind == "merged" else blocks)
        assert kc.count_pieces(model, dtype, 10**9, c, merge_adjacent=True) == 80 * runs
    assert small == {"contiguous": 80, "merged": 80, "scattered": 80 * 19}  # 300 tokens, 19 blocks


def test_the_formula_counts_what_the_tables_count():
    """The arithmetic against the tables themselves (small prompts, every kind)."""
    model, dtype = resolve_model(None, None), get_dtype("bf16")
    for kind in ("contiguous", "merged", "scattered"):
        for tokens in (1, 16, 17, 300, 1000):
            nb = -(-tokens // 16)
            want = kc.runs_of(kc.block_table(kind, nb, "prefill"), kc.block_table(kind, nb, "decode"))
            got = kc.count_pieces(model, dtype, tokens, kc.Cut(16, "joint", kind), merge_adjacent=True)
            assert got == 80 * want, (kind, tokens)


def _scanning_shard_plan(kv_heads: int, p: int, d: int, mla: bool = False) -> list:
    """The former O(P x D) rule, written out: each decode head from its least-loaded holder."""
    k = 1 if mla else kv_heads
    ph, dh = heads_by_rank(p, k, mla, "prefill"), heads_by_rank(d, k, mla, "decode")
    load, chosen = [0] * p, {}
    for j, heads in enumerate(dh):
        for h in heads:
            src = min((i for i in range(p) if h in ph[i]), key=lambda i: (load[i], i))
            load[src] += 1
            chosen.setdefault((src, p + j), []).append(h)
    return sorted(((s, t, tuple(sorted(h))) for (s, t), h in chosen.items()), key=lambda e: (e[1], e[0]))


@pytest.mark.parametrize("kv_heads", [1, 2, 8, 12])
def test_the_shard_plan_by_formula_is_the_least_loaded_rule(kv_heads):
    for p in range(1, 33):
        for d in range(1, 33):
            try:
                want = _scanning_shard_plan(kv_heads, p, d)
            except errors.UsageError:
                continue
            got = [(e.src, e.dst, e.heads) for e in shard_plan(kv_heads, p, d).edges]
            assert got == want, (kv_heads, p, d)
