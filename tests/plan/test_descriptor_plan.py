"""`kvbench plan` and `plan export` with the per-descriptor term (kvbench.plan.descriptors).

The arithmetic is pinned on the tutorial's model (80 layers x 8 KV heads x 128 x 2 B =
327,680 B/token, one joint page per layer and block): 300 tokens at block size 16 are 19
blocks, 304 stored tokens = 99,614,720 B and 80 x 19 = 1,520 descriptors; over 10 GB/s +
1 ms setup + 0.5 us per descriptor that is 1 + 0.76 + 9.961472 = 11.721472 ms.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvbench.fit.fitting import dumps, fit_document, fit_records
from kvbench.fit.sim import CUT_POINTS, simulate_cut_run
from kvbench.plan import cli as kvplan
from tests.helpers import run
from tests.plan.helpers import export, fit_file

GBPS = ["--gbps", "10", "--setup-ms", "1", "--us-per-desc", "0.5", "--prompt-tokens", "300"]


def plan(*args) -> tuple[int, dict | str]:
    rc, out, err = run(kvplan.cli, *args)
    return rc, (json.loads(out) if rc == 0 and out.startswith("{") else out + err)


def by_hand(tokens: int, bs: int, pieces: int = 1, us: float = 0.5) -> float:
    """The floor from the arithmetic alone (no kvbench code)."""
    blocks = math.ceil(tokens / bs)
    return 1.0 + 80 * blocks * pieces * us / 1000 + blocks * bs * 327_680 / 10e9 * 1000


def test_the_tutorials_arithmetic_with_descriptors():
    rc, doc = plan(*GBPS, "--block-size", "16")
    assert rc == 0, doc
    (row,) = doc["rows"]
    assert row["kv_bytes"] == 99_614_720 and row["descriptors"] == 1_520
    assert row["descriptor_ms"] == pytest.approx(0.76)
    assert row["handoff_floor_ms"] == pytest.approx(11.721472) == pytest.approx(by_hand(300, 16))
    assert row["merged_descriptors"] == 80  # merged ids: one piece per layer
    assert row["merged_handoff_floor_ms"] == pytest.approx(1 + 0.04 + 9.961472)


@pytest.mark.parametrize("budget,smallest", [(11.75, 16), (11.7, 64), (5.0, None)])
def test_the_smallest_block_size_within_budget(budget, smallest):
    """Larger blocks post fewer descriptors but round the prompt up to whole blocks: the
    floor is not monotonic in block size (16 fits 11.75 ms, 32 does not, 64 fits 11.7)."""
    rc, doc = plan(*GBPS, "--block-size", "16", "--budget-ms", budget)
    assert doc["rows"][0]["smallest_block_size_within_budget"] == smallest
    hand = next((bs for bs in (2 ** k for k in range(11)) if by_hand(300, bs) <= budget), None)
    assert hand == smallest


def test_a_tp_pair_cuts_pages_and_shares_bytes():
    rc, doc = plan(*GBPS, "--block-size", "16", "--tp-pair", "2:1")
    row = doc["rows"][0]  # the decode rank holds every head; each page comes as 2 parts x 2 ranks
    assert row["descriptors"] == 1_520 * 4 and row["kv_bytes"] == 99_614_720
    assert row["handoff_floor_ms"] == pytest.approx(by_hand(300, 16, pieces=4))
    rc, doc = plan(*GBPS, "--block-size", "16", "--tp-pair", "1:2")
    row = doc["rows"][0]  # half the heads: half the bytes, K and V apart in the prefill's page
    assert row["kv_bytes"] == 99_614_720 // 2 and row["descriptors"] == 1_520 * 2
    assert "one decode rank" in " ".join(row["notes"])


def test_refusals():
    rc, err = plan(*GBPS, "--tp-pair", "3:1")
    assert rc == 2 and "does not divide" in err
    rc, err = plan("--fit", "x.json", "--us-per-desc", "1", "--prompt-tokens", "1")
    assert rc == 2 and "--us-per-desc is for --gbps" in err
    rc, err = plan(*GBPS[:4], "--includes-setup", "--us-per-desc", "1")
    assert rc == 2


@pytest.fixture(scope="module")
def sweep_fit(tmp_path_factory):
    recs = simulate_cut_run(np.random.default_rng(3), setup_ms=0.5, effective_gb_s=2.0, us_per_desc=1.0,
                            rounds=20, points=CUT_POINTS)
    fits, skipped = fit_records(recs, n_boot=1000, seed=0)
    path = tmp_path_factory.mktemp("fit") / "sweep.fit.json"
    path.write_text(dumps(fit_document(fits, skipped, ["sim"], 1000, 0, None)))
    return path, fits[0].record


def test_a_fitted_term_plans_with_its_band(sweep_fit):
    path, g = sweep_fit
    rc, doc = plan("--fit", path, "--model", "llama-3.1-8b", "--prompt-tokens", "256",
                   "--block-size", "4", "--budget-ms", "1000")
    row = doc["rows"][0]
    assert row["descriptors"] == 32 * 64 and row["us_per_desc"] == g["us_per_desc"]
    want = g["setup_ms"] + 256 * 131_072 / (g["effective_gb_s"] * 1e6) + 2048 * g["us_per_desc"] / 1e3
    assert row["handoff_floor_ms"] == pytest.approx(want, rel=1e-5)
    lo, hi = row["handoff_floor_ms_band95"]
    assert lo < row["handoff_floor_ms"] < hi
    assert row["measured_p50_ms"] is not None  # the sweep measured exactly this point


def test_a_link_without_the_term_says_so(tmp_path):
    rc, doc = plan("--fit", fit_file(tmp_path), "--prompt-tokens", "300", "--block-size", "16")
    row = doc["rows"][0]
    assert "descriptors" not in row and any("no per-descriptor term" in n for n in row["notes"])


def test_export_folds_the_term(sweep_fit):
    path, g = sweep_fit
    rc, out, err = export("--fit", path, "--to", "json", "--model", "llama-3.1-8b",
                          "--block-size", "16", "--fold-at-tokens", "2048")
    assert rc == 0, err
    doc = json.loads(out)
    d = doc["descriptor"]
    assert d["ms_constant"] == pytest.approx(0, abs=1e-9)  # blocks grow with the prompt
    assert d["ms_per_token"] == pytest.approx(32 / 16 * g["us_per_desc"] / 1e3)
    model = doc["handoff_ms"]["2048"]
    assert model == pytest.approx(g["setup_ms"] + 2048 * 131_072 / (g["effective_gb_s"] * 1e6)
                                  + 32 * 128 * g["us_per_desc"] / 1e3, rel=1e-6)
    blis = doc["tools"]["blis"]  # base latency + one bandwidth: exact at whole-block prompts
    assert blis["error_vs_model_ms"]["2000"] == pytest.approx(0, abs=1e-6)
    assert blis["error_vs_model_ms"]["2048"] == pytest.approx(0, abs=1e-6)
    assert "per-descriptor" in blis["cannot_represent"][0]
    dyn = doc["tools"]["dynamo"]  # no latency field: folded, exact at the fold length
    assert dyn["error_vs_model_ms"]["2048"] == pytest.approx(0, abs=1e-6)
    assert any("per-descriptor" in m for m in dyn["cannot_represent"])


def test_export_needs_the_cut_and_only_with_the_term(tmp_path, sweep_fit):
    rc, out, err = export("--fit", sweep_fit[0], "--to", "blis", "--model", "llama-3.1-8b")
    assert rc == 2 and "--block-size" in err
    rc, out, err = export("--fit", fit_file(tmp_path), "--to", "blis", "--block-size", "16")
    assert rc == 2 and "no per-descriptor term" in err


# ---------------------------------------------------------------------------
# hostile round 4 (issue 43): a term the fit carries, held and never dropped


def test_export_with_a_tp_that_cannot_shard_is_one_line(sweep_fit):
    """`--block-size 16 --tp 3` on 8 KV heads was a ShardError traceback."""
    rc, out, err = export("--fit", sweep_fit[0], "--to", "json", "--block-size", "16",
                          "--tp", "3")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvbench plan export: error: --tp 3: ") and "does not divide" in err


def test_a_fitted_term_is_never_left_out_in_silence(sweep_fit):
    """`plan --fit` with us_per_desc and no --block-size planned without the term and said
    nothing. It still plans (gpu-check's plan step reads a fit of every step, descriptor
    sweeps included), and every row says the floor leaves the term out; the table too."""
    rc, doc = plan("--fit", sweep_fit[0], "--model", "llama-3.1-8b", "--prompt-tokens", "256,2000")
    assert rc == 0, doc
    for row in doc["rows"]:
        assert "descriptors" not in row
        assert any(n.startswith("per-descriptor term left out") and "--block-size" in n
                   for n in row["notes"]), row["notes"]
    rc, table = plan("--fit", sweep_fit[0], "--model", "llama-3.1-8b", "--prompt-tokens",
                     "256", "--format", "table")
    assert rc == 0 and "per-descriptor term left out" in table, table


def _edited(tmp_path, sweep_fit, edit) -> str:
    doc = json.loads(sweep_fit[0].read_text())
    edit(doc["groups"][0])
    path = tmp_path / "edited.fit.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("edit, needle", [
    (lambda g: g.update(us_per_desc_draws=[100 * v for v in g["us_per_desc_draws"]]),
     "do not surround the estimate"),
    (lambda g: g.update(us_per_desc_draws=g["us_per_desc_draws"][:3]), "3 us_per_desc_draws beside"),
    (lambda g: g.update(us_per_desc=1e300), "us_per_desc"),
    (lambda g: g.update(us_per_desc=None), "us_per_desc_draws without us_per_desc"),
    (lambda g: g.update(us_per_desc_draws=[-2e6] * len(g["us_per_desc_draws"])), "us_per_desc_draws"),
])
def test_hand_edited_descriptor_draws_are_refused(tmp_path, sweep_fit, edit, needle):
    """Held like setup and rate draws: around the estimate, one per resample, within the
    physical bound (|us_per_desc| <= 10^6 us); 1e300 was planned as a 5e299 ms floor."""
    path = _edited(tmp_path, sweep_fit, edit)
    rc, err = plan("--fit", path, "--model", "llama-3.1-8b", "--prompt-tokens", "256",
                   "--block-size", "4")
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    rc, out, err = export("--fit", path, "--to", "json", "--model", "llama-3.1-8b",
                          "--block-size", "4")
    assert rc == 2 and needle in err, err
