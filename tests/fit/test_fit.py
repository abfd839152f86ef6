"""kvbench fit, through the CLI a user runs, on p2p record files written in tmp_path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbench.fit.data import spec_id
from tests.conftest import run_cli
from tests.fit.helpers import fit, near
from tests.helpers import SPEC, p2p_record, rounds_records, synthetic, write_jsonl

GB = 1e9


SIZES = [1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]


def codes(g: dict) -> list[str]:
    return [w["code"] for w in g["warnings"]]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_recovers_known_setup_and_rate_within_intervals(tmp_path, seed):
    setup, rate = 0.8, 2.5
    doc, stdout = fit(tmp_path, rounds_records(SIZES, setup, rate, seed=seed), boot=1000)
    assert doc["schema"] == "kvbench.fit/2"
    (g,) = doc["groups"]
    for key, truth in (("setup_ms", setup), ("effective_gb_s", rate)):
        lo, hi = g[f"{key}_ci95"]
        assert lo <= g[key] <= hi and near(truth, (lo, hi)), (key, g[key], lo, hi)
    assert g["setup_ms"] == pytest.approx(setup, rel=0.03)
    assert g["effective_gb_s"] == pytest.approx(rate, rel=0.02)
    assert g["n_samples"] == 5 * 20 and g["n_sizes"] == 5
    assert g["resampling"]["n_rounds"] == 20 and g["resampling"]["unit"] == "round"
    assert g["bytes_min"] == SIZES[0] and g["bytes_max"] == SIZES[-1]
    assert g["spec"] == SPEC and g["spec_id"] == spec_id(SPEC)
    assert g["lack_of_fit"]["df"] == 3 and g["lack_of_fit"]["p_value"] > 0.01
    assert codes(g) == []
    assert "r2" not in g and "r2_inliers" not in g
    assert "interval: 1000 draws resampling rounds" in stdout


def test_intervals_are_percentiles_of_the_saved_joint_draws(tmp_path):
    doc, _ = fit(tmp_path, rounds_records(SIZES, 0.8, 2.5, seed=4), boot=500)
    (g,) = doc["groups"]
    d = np.array(g["draws"]["values"])
    assert g["draws"]["columns"] == ["setup_ms", "ms_per_gb"] and d.shape == (500, 2)
    assert np.percentile(d[:, 0], [2.5, 97.5]) == pytest.approx(g["setup_ms_ci95"], rel=1e-4)
    slope = np.percentile(d[:, 1], [97.5, 2.5])
    assert 1000 / slope == pytest.approx(g["effective_gb_s_ci95"], rel=1e-4)
    # a band from the joint draws is narrower than one from the two intervals' ends
    x = (1 << 22) / GB
    lo, hi = np.percentile(d[:, 0] + d[:, 1] * x, [2.5, 97.5])
    s_lo, s_hi = g["setup_ms_ci95"]
    m_lo, m_hi = np.percentile(d[:, 1], [2.5, 97.5])
    assert s_lo + m_lo * x < lo < hi < s_hi + m_hi * x


def test_stalls_do_not_drag_the_fit(tmp_path):
    # Heavy stalls on the largest size: least squares on the samples is pulled far off,
    # the line through the medians is not.
    recs = synthetic(SIZES, 0.5, 4.0, seed=7, outliers=0.0)
    big = recs[-1]["samples_ms"]
    for i in range(0, 40, 6):
        big[i] *= 8
    doc, _ = fit(tmp_path, recs)
    (g,) = doc["groups"]
    x = np.concatenate([[r["bytes"]] * len(r["samples_ms"]) for r in recs]) / GB
    y = np.concatenate([r["samples_ms"] for r in recs])
    ols_rate = 1000 / np.polyfit(x, y, 1)[0]
    assert abs(ols_rate / 4.0 - 1) > 0.3  # least squares is dragged
    assert g["effective_gb_s"] == pytest.approx(4.0, rel=0.02)
    assert g["setup_ms"] == pytest.approx(0.5, rel=0.05)


def test_sizes_table_and_stdout_table(tmp_path):
    recs = synthetic(SIZES[:3], 0.3, 1.0, seed=4)
    doc, stdout = fit(tmp_path, recs)
    (g,) = doc["groups"]
    for row, rec in zip(g["sizes"], recs, strict=True):
        assert row["bytes"] == rec["bytes"]
        assert row["n"] == len(rec["samples_ms"]) == 40
        assert row["p50_ms"] == pytest.approx(np.percentile(rec["samples_ms"], 50), rel=1e-5)
        assert row["p95_ms"] == pytest.approx(np.percentile(rec["samples_ms"], 95), rel=1e-5)
        assert row["p99_ms"] is None  # 40 samples cannot support a p99
        assert row["fitted_ms"] == pytest.approx(g["setup_ms"] + row["bytes"] / (
            g["effective_gb_s"] * GB) * 1000, rel=1e-4)
        assert row["residual_ms"] == pytest.approx(row["p50_ms"] - row["fitted_ms"], abs=1e-5)
    assert g["sources"] == [str(tmp_path / "run.jsonl")]
    assert doc["inputs"] == [str(tmp_path / "run.jsonl")]
    assert "effective GB/s" in stdout and f"{g['effective_gb_s']:.5g}" in stdout
    assert "transport=gloo" in stdout and "1,048,576" in stdout
    assert "n<100" in stdout and "p99 ms" in stdout
    assert "wrote " in stdout


@pytest.mark.parametrize("n, p95, p99", [(19, False, False), (20, True, False),
                                         (100, True, True)])
def test_percentiles_only_where_the_sample_count_supports_them(tmp_path, n, p95, p99):
    doc, _ = fit(tmp_path, synthetic(SIZES[:2], 0.3, 1.0, n=n, seed=5))
    for row in doc["groups"][0]["sizes"]:
        assert row["n"] == n
        assert (row["p95_ms"] is not None) is p95 and (row["p99_ms"] is not None) is p99


def test_groups_split_by_method_and_optional_keys(tmp_path):
    recs = (synthetic(SIZES[:3], 0.2, 3.0, seed=1)
            + synthetic(SIZES[:3], 0.05, 9.0, seed=2, transport="mpi")
            + synthetic(SIZES[:3], 0.2, 1.5, seed=3, transport="nixl", nixl_op="READ", tp=2)
            + synthetic(SIZES[:3], 0.2, 3.0, seed=4, hosts=["a", "b"]))
    doc, stdout = fit(tmp_path, recs)
    groups = {(g["group"]["transport"], tuple(g["group"]["hosts"])): g for g in doc["groups"]}
    assert len(groups) == 4
    assert groups[("nixl", ("node-a", "node-a"))]["group"]["nixl_op"] == "READ"
    assert groups[("nixl", ("node-a", "node-a"))]["group"]["tp"] == 2
    assert groups[("mpi", ("node-a", "node-a"))]["group"]["tp"] is None
    assert groups[("mpi", ("node-a", "node-a"))]["effective_gb_s"] == pytest.approx(9.0, rel=0.03)
    assert groups[("gloo", ("a", "b"))]["effective_gb_s"] == pytest.approx(3.0, rel=0.03)
    assert stdout.count("effective GB/s") == 4
    # --where keeps only one group
    res = run_cli("kvbench.fit", str(tmp_path / "run.jsonl"), "--where", "transport=mpi",
                  "--out", str(tmp_path / "mpi.json"))
    assert res.returncode == 0, res.stderr
    only = json.loads((tmp_path / "mpi.json").read_text())["groups"]
    assert [g["group"]["transport"] for g in only] == ["mpi"]


def test_the_spec_is_the_group_key_and_replicates_merge(tmp_path):
    cuda = {**SPEC, "pack_kernel": "cuda"}
    recs = (rounds_records(SIZES, 0.5, 2.0, seed=1, run_id="a")
            + rounds_records(SIZES, 0.5, 2.0, seed=2, run_id="b")  # a replicate: merged
            + rounds_records(SIZES, 0.2, 6.0, seed=3, run_id="c", spec=cuda))
    doc, _ = fit(tmp_path, recs)
    by_kernel = {g["group"]["pack_kernel"]: g for g in doc["groups"]}
    assert set(by_kernel) == {None, "cuda"}  # one option apart: never pooled
    assert by_kernel[None]["resampling"]["n_rounds"] == 40
    assert by_kernel[None]["n_records"] == 10 and by_kernel["cuda"]["n_records"] == 5
    assert by_kernel["cuda"]["spec_id"] == spec_id(cuda) != by_kernel[None]["spec_id"]
    assert by_kernel["cuda"]["effective_gb_s"] == pytest.approx(6.0, rel=0.03)
    assert by_kernel[None]["group"]["world.size"] == 2
    res = run_cli("kvbench.fit", str(tmp_path / "run.jsonl"), "--where", "pack_kernel=cuda",
                  "--out", str(tmp_path / "cuda.json"))
    assert res.returncode == 0, res.stderr
    (only,) = json.loads((tmp_path / "cuda.json").read_text())["groups"]
    assert only["spec"]["pack_kernel"] == "cuda"


def test_one_run_in_blocks_gives_no_interval_and_says_why(tmp_path):
    doc, stdout = fit(tmp_path, synthetic(SIZES, 0.8, 2.5, seed=1))
    (g,) = doc["groups"]
    assert g["setup_ms"] == pytest.approx(0.8, rel=0.05)
    assert g["setup_ms_ci95"] is None and g["effective_gb_s_ci95"] is None and g["draws"] is None
    assert "1 back-to-back block(s)" in g["no_interval"] and "--order rounds" in g["no_interval"]
    assert "no_interval" in codes(g)
    assert g["resampling"]["n_blocks"] == 5 and g["resampling"]["n_draws"] == 0
    # the lack-of-fit test still runs, against the within-size scatter
    assert g["lack_of_fit"]["scatter_from"].startswith("within-size samples")
    assert "no interval: 1 back-to-back block(s)" in stdout


def test_three_runs_in_blocks_give_an_interval(tmp_path):
    recs = [r for seed in (1, 2, 3) for r in synthetic(SIZES, 0.8, 2.5, seed=seed)]
    doc, stdout = fit(tmp_path, recs)
    (g,) = doc["groups"]
    assert g["resampling"]["n_blocks"] == 15 and g["resampling"]["unit"] == "(record, size) block"
    lo, hi = g["effective_gb_s_ci95"]
    assert lo <= g["effective_gb_s"] <= hi and near(2.5, (lo, hi))


def test_too_few_rounds_give_no_interval(tmp_path):
    doc, _ = fit(tmp_path, rounds_records(SIZES, 0.8, 2.5, rounds=8))
    (g,) = doc["groups"]
    assert g["effective_gb_s_ci95"] is None
    assert g["no_interval"].startswith("only 8 round(s)")


def test_lack_of_fit_is_flagged_and_widens_the_interval(tmp_path):
    # The same link, but each size's median planted 6% off the line in alternating directions:
    # a per-size effect no number of rounds averages away.
    bump = {b: (1.06 if i % 2 else 0.94) for i, b in enumerate(SIZES)}

    def bent(b):
        return (0.8 + b / 2.5e9 * 1e3) * bump[b]

    straight, _ = fit(tmp_path, rounds_records(SIZES, 0.8, 2.5, seed=3), name="straight.jsonl")
    planted, stdout = fit(tmp_path, rounds_records(SIZES, 0, 0, seed=3, time_fn=bent),
                          name="bent.jsonl")
    (s,), (p,) = straight["groups"], planted["groups"]
    assert "lack_of_fit" not in codes(s) and s["lack_of_fit"]["p_value"] > 0.01
    assert "lack_of_fit" in codes(p) and p["lack_of_fit"]["p_value"] < 1e-6
    assert p["lack_of_fit"]["size_scatter_rel"] > 0.03
    assert max(abs(r["residual_rel"]) for r in p["sizes"]) > 0.04
    width = {k: g["effective_gb_s_ci95"][1] - g["effective_gb_s_ci95"][0]
             for k, g in (("s", s), ("p", p))}
    assert width["p"] > 3 * width["s"]
    assert near(2.5, p["effective_gb_s_ci95"])  # the wider interval is still about the rate
    assert "lack of fit: Q" in stdout


def test_negative_intercept_is_warned(tmp_path):
    # A token bucket lets the first bytes through free: time = bytes/rate - burst/rate.
    doc, _ = fit(tmp_path, synthetic(SIZES[1:], -0.3, 2.0, seed=5, noise=0.01))
    (g,) = doc["groups"]
    assert g["setup_ms"] < 0
    assert "negative_intercept" in codes(g)


def test_intercept_indistinguishable_from_zero_is_warned(tmp_path):
    # Large payloads only: a 0.2 ms setup is lost in the noise of 8..33 ms transfers.
    doc, _ = fit(tmp_path, rounds_records([1 << 24, 1 << 25, 1 << 26], 0.2, 2.0, seed=9,
                                          noise=0.05), boot=1000)
    (g,) = doc["groups"]
    lo, hi = g["setup_ms_ci95"]
    assert hi - lo > 3 * 0.2  # the setup is lost in the noise (seeds 9-16: 1.1 to 7.7 ms wide)
    assert {"negative_intercept", "intercept_not_distinguishable_from_zero"} & set(codes(g))
    if lo <= 0 <= hi:  # and whenever the interval holds zero, the fit says so
        assert "intercept_not_distinguishable_from_zero" in codes(g)


def _eager_then_rendezvous(b):
    """Small messages: 0.02 ms + bytes at 1 GB/s; large: 0.5 ms + bytes at 5 GB/s (the lines
    cross at 600,000 B)."""
    return 0.02 + b / 1e9 * 1e3 if b < 600_000 else 0.5 + b / 5e9 * 1e3


def test_two_regimes_are_found_with_both_fits_and_the_break_interval(tmp_path):
    sizes = [1 << k for k in range(12, 27, 2)]
    doc, stdout = fit(tmp_path, rounds_records(sizes, 0, 0, seed=8, time_fn=_eager_then_rendezvous),
                      boot=1000)
    (g,) = doc["groups"]
    tr = g["two_regimes"]
    assert tr is not None, g["warnings"]
    assert "two_regimes" in codes(g)
    assert tr["bic_two_lines"] < tr["bic_one_line"]
    assert tr["break_between_bytes"] == [1 << 18, 1 << 20]
    lo, hi = tr["break_ci95_bytes"]
    assert (1 << 18) <= lo <= hi <= (1 << 20) and near(600_000, (lo, hi))
    assert tr["break_gap_share"] > 0.9
    assert tr["small"]["effective_gb_s"] == pytest.approx(1.0, rel=0.05)
    assert tr["large"]["effective_gb_s"] == pytest.approx(5.0, rel=0.03)
    assert tr["large"]["setup_ms"] == pytest.approx(0.5, rel=0.1)
    assert near(5.0, tr["large"]["effective_gb_s_ci95"])
    assert len(tr["large"]["draws"]["values"]) == 1000
    assert "small regime" in stdout and "large regime" in stdout


@pytest.mark.parametrize("seed", [9, 10, 11])
def test_no_two_regimes_on_one_line(tmp_path, seed):
    sizes = [1 << k for k in range(12, 27, 2)]
    doc, _ = fit(tmp_path, rounds_records(sizes, 0.3, 5.0, seed=seed, noise=0.05))
    assert doc["groups"][0]["two_regimes"] is None


def test_rate_above_declared_line_rate_is_a_bug(tmp_path):
    recs = synthetic(SIZES, 0.2, 20.0, seed=10)
    doc, stdout = fit(tmp_path, recs, "--line-rate-gbps", "12.5")
    (g,) = doc["groups"]
    assert doc["line_rate_gb_s"] == 12.5
    assert "rate_above_line_rate" in codes(g)
    assert "measurement bug" in stdout
    doc, _ = fit(tmp_path, recs, "--line-rate-gbps", "25", name="again.jsonl")
    assert "rate_above_line_rate" not in codes(doc["groups"][0])


def _layerwise(variant):
    """Records as a legacy layerwise run writes them (no fit_as_link field)."""
    extra = {"variant": variant} if variant else {}
    seed = {"compute": 1, "xfer": 2, "seq": 3, None: 4}[variant]
    recs = synthetic(SIZES[:3], 0.2, 3.0, seed=seed, pattern="layerwise", **extra)
    if variant == "compute":
        for r in recs:
            r["bytes"] = 0
    return recs


def test_groups_that_are_not_links_are_skipped_with_a_note(tmp_path):
    """A folder with sequential, layerwise and sharded runs: the links are fitted, the rest named."""
    recs = (synthetic(SIZES[:3], 0.2, 3.0, seed=1)
            + _layerwise("compute") + _layerwise("xfer") + _layerwise("seq") + _layerwise(None)
            + synthetic(SIZES[:3], 0.2, 1.0, seed=2, pattern="sharded", variant="isolated", tp=2)
            + synthetic(SIZES[:3], 0.2, 1.8, seed=3, pattern="sharded", variant="contended", tp=2)
            + rounds_records(SIZES[:3], 0.2, 3.0, spec={**SPEC, "pattern": "layerwise"}))
    for r in recs[-3:]:  # a new record that declares itself not a link
        r.update(fit_as_link=False, not_link_reason="layerwise total includes compute")
    src = write_jsonl(tmp_path / "folder.jsonl", recs)
    out = tmp_path / "folder.fit.json"
    res = run_cli("kvbench.fit", str(src), "--out", str(out), "--bootstrap", "200")
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    fitted = {(g["group"]["pattern"], g["group"].get("variant")) for g in doc["groups"]}
    assert fitted == {("sequential", None), ("layerwise", "xfer"), ("layerwise", "seq"),
                      ("sharded", "contended")}
    reasons = {s["label"]: s["reason"] for s in doc["skipped"]}
    assert len(reasons) == 4
    assert any("zero bytes" in r for r in reasons.values())
    assert any("isolated" in r and "never observed" in r for r in reasons.values())
    assert "layerwise total includes compute" in reasons.values()
    note = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(note) == 1 and note[0].startswith("kvbench fit: note: skipped 4 group(s)")
    # nothing but non-links: one line, exit 2
    (tmp_path / "alone").mkdir()
    only = write_jsonl(tmp_path / "alone" / "compute.jsonl", _layerwise("compute"))
    assert "nothing to fit: no group is a link" in _bad(tmp_path / "alone", str(only))


def test_records_with_wrong_bytes_are_excluded(tmp_path):
    recs = synthetic(SIZES[:3], 0.2, 3.0, seed=11)
    bad = p2p_record(1 << 26, [0.001] * 10, wrong=17)  # would wreck the fit if used
    doc, _ = fit(tmp_path, recs + [bad])
    (g,) = doc["groups"]
    assert g["n_sizes"] == 3 and g["n_records"] == 4
    assert "excluded_wrong" in [w["code"] for w in g["warnings"]]
    assert g["effective_gb_s"] == pytest.approx(3.0, rel=0.03)


def test_default_output_beside_input_never_overwrites(tmp_path):
    src = write_jsonl(tmp_path / "kvbench-p2p-20260101T000000Z.jsonl",
                      synthetic(SIZES[:3], 0.2, 3.0, n=10))
    first = run_cli("kvbench.fit", str(src), "--bootstrap", "100")
    second = run_cli("kvbench.fit", str(src), "--bootstrap", "100")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    a = tmp_path / "kvbench-p2p-20260101T000000Z.fit.json"
    b = tmp_path / "kvbench-p2p-20260101T000000Z.fit-1.json"
    assert a.exists() and b.exists()
    assert json.loads(a.read_text())["groups"] == json.loads(b.read_text())["groups"]
    again = run_cli("kvbench.fit", str(src), "--out", str(a))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    src = write_jsonl(tmp_path / "r.jsonl", synthetic(SIZES, 0.4, 2.0, seed=12, n=15))
    png = tmp_path / "r.png"
    res = run_cli("kvbench.fit", str(src), "--plot", str(png), "--bootstrap", "200")
    assert res.returncode == 0, res.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    res = run_cli("kvbench.fit", str(src), "--plot", str(png))
    assert res.returncode == 2 and "refusing to overwrite" in res.stderr


def _bad(tmp_path, *args):
    res = run_cli("kvbench.fit", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbench fit: error:"), res.stderr
    assert "Traceback" not in res.stderr
    assert not list(tmp_path.glob("*.fit*.json"))
    return lines[0]


def test_bad_input_missing_file(tmp_path):
    assert "no such file" in _bad(tmp_path, str(tmp_path / "nope.jsonl"))


def test_bad_input_unreadable_file(tmp_path):
    p = tmp_path / "binary.jsonl"
    p.write_bytes(b"\xff\xfe\x00garbage")
    assert "cannot read" in _bad(tmp_path, str(p))
    assert "directory" in _bad(tmp_path, str(tmp_path))


def test_bad_input_unknown_schema(tmp_path):
    rec = p2p_record(1 << 20, [1.0, 1.1], schema="kvbench.p2p/9")
    p = write_jsonl(tmp_path / "future.jsonl", [rec])
    assert "unknown schema 'kvbench.p2p/9'" in _bad(tmp_path, str(p))


def test_bad_input_empty_file_and_empty_group(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "no records" in _bad(tmp_path, str(empty))
    allwrong = write_jsonl(tmp_path / "wrong.jsonl",
                           [p2p_record(1 << 20, [1.0, 1.1], wrong=3),
                            p2p_record(1 << 22, [], wrong=0)])
    msg = _bad(tmp_path, str(allwrong))
    assert "is empty" in msg and "1 with wrong received elements" in msg and "1 without samples" in msg


def test_bad_input_malformed_samples_and_where(tmp_path):
    p = write_jsonl(tmp_path / "neg.jsonl", [p2p_record(1 << 20, [1.0, -2.0])])
    assert "samples_ms" in _bad(tmp_path, str(p))
    ok = write_jsonl(tmp_path / "ok.jsonl", synthetic(SIZES[:2], 0.1, 1.0, n=5))
    assert "no group matches --where transport=nccl" in _bad(tmp_path, str(ok), "--where",
                                                             "transport=nccl")
    assert "unknown key 'colour'" in _bad(tmp_path, str(ok), "--where", "colour=red")
    assert "--line-rate-gbps" in _bad(tmp_path, str(ok), "--line-rate-gbps", "fast")


def test_bad_input_rounds_without_their_round_numbers(tmp_path):
    # the typed record (kvbench.records.schema.p2p) names the file and line
    recs = rounds_records(SIZES[:2], 0.1, 1.0)
    recs[1]["sample_rounds"] = recs[1]["sample_rounds"][:-1]
    p = write_jsonl(tmp_path / "short.jsonl", recs)
    assert "short.jsonl:2: sample_rounds has 19 entries for 20 samples_ms" in _bad(tmp_path, str(p))
    recs = rounds_records(SIZES[:2], 0.1, 1.0)
    recs[0]["order"] = "spiral"
    p = write_jsonl(tmp_path / "spiral.jsonl", recs)
    assert "spiral.jsonl:1: order: must be 'rounds' or 'blocks', got 'spiral'" in _bad(tmp_path, str(p))
    recs = rounds_records(SIZES[:2], 0.1, 1.0)
    del recs[1]["sample_rounds"]
    p = write_jsonl(tmp_path / "none.jsonl", recs)
    assert "record 2 of group [" in (msg := _bad(tmp_path, str(p))) and "one round number" in msg


def test_four_bent_sizes_are_a_poor_fit_not_two_regimes(tmp_path):
    # Two lines through 2 + 2 medians always fit: four sizes cannot show two regimes,
    # but the misfit of one line must still be reported.
    def t(b):
        return 0.02 + b / 1e9 * 1e3 if b < 600_000 else 0.5 + b / 5e9 * 1e3

    doc, stdout = fit(tmp_path, synthetic([1 << 14, 1 << 18, 1 << 22, 1 << 24], 0, 0, seed=13,
                                          time_fn=t, n=30))
    (g,) = doc["groups"]
    assert g["two_regimes"] is None
    assert "poor_fit" in [w["code"] for w in g["warnings"]]
    assert max(abs(row["residual_rel"]) for row in g["sizes"]) > 0.10
