"""A line whose slope is positive while most of its bootstrap draws' are not has no rate.

Seen in a real `mpirun` matrix job on a loaded machine (tests/matrix/test_matrix_mpi.py, sizes
of a few KB): one pair's fit wrote a rate beside draws whose median slope was negative, and the
matrix document's own reader refused it (kvbench.records.schema.fit.check_draws_hold), so the
whole report failed. The records below (found by seed: two sizes 1 MiB apart at 200 GB/s, 1%
noise) make such a line; the fit must write no rate with a no_rate warning that says why, by
both fit paths, and its document must read back."""

from __future__ import annotations

import json

import kvbench.fit.cli
from kvbench.fit.batch import fit_groups_batched
from kvbench.fit.data import group_records
from kvbench.fit.fitting import fit_group
from kvbench.records.schema.fit import load_fit_document
from tests.helpers import rounds_records, run, write_jsonl


def records() -> list[dict]:
    return rounds_records([1 << 20, 2 << 20], 1.0, 200.0, rounds=20, noise=0.01, round_shift=0.0,
                          seed=179)


def test_the_line_is_positive_and_its_draws_median_is_not():
    line = fit_group(group_records(records())[0], 1000, 0, None).line
    slopes = sorted(line.draws[:, 1])
    assert line.ms_per_gb > 0 and slopes[len(slopes) // 2] <= 0  # the case, as the reader sees it
    assert line.slope_unresolved and line.effective_gb_s is None


def test_no_rate_by_both_fit_paths_with_the_reason():
    group = group_records(records())[0]
    one = fit_group(group, 1000, 0, None).record
    (batched,) = fit_groups_batched([group], 1000, 0)
    for rec in (one, batched):
        assert rec["effective_gb_s"] is None
        assert any(w["code"] == "no_rate" and "median slope is not positive" in w["message"]
                   for w in rec["warnings"]), rec["warnings"]


def test_its_fit_document_is_written_and_reads_back(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", records())
    rc, _, err = run(kvbench.fit.cli.cli, src, "--out", tmp_path / "r.fit.json")
    assert rc == 0, err
    doc = load_fit_document(tmp_path / "r.fit.json")
    (g,) = json.loads((tmp_path / "r.fit.json").read_text())["groups"]
    assert g["effective_gb_s"] is None and g["draws"] and len(doc.groups) == 1


def test_in_a_stack_of_ordinary_pairs_the_batch_fits_it_as_fit_group_does():
    """The batch takes every line's median slope draw in one partition along the stack: the
    unresolved line among resolved ones gets fit_group's record, and so do they."""
    ordinary = [rounds_records([1 << 20, 2 << 20], 1.0, 2.0, rounds=20, noise=0.01,
                               round_shift=0.0, seed=s) for s in (1, 2)]
    groups = [group_records(r)[0] for r in (ordinary[0], records(), ordinary[1])]
    got = fit_groups_batched(groups, 1000, 0)
    assert [g["effective_gb_s"] is None for g in got] == [False, True, False]
    assert got == [fit_group(g, 1000, 0, None).record for g in groups]
