"""Ground truth: the fit's estimate of a link shaped to a known rate.

Runs benchmarks/shaped_link.py: a private network namespace whose loopback is shaped with
`tc ... tbf rate 400mbit`, the p2p benchmark over gloo (TCP) across five payload sizes,
kvbench fit, and a check against the payload rate the shaper allows (400 Mbit/s = 0.05
GB/s times the payload fraction left after Ethernet/IP/TCP headers and ACKs, 0.99397 at MTU
16384): the estimate is within 5% of it and inside its own interval. Whether one run's 95%
interval contains the rate is NOT asserted: by construction it misses about one run in 20;
coverage is a property across runs, measured by benchmarks/fit_coverage.py. Needs root,
iproute2 and network namespaces; skips with the reason where it cannot run. The namespace is
always removed, and this test checks that it was.

Timing-sensitive: on a machine whose cores are busy with other work, CPU contention adds
time to handoffs, and the run takes 30-60 s (p2p runs three times when it has no rounds order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, committed

SCRIPT = ROOT / "benchmarks" / "shaped_link.py"


def _script():
    spec = importlib.util.spec_from_file_location("shaped_link", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

needs_shaping = [
    pytest.mark.root,
    pytest.mark.mpi,
    pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0,
                       reason="needs root to create a network namespace and shape it with tc"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="needs iproute2 ('ip' and 'tc')"),
    pytest.mark.skipif(not (ROOT / "kvbench" / "p2p" / "cli.py").exists(),
                       reason="kvbench/p2p/cli.py is not in this checkout"),
]


def _netns() -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _marks(fn):
    for m in reversed(needs_shaping):
        fn = m(fn)
    return fn


@_marks
def test_estimate_is_within_tolerance_of_the_shaped_payload_rate(tmp_path):
    name = f"kvbench-test-{os.getpid()}"
    proc = subprocess.Popen([PY, str(SCRIPT), "--rate", "400mbit",
                             "--bytes", "256K,512K,1M,2M,4M", "--iters", "20",
                             "--out", str(tmp_path), "--netns", name, "--timeout", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script deletes its namespace on SIGTERM
        out, err = proc.communicate(timeout=15)
        pytest.fail(f"shaped-link run took over 200 s\n{out}\n{err}")
    finally:
        if name in _netns():  # belt and braces: never leave a namespace behind
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    assert name not in _netns()
    if proc.returncode == 77:
        pytest.skip(out.strip().removeprefix("SKIP: "))
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "PASS: fitted" in out and "tolerance 5%" in out
    (summary_path,) = tmp_path.glob("shaped-link-summary-*.json")
    summary = json.loads(summary_path.read_text())
    assert summary["shaped_gb_s"] == 0.05
    # the qdisc counted what the header arithmetic says it counts
    assert summary["payload_fraction_measured"] == pytest.approx(
        summary["payload_fraction_computed"], abs=0.002)
    expected = summary["expected_gb_s"]
    assert expected == pytest.approx(0.05 * summary["payload_fraction_measured"])
    assert summary["fitted_gb_s"] == pytest.approx(expected, rel=0.05)
    lo, hi = summary["fitted_gb_s_ci95"]  # an interval, around its own estimate
    assert lo <= summary["fitted_gb_s"] <= hi
    assert isinstance(summary["interval_contains_expected"], bool)  # reported, not asserted
    assert "tbf" in summary["qdisc"] and "400Mbit" in summary["qdisc"]
    fit = json.loads((tmp_path / Path(summary["fit"]).name).read_text())
    (g,) = fit["groups"]
    assert g["group"]["transport"] == "gloo" and g["n_sizes"] == 5
    # the same numbers the summary was judged on, straight from the fit file
    assert g["effective_gb_s"] == summary["fitted_gb_s"]
    assert g["effective_gb_s_ci95"] == summary["fitted_gb_s_ci95"]
    assert g["n_samples"] == 100 * summary["runs"]


def test_payload_fraction_from_the_headers():
    """14 (Ethernet on lo) + 20 (IPv4) + 32 (TCP with timestamps) bytes per segment, one bare ACK
    per two segments: at MTU 16384, 2 x 16332 / (2 x 16398 + 66)."""
    frac = _script().payload_fraction(16384)
    assert frac == pytest.approx(32664 / 32862)
    assert round(frac, 5) == 0.99397
    assert _script().payload_fraction(1500) == pytest.approx(2 * 1448 / (2 * 1514 + 66))


def test_script_refuses_bad_arguments_without_touching_the_network():
    before = _netns()
    res = subprocess.run([PY, str(SCRIPT), "--bytes", "1M,2M,4M"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 2 and "at least four distinct sizes" in res.stderr
    res = subprocess.run([PY, str(SCRIPT), "--rate", "fast"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert res.returncode == 2 and "--rate must look like 400mbit" in res.stderr
    assert _netns() == before


def test_fit_of_the_published_shaped_link_runs(tmp_path):
    """The published shaped-link records (results/shaped-link, copied to tests/data/runs;
    400mbit tbf, gloo), refitted on any machine: the estimate is within 5% of the payload rate; a single
    run in back-to-back blocks gets no interval (and says why), a run that supports one has
    an interval around the estimate that overlaps the payload rate's 5% band (a property
    with a margin: which of 1000 draws the bootstrap makes may change)."""
    summaries = sorted(committed("tests/data/runs/shaped-link").glob("shaped-link-summary-*.json"))
    assert summaries
    seen_interval = False
    for i, summary_path in enumerate(summaries):  # every published run, each refitted
        summary = json.loads(summary_path.read_text())
        records = summary["records"] if isinstance(summary["records"], list) else [
            summary["records"]]
        out = tmp_path / f"again-{i}.fit.json"
        res = subprocess.run([PY, "-m", "kvbench.fit", *(str(summary_path.parent / Path(r).name) for r in records),
                              "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        (g,) = json.loads(out.read_text())["groups"]
        assert summary["rate_bits_per_s"] == 400e6
        expected = summary.get("expected_gb_s", 0.05)
        if "payload_fraction_measured" not in summary:  # summaries before the probe existed
            expected = 0.05 * _script().payload_fraction(16384)
        assert g["effective_gb_s"] == pytest.approx(expected, rel=0.05)
        assert g["n_sizes"] >= 4 and g["group"]["transport"] == "gloo"
        if len(records) == 1 and g["resampling"]["n_blocks"]:
            assert g["effective_gb_s_ci95"] is None and "back-to-back" in g["no_interval"]
        else:
            lo, hi = g["effective_gb_s_ci95"]
            assert lo <= g["effective_gb_s"] <= hi
            assert lo < expected * 1.05 and hi > expected * 0.95  # overlaps the truth's 5% band
            assert g["effective_gb_s"] == summary["fitted_gb_s"]  # same data, same seed
            seen_interval = True
    assert seen_interval, "no published shaped-link run supports an interval"
