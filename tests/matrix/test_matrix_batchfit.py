"""`kvbench matrix report` fits its pairs with kvbench.fit.batch (issue 44 item 3): the whole
document (every pair's fit, intervals, draws file, verdict) must be what fitting each pair with
fit_group gives, on benchmarks/matrix_scale.py's planted N = 8 records, with the batched path
cut into chunks of a few pairs (chunk edges inside a layout)."""

from __future__ import annotations

from pathlib import Path

from kvbench.fit import batch
from kvbench.matrix import analyze as analyze_mod
from kvbench.records.write import write_records
from tests.fit.helpers import fit_each
from tests.matrix.helpers import assert_same_document, matrix_scale_module


def _doc(path: Path, draws: list):
    return analyze_mod.analyze([str(path)], n_boot=200, seed=3, draws="file", draws_out=draws)


def test_batched_pairs_give_the_document_one_fit_per_pair_gives(tmp_path, monkeypatch):
    bench = matrix_scale_module()
    src, _ = write_records(tmp_path, list(bench.records(8, 8, 20, seed=4)), "kvbench-p2p")
    calls = []
    real = batch.fit_groups_batched
    monkeypatch.setattr(analyze_mod, "fit_groups_batched",
                        lambda groups, *a: calls.append(len(groups)) or real(groups, *a))
    monkeypatch.setattr(batch, "CHUNK_ELEMS", 200 * 5)  # chunks of 5 pairs: 56 = 11 x 5 + 1
    new_draws: list = []
    new = _doc(src, new_draws)
    assert calls == [56]
    monkeypatch.setattr(analyze_mod, "fit_groups_batched", fit_each)
    old_draws: list = []
    old = _doc(src, old_draws)
    assert_same_document(new, new_draws, old, old_draws, bench.planted(8, 8))
