"""The three-term fit (kvbench.fit.descriptors): one link's cuts fitted together.

Synthetic sweeps (kvbench.fit.sim.simulate_cut_run: 2 sizes x 5 block sizes in interleaved
rounds, the fit's usual correlated load) with a planted per-descriptor cost: the 95%
interval must cover it in at least 90% of seeded runs, and the same check must fail when the
truth it is held against is off by 30% (the check can fail). A count proportional to bytes
must get "cannot separate", not a number. About 3 s on the 2-core development VM.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbench.fit.fitting import dumps, fit_document, fit_records, format_table
from kvbench.fit.sim import CUT_POINTS, JOINED_POINTS, Load, simulate_cut_run
from kvbench.records.schema.fit import load_fit_document

TRUTH = {"setup_ms": 0.5, "effective_gb_s": 2.0, "us_per_desc": 1.0}
RUNS = 100
REQUIRED = 0.90


def fit_one(records, **kw):
    (gf,), skipped = fit_records(records, n_boot=1000, seed=0, **kw)
    return gf.record


def covers(ci, truth) -> bool:
    return ci is not None and ci[0] <= truth <= ci[1]


def sweep(seed: int, points=CUT_POINTS, **kw) -> list[dict]:
    rng = np.random.default_rng([seed, 31])
    return simulate_cut_run(rng, rounds=20, points=points, **{**TRUTH, **kw})


@pytest.fixture(scope="module")
def fitted():
    return [fit_one(sweep(seed)) for seed in range(RUNS)]


def test_interval_covers_the_planted_cost(fitted):
    us = [covers(r["us_per_desc_ci95"], TRUTH["us_per_desc"]) for r in fitted]
    setup = [covers(r["setup_ms_ci95"], TRUTH["setup_ms"]) for r in fitted]
    rate = [covers(r["effective_gb_s_ci95"], TRUTH["effective_gb_s"]) for r in fitted]
    assert np.mean(us) >= REQUIRED, np.mean(us)
    assert np.mean(setup) >= REQUIRED and np.mean(rate) >= REQUIRED, (np.mean(setup), np.mean(rate))
    assert all(r["descriptor_term"]["separable"] and r["descriptor_field"] == "descriptors"
               for r in fitted)


def test_the_coverage_check_can_fail(fitted):
    """Held against a truth 30% off, the same intervals cover it far less often than 90%."""
    wrong = [covers(r["us_per_desc_ci95"], 1.3 * TRUTH["us_per_desc"]) for r in fitted]
    assert np.mean(wrong) < 0.5, np.mean(wrong)


def test_a_round_stays_one_unit_across_cuts():
    """Every cut of one run was timed in the same rounds: 20 rounds, not 20 per cut."""
    rec = fit_one(sweep(0))
    assert rec["resampling"]["n_rounds"] == 20 and rec["resampling"]["n_blocks"] == 0
    assert len(rec["cuts"]) == 5 and rec["n_sizes"] == len(CUT_POINTS)
    assert rec["spec"] is None and "block_size" not in rec["group"]


def test_count_proportional_to_bytes_cannot_separate():
    """Two cuts whose counts are 2 per token at every size: the count moves with the bytes."""
    points = [(t * 131_072, bs, 2 * t) for t, bs in ((64, 16), (128, 16), (256, 32), (512, 32))]
    rec = fit_one(sweep(1, points))
    assert rec["us_per_desc"] is None and rec["us_per_desc_ci95"] is None
    term = rec["descriptor_term"]
    assert not term["separable"] and term["r2_descriptors_on_bytes"] > 0.99
    assert "moves with the bytes" in term["reason"]
    codes = [w["code"] for w in rec["warnings"]]
    assert "descriptor_term_not_separable" in codes
    # setup and rate are still fitted: with this design the descriptor cost is inside them
    per_byte = 1 / (TRUTH["effective_gb_s"] * 1e6) + 2 / 131_072 * TRUTH["us_per_desc"] / 1e3  # ms per byte
    assert rec["effective_gb_s"] == pytest.approx(1 / (per_byte * 1e6), rel=0.1)
    assert "cannot separate" in format_table(fit_document(*fit_records(sweep(1, points)), ["x"], 1000, 0, None))


def test_one_count_everywhere_cannot_separate():
    points = [(t * 131_072, bs, 32) for t, bs in ((64, 16), (256, 64))]
    rec = fit_one(sweep(2, points))
    assert rec["us_per_desc"] is None and "does not vary" in rec["descriptor_term"]["reason"]


def test_one_size_separates_the_count_not_the_rate():
    points = [p for p in CUT_POINTS if p[0] == CUT_POINTS[0][0]]
    rec = fit_one(sweep(3, points))
    assert covers(rec["us_per_desc_ci95"], 1.0) or rec["us_per_desc"] == pytest.approx(1.0, rel=0.3)
    assert rec["effective_gb_s"] is None and rec["setup_ms"] is None
    assert rec["time_without_descriptors_ms"] == pytest.approx(0.5 + 8_388_608 / 2e6, rel=0.1)
    assert "fewer_than_two_sizes" in [w["code"] for w in rec["warnings"]]


def test_where_one_cut_keeps_the_two_term_fit():
    (gf,), _ = fit_records(sweep(4), n_boot=200, seed=0, where={"block_size": "2"})
    assert "descriptor_term" not in gf.record and gf.record["spec"]["block_size"] == 2


def test_records_without_descriptors_are_not_merged():
    recs = sweep(5)
    for r in recs:
        del r["descriptors"]
    fits, _ = fit_records(recs, n_boot=200, seed=0)
    assert len(fits) == 5 and all("descriptor_term" not in f.record for f in fits)


def test_a_transport_that_joins_descriptors_gets_two_terms():
    """NIXL joins contiguous ids: each list entry costs, and each descriptor left after the
    join costs more. Both planted costs are covered (40 sweeps, >= 90%)."""
    hits = []
    for seed in range(40):
        rec = fit_one(sweep(200 + seed, JOINED_POINTS, us_per_desc=0.8, us_per_merged_desc=1.5))
        hits.append((covers(rec["us_per_desc_ci95"], 0.8),
                     covers(rec["us_per_merged_desc_ci95"], 1.5)))
    assert rec["descriptor_field"] == "descriptors, descriptors_merged"
    assert rec["descriptor_term"]["merged"]["separable"]
    assert {r["descriptors_merged"] for r in rec["sizes"]} >= {32}
    assert np.mean(hits, axis=0).min() >= REQUIRED, np.mean(hits, axis=0)


def test_joined_counts_alone_are_not_a_second_term():
    """Where the transport joined nothing (every merged count equals the posted one), one term."""
    recs = sweep(6)
    for r in recs:
        r["descriptors_merged"] = r["descriptors"]
    rec = fit_one(recs)
    assert rec["descriptor_field"] == "descriptors" and "us_per_merged_desc" not in rec


def test_the_document_reads_back_and_plans_with_the_term(tmp_path):
    fits, skipped = fit_records(sweep(7), n_boot=1000, seed=0)
    path = tmp_path / "sweep.fit.json"
    path.write_text(dumps(fit_document(fits, skipped, ["sim"], 1000, 0, None)))
    g = load_fit_document(path).groups[0].model_dump()
    assert len(g["us_per_desc_draws"]) == len(g["draws"]["values"]) == 1000
    assert json.loads(path.read_text())["groups"][0]["us_per_desc"] == g["us_per_desc"]


def test_a_heavy_load_still_covers():
    """Bigger per-point shifts and stalls: wider intervals, still honest (30 runs, >= 80%)."""
    load = Load(round_shift=0.05, size_shift=0.04, noise=0.04, stall=0.1, round_stall=0.1)
    hits = [covers(fit_one(sweep(100 + s, load=load))["us_per_desc_ci95"], 1.0) for s in range(30)]
    assert np.mean(hits) >= 0.8, np.mean(hits)
