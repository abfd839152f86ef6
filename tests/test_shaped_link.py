"""Ground truth: the fit recovers the rate of a link shaped to a known rate.

Runs benchmarks/shaped_link.py: a private network namespace whose loopback is shaped with
`tc ... tbf rate 400mbit`, the p2p benchmark over gloo (TCP) across five payload sizes,
kvbench fit, and a +-5% check against 400 Mbit/s = 0.05 GB/s. Needs root, iproute2 and
network namespaces; skips with the reason where it cannot run. The namespace is always
removed, and this test checks that it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from tests.conftest import PY, ROOT

SCRIPT = ROOT / "benchmarks" / "shaped_link.py"

needs_shaping = [
    pytest.mark.root,
    pytest.mark.mpi,
    pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0,
                       reason="needs root to create a network namespace and shape it with tc"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="needs iproute2 ('ip' and 'tc')"),
    pytest.mark.skipif(not (ROOT / "kvbench" / "p2p.py").exists(),
                       reason="kvbench/p2p.py is not in this checkout"),
]


def _netns() -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _marks(fn):
    for m in reversed(needs_shaping):
        fn = m(fn)
    return fn


@_marks
def test_fitted_rate_matches_shaped_link(tmp_path):
    name = f"kvbench-test-{os.getpid()}"
    proc = subprocess.Popen([PY, str(SCRIPT), "--rate", "400mbit",
                             "--bytes", "256K,512K,1M,2M,4M", "--iters", "20",
                             "--out", str(tmp_path), "--netns", name, "--timeout", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=58)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script deletes its namespace on SIGTERM
        out, err = proc.communicate(timeout=15)
        pytest.fail(f"shaped-link run took over 58 s\n{out}\n{err}")
    finally:
        if name in _netns():  # belt and braces: never leave a namespace behind
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    assert name not in _netns()
    if proc.returncode == 77:
        pytest.skip(out.strip().removeprefix("SKIP: "))
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "PASS: fitted" in out
    (summary_path,) = tmp_path.glob("shaped-link-summary-*.json")
    summary = json.loads(summary_path.read_text())
    assert summary["expected_gb_s"] == 0.05
    assert summary["fitted_gb_s"] == pytest.approx(0.05, rel=0.05)
    assert summary["within_tolerance"] is True
    assert "tbf" in summary["qdisc"] and "400Mbit" in summary["qdisc"]
    fit = json.loads((tmp_path / summary["fit"]).read_text())
    (g,) = fit["groups"]
    assert g["group"]["transport"] == "gloo" and g["n_sizes"] == 5
    # the same number the summary was judged on, straight from the fit file
    assert g["effective_gb_s"] == summary["fitted_gb_s"]
    assert g["n_samples"] == 100


def test_script_refuses_bad_arguments_without_touching_the_network():
    before = _netns()
    res = subprocess.run([PY, str(SCRIPT), "--bytes", "1M,2M,4M"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 2 and "at least four distinct sizes" in res.stderr
    res = subprocess.run([PY, str(SCRIPT), "--rate", "fast"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert res.returncode == 2 and "--rate must look like 400mbit" in res.stderr
    assert _netns() == before


def test_fit_of_the_published_shaped_link_run(tmp_path):
    """The shaped-link records kept in results/ (400mbit tbf, gloo) fit to 0.05 GB/s +-5%,
    on any machine: the ground truth without needing root here."""
    summaries = sorted((ROOT / "results" / "shaped-link").glob("shaped-link-summary-*.json"))
    assert summaries
    for i, summary_path in enumerate(summaries):  # every published run, each refitted
        summary = json.loads(summary_path.read_text())
        records = ROOT / summary["records"]
        out = tmp_path / f"again-{i}.fit.json"
        res = subprocess.run([PY, "-m", "kvbench.fit", str(records), "--out", str(out)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert res.returncode == 0, res.stderr
        (g,) = json.loads(out.read_text())["groups"]
        assert summary["rate_bits_per_s"] == 400e6
        assert g["effective_gb_s"] == pytest.approx(0.05, rel=0.05)
        lo, hi = g["effective_gb_s_ci95"]
        assert lo < g["effective_gb_s"] < hi
        assert g["n_sizes"] >= 4 and g["group"]["transport"] == "gloo"
        assert g["effective_gb_s"] == summary["fitted_gb_s"]  # same data, same seed, same number
