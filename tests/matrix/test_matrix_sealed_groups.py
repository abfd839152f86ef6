"""A matrix's groups sealed as they are read (kvbench.fit.data.SharedParts): every pair's
sizes, units, descriptor counts, meta, sources, orders and paths are one object shared by
the pairs that hold equal ones, and nothing a group or a pair's data holds changes by it. A
sealed holder given another record takes its own copies first: the others keep theirs."""

from __future__ import annotations

import json

import pytest

from kvbench.fit.data import Group, Sealer, read_groups
from kvbench.matrix.analyze import PairData, read_run
from tests.matrix.helpers import synthetic_matrix_file

PARTS = ("_bytes", "_ms", "_unit", "_desc", "_desc_merged", "_member", "_runs", "sources",
         "orders", "meta", "paths", "store_pools", "n_records", "n_wrong", "n_empty",
         "not_link", "error", "known_spec_id")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return synthetic_matrix_file(tmp_path_factory.mktemp("m"), 16, 4, 6, seed=5)


def _value(v):
    return v.tobytes() if hasattr(v, "tobytes") else v


def test_sealed_groups_hold_what_unsealed_ones_hold(source):
    run = read_run([str(source)])
    plain = {g.spec_id: g for g in read_groups([source], keep_paths=True)[0]}
    assert len(run.groups) == len(plain) == 16 * 15
    for g in run.groups.values():
        assert g.sealed
        p = plain[g.spec_id]
        assert not p.sealed and g.spec == p.spec
        for name in PARTS:
            assert _value(getattr(g, name)) == _value(getattr(p, name)), name


def test_equal_parts_are_one_object(source):
    groups = list(read_run([str(source)]).groups.values())
    a, b = groups[3], groups[100]
    for name in ("_bytes", "_unit", "_desc", "_desc_merged", "meta", "sources", "orders"):
        assert getattr(a, name) is getattr(b, name), name
    assert a._ms is not b._ms  # each pair's own times


def test_a_sealed_group_given_a_record_takes_its_own_copies(source):
    groups, _ = read_groups([source], keep_paths=True, sealer=Sealer())
    a, b = groups[0], groups[1]
    assert a._bytes is b._bytes and a.sealed
    before = b._bytes.tobytes(), len(b.sources), dict(b.meta)
    rec = _a_record_of(source)
    a.add(rec, "another-file.jsonl")
    assert not a.sealed and a._bytes is not b._bytes
    assert len(a._bytes) == len(b._bytes) + len(rec["samples_ms"])
    assert a.sources == [*b.sources, "another-file.jsonl"]
    assert (b._bytes.tobytes(), len(b.sources), dict(b.meta)) == before  # untouched


def test_a_sealed_pair_counts_on_its_own(source):
    run = read_run([str(source)])
    d1, d2 = list(run.pairs.values())[:2]
    assert d1.sealed and d1.paths is d2.paths
    counted = dict(d2.paths)
    d1.unsealed().paths["another path"] += 1
    assert d1.paths["another path"] == 1 and dict(d2.paths) == counted
    assert isinstance(d1, PairData) and isinstance(run.groups[d1.pair], Group)


def _a_record_of(source):
    """The file's first record (whole) as a dict: Group.add folds dicts as it folds typed ones."""
    with open(source) as f:
        return json.loads(f.readline())
