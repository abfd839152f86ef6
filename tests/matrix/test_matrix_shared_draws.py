"""The matrix's pairs share one drawing of the bootstrap's unit counts (issue 44 item 3): every
pair is fitted from the same seed, so pairs with the same rounds drew the same counts one by
one; now they are drawn once and the generator is left where drawing leaves it. The whole
document (fits, intervals, draws, verdict) must be what drawing each pair anew gives, on
planted N = 8 and N = 16 matrices (benchmarks/matrix_scale.py's records)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvbench.fit import stats
from kvbench.matrix.analyze import analyze
from kvbench.records.write import write_records
from tests.matrix.helpers import assert_same_document, matrix_scale_module


def _doc(path: Path, draws: list):
    return analyze([str(path)], n_boot=200, seed=3, draws="file", draws_out=draws)


@pytest.mark.parametrize("n", [8, pytest.param(16, marks=pytest.mark.slow)])
def test_shared_counts_give_the_document_drawing_each_pair_gives(tmp_path, monkeypatch, n):
    bench = matrix_scale_module()
    src, _ = write_records(tmp_path, list(bench.records(n, 8, 12, seed=n)), "kvbench-p2p")
    new_draws: list = []
    new = _doc(src, new_draws)
    stats._KEPT_COUNTS.clear()
    monkeypatch.setattr(stats, "unit_counts", stats.draw_unit_counts)  # each pair anew
    old_draws: list = []
    old = _doc(src, old_draws)
    assert_same_document(new, new_draws, old, old_draws, bench.planted(n, 8))


def test_a_kept_draw_leaves_the_generator_where_drawing_leaves_it():
    g = stats.GroupSamples(bytes=np.repeat([1, 2], 12), ms=np.ones(24), unit=np.arange(24),
                           stratum=np.zeros(24, dtype=int), stratum_kind=["rounds"])
    stats._KEPT_COUNTS.clear()
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    first = stats.unit_counts(g, 50, a)
    again = stats.unit_counts(g, 50, b)  # kept: not drawn
    assert again is first and not again.flags.writeable
    assert a.random() == b.random()
    fresh = np.random.default_rng(5)
    assert np.array_equal(stats.draw_unit_counts(g, 50, fresh), first)
    other = stats.unit_counts(g, 50, np.random.default_rng(6))  # another state: drawn
    assert not np.array_equal(other, first)
