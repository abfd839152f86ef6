"""The fit frame names the rate as the fit does (`effective_gb_s`), and the name it was
published under (`effective_gbps`, docs/results.md before issue 41) still reads the same
numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench import results

ROOT = Path(__file__).resolve().parents[2]
FITS = [ROOT / "tests/data/runs/shaped-link/kvbench-p2p-20261203T092334Z.fit.json",
        ROOT / "results/descriptors-2026-12-06/mpi.fit.json",
        ROOT / "results/kvbench-p2p-20261202T175443Z.fit.json"]  # kvbench.fit/1
RATE = ("effective_gb_s", "effective_gb_s_ci95_lo", "effective_gb_s_ci95_hi")
OLD = ("effective_gbps", "effective_gbps_ci95_lo", "effective_gbps_ci95_hi")


@pytest.mark.parametrize("path", FITS, ids=lambda p: p.name)
def test_group_rows_carry_the_fits_rate_under_its_own_name_and_the_old_one(path):
    doc = json.loads(path.read_text())
    f = results.load(path, kind="fit")
    assert len(f) == len(doc["groups"])
    for (_, row), g in zip(f.iterrows(), doc["groups"], strict=True):
        ci = g.get("effective_gb_s_ci95") or [None, None]
        want = [g["effective_gb_s"], *ci]
        got_new = [None if np.isnan(row[c]) else row[c] for c in RATE]
        got_old = [None if np.isnan(row[c]) else row[c] for c in OLD]
        assert got_new == want
        assert got_old == want
    for new, old in zip(RATE, OLD, strict=True):
        assert str(f[new].dtype) == str(f[old].dtype) == "float64"
    cols = list(f.columns)
    assert max(cols.index(c) for c in RATE) < min(cols.index(c) for c in OLD)  # aliases last


def test_draw_rows_name_the_rate_both_ways():
    f = results.load(FITS[0], kind="fit", samples=True)
    timed = f["ms_per_gb"] > 0  # a draw with no positive time per GB has no rate (NaN)
    assert timed.sum() > 900
    assert np.allclose(f["effective_gb_s"][timed], 1000.0 / f["ms_per_gb"][timed], rtol=1e-12)
    assert f["effective_gb_s"][~timed].isna().all()
    assert f["effective_gb_s"].equals(f["effective_gbps"])


def test_the_old_name_answers_in_the_ways_users_wrote_it():
    f = results.load(FITS[0], kind="fit")
    assert f.effective_gbps.iloc[0] == f.effective_gb_s.iloc[0]
    assert list(f[["setup_ms", "effective_gbps"]].iloc[0]) == list(f[["setup_ms", "effective_gb_s"]].iloc[0])
    assert next(f.itertuples()).effective_gbps == next(f.itertuples()).effective_gb_s


def test_the_docs_name_the_new_column_and_the_alias():
    text = (ROOT / "docs/results.md").read_text()
    assert "`effective_gb_s` and its `_ci95_lo`/`_hi`" in text
    assert "`effective_gbps`" in text  # the alias, documented
