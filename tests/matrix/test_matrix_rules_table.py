"""The verdict's rules over a big report's columns (kvbench.matrix.table) give the answers of
the rules on entries (kvbench.matrix.analyze: slow_pairs, majority_paths, odd_paths,
link_failures, wrong_data and no_fit in _findings) and the same verdict line, on planted
64-rank matrices: slow, borderline, tied, unrated and interval-less pairs, odd paths within
and across hosts, pairs without a majority path, links that are not the expected kind (one
emulated), wrong data, no fit (issue 44 item 3)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.links.linkpath import LinkPath
from kvbench.matrix import analyze as az
from kvbench.matrix import table as tb
from kvbench.records.schema.matrix import PairEntry
from tests.matrix.helpers import ETH0, ETH1

ETH2 = "UCX RMA write: tcp/eth2 (zero-copy); notifications (AM): tcp/eth2"
SHM = "UCX RMA write: sysv/memory (zero-copy); notifications (AM): posix/memory"
TCP, SHM_KIND = LinkPath(frozenset({"tcp"}), ETH0), LinkPath(frozenset({"shm"}), SHM)
RDMA = LinkPath(frozenset({"rdma"}), "UCX RMA write: rc_mlx5/mlx5_0:1")
EMULATED = LinkPath(frozenset({"rdma"}), "UCX RMA write: tcp/eth0 (emulated)", emulated=True)


def planted(n: int, seed: int, split_paths: bool = False):
    """(entries shaped as analyze's, each pair's LinkPath, the hosts) of an n-rank matrix."""
    rng = np.random.default_rng(seed)
    hosts = [f"node-{r // 8:03d}" for r in range(n)]
    entries, kinds = [], {}
    for s in range(n):
        for r in range(n):
            if s == r:
                continue
            same = hosts[s] == hosts[r]
            rate = float(rng.choice([1.0, 1.0, 0.98, 0.05, 0.75, 0.85, 2.0]))  # ties on purpose
            half = float(rng.choice([0.01, 0.05, 0.3]))
            ci = [rate - half, rate + half]
            kind = rng.integers(0, 14)
            not_fitted, wrong = None, 0
            if kind == 0:
                rate, ci, not_fitted = None, None, "no rate fitted"
            elif kind == 1:
                ci = None
            elif kind == 2:
                ci = [rate - half, None]
            elif kind == 3:
                ci = [1.0 - half, 1.0 - half]
            elif kind == 4:
                wrong = int(rng.integers(1, 9))
            path = SHM if same else ETH0
            lp = SHM_KIND if same else TCP
            if split_paths:  # three paths a third each: no majority in either kind
                path = (path, ETH1, ETH2)[(s + r) % 3]
                lp = LinkPath(lp.kinds, path)
            elif rng.random() < 0.02:
                path, lp = ETH1, LinkPath(frozenset({"tcp"}), ETH1)
            elif rng.random() < 0.02:
                path, lp = (EMULATED.evidence, EMULATED) if rng.random() < 0.5 else \
                    (RDMA.evidence, RDMA)
            kinds[(s, r)] = lp
            entries.append({
                "pair": [s, r], "sender": {"rank": s, "host": hosts[s]},
                "receiver": {"rank": r, "host": hosts[r]}, "same_host": same, "path": path,
                "link": lp.label, "n_records": 2, "wrong_elements": wrong,
                "effective_gb_s": rate, "effective_gb_s_ci95": ci, "not_fitted": not_fitted, "fit": None,
                "findings": []})
    return entries, kinds, hosts


def old_findings(entries, kinds, fraction, expect, expect_local):
    run = SimpleNamespace(pairs={p: SimpleNamespace(pair=p, kinds=Counter({lp: 1}))
                                 for p, lp in kinds.items()})
    majority = az._findings(entries, run, fraction, expect, expect_local)
    return majority, {tuple(e["pair"]): e["findings"] for e in entries if e["findings"]}


def new_findings(entries, kinds, fraction, expect, expect_local):
    b = tb.TableBuilder(len(entries))
    for k, e in enumerate(entries):
        b.add(k, PairEntry.model_validate({**e, "findings": []}), kinds[tuple(e["pair"])])
    t = b.table()
    majority = tb.judge(t, fraction, expect, expect_local)
    return majority, {(int(t.src[k]), int(t.dst[k])): f for k, f in t.findings.items()}, t


CASES = [(0, 0.8, None, None, False), (1, 0.5, "tcp", None, False),
         (2, 0.9, "tcp", "shm", False), (3, 0.8, "rdma", "shm", True),
         (4, 0.8, None, None, True)]


@pytest.mark.parametrize("seed, fraction, expect, expect_local, split", CASES)
def test_the_columns_rules_name_what_the_entries_rules_named(seed, fraction, expect,
                                                             expect_local, split):
    entries, kinds, hosts = planted(64, seed, split)
    old_major, old = old_findings([dict(e, findings=[]) for e in entries], kinds, fraction,
                                  expect, expect_local)
    new_major, new, t = new_findings(entries, kinds, fraction, expect, expect_local)
    assert new_major == old_major
    assert new == old
    codes = Counter(f["code"] for fs in old.values() for f in fs)
    assert codes["slow"] and codes["wrong_data"] and codes["no_fit"]  # the rules had work
    assert bool(codes["path_differs"]) != split  # no majority: no pair named odd
    assert (new_major == {az.ACROSS: None, az.WITHIN: None}) == split
    assert bool(codes["expect_link"]) == bool(expect)
    named = [dict(e, findings=old.get(tuple(e["pair"]), [])) for e in entries]
    assert tb.verdict_line(t, hosts, 64 * 63, az.MAX_NAMED_IN_VERDICT) == \
        az.verdict_line(named, 64 * 63)
    assert tb.pairs_file_fields(t) == {k: v for k, v in az.pairs_file_of(named).items()
                                       if k != "file"}  # (fitted ones: test_matrix_stream)


def test_the_comparison_can_fail(monkeypatch):
    """A planted fault: each pair's own lower end left among 'the others' changes a verdict."""
    keep = tb._median_without
    monkeypatch.setattr(tb, "_median_without", lambda v, x, present: keep(
        v, x, np.zeros_like(present)))
    differ = []
    for n in (3, 4, 5):
        for seed in range(4):
            entries, kinds, _ = planted(n, seed)
            for f in (0.5, 0.8, 0.9):
                _, old = old_findings([dict(e, findings=[]) for e in entries], kinds, f, None,
                                      None)
                _, new, _ = new_findings(entries, kinds, f, None, None)
                differ.append(new != old)
    assert any(differ)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 9, 17])
def test_small_matrices_too(n):
    """Few pairs: where taking a pair's own value out of 'the others' decides verdicts."""
    for seed in range(4):
        entries, kinds, _ = planted(n, seed)
        for f in (0.5, 0.8, 0.9):
            old_major, old = old_findings([dict(e, findings=[]) for e in entries], kinds, f,
                                          "tcp", None)
            new_major, new, _ = new_findings(entries, kinds, f, "tcp", None)
            assert (new_major, new) == (old_major, old)
