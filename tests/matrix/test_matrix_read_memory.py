"""What a big matrix's read holds a pair (issue 44: a million pairs at N = 1,024).

One group a pair: its spec shares with the other pairs' every key and value that is not the
pair's own (json's decoder shares keys within one document only), its flattened fields are
made when asked, a size's empty meta is one shared read-only entry, equal LinkPaths are one
object, and its spec_id is the records' (checked by the reader), not hashed again with every
host. Each of these is checked for what it must not change (the spec as written, fields, the
spec's hash) and for the memory it saves; the bound fails on the read as it was (about 10 KB
a pair at N = 128, 5.3 KB after, 5.0 KB at N = 32 before each pair's group and data were
sealed: tests/matrix/test_matrix_sealed_groups.py)."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest

from kvbench.fit.data import NO_META, flatten, read_groups
from kvbench.matrix.analyze import read_run
from kvbench.records.schema.p2p import spec_id_of
from tests.matrix.helpers import synthetic_matrix_file


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return synthetic_matrix_file(tmp_path_factory.mktemp("m"), 32, 8, 6, seed=3)


def test_every_spec_is_the_one_written_and_shares_the_rest(source):
    groups, _ = read_groups([source], keep_paths=True)
    assert len(groups) == 32 * 31
    written = {}
    for line in source.read_text().splitlines():
        rec = json.loads(line)
        if "spec" in rec:
            written[rec["spec_id"]] = rec["spec"]
    for g in groups:
        assert g.spec_id == spec_id_of(g.spec) and g.fields == flatten(g.spec)
        lean = written[g.spec_id]  # (the first record carries hosts; lean ones leave them out)
        assert {k: v for k, v in g.spec.items() if k != "hosts" or "hosts" in lean} == lean
        assert list(g.spec) == [k for k in g.spec if k in lean or k == "hosts"]  # key order kept
    a, b = groups[5].spec, groups[600].spec
    assert a["world"] != b["world"]
    shared = [k for k in a if k not in ("world", "variant") and isinstance(a[k], (str, dict, list))]
    assert shared and all(a[k] is b[k] for k in shared)  # one object, not one a pair
    assert all(k1 is k2 for k1, k2 in zip(a, b, strict=True))  # the keys too
    assert all(m is NO_META for g in groups for m in g.meta.values())
    firsts: dict = {}
    for g in groups:  # equal paths of different pairs: one LinkPath object
        for lp in g.paths:
            assert firsts.setdefault(lp, lp) is lp
    assert len(firsts) == 3  # within a node, across nodes, the planted odd one


def test_a_size_that_names_its_prompt_gets_its_own_meta(source):
    lines = source.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    recs[3]["prompt_tokens"] = 300  # a lean record of a pair: its size's meta is its own
    edited = source.parent / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in recs))
    groups, _ = read_groups([edited])
    metas = [m for g in groups for m in g.meta.values() if m is not NO_META]
    assert [sorted(m["prompt_tokens"]) for m in metas] == [[300]]
    assert not NO_META["prompt_tokens"] and not NO_META["models"]  # the shared one untouched


def test_the_read_holds_under_2_5_kb_a_pair(source):
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run = read_run([str(source)])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    per_pair = held / len(run.pairs)
    print(f"{per_pair:.0f} bytes a pair held after the read ({len(run.pairs)} pairs)")
    assert per_pair < 2500, per_pair  # (5.0 KB before groups were sealed, 10 KB before that)
