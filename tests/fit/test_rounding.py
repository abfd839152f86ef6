"""The two rounding rules kvbench writes numbers with (kvbench.units.round_sig and
round_places), each defined once, and fit documents that stay what they were."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.units import round_places, round_sig

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "results" / "descriptors-2026-12-06"


@pytest.mark.parametrize("x", [0.0, -0.0, 1.0, 1234567.891, 0.000123456789, 1e-300, 5e-324,
                               1e300, -7.176123456, 123456.5, 0.1234565, 2.5e-7])
def test_round_sig_is_format_g_and_round_places_is_round(x):
    assert round_sig(x) == float(format(x, ".6g"))
    assert round_sig(x, 3) == float(format(x, ".3g"))
    assert round_places(x) == round(x, 6)
    assert round_places(x, 2) == round(x, 2)


def test_the_rules_differ_where_they_should():
    assert round_sig(1234567.891) == 1234570.0  # six significant digits
    assert round_places(1234567.891) == 1234567.891  # six decimal places
    assert round_sig(0.000123456789) == 0.000123457
    assert round_places(0.000123456789) == 0.000123


@pytest.mark.parametrize("x", [None, math.inf, -math.inf, math.nan])
def test_no_number_nothing_measured(x):
    assert round_sig(x) is None and round_places(x) is None


def test_no_module_defines_its_own_rounder():
    """The modules that each had a `_r` (three rules under one name) now call the named
    ones; a `def _r` planted back is caught (checked on a planted source below)."""
    for rel in ("kvbench/fit/descriptors.py", "kvbench/fit/fitting.py", "kvbench/model.py",
                "kvbench/plan/floors.py", "kvbench/plan/cli.py"):
        assert own_rounders((ROOT / rel).read_text()) == [], rel
    assert own_rounders("def _r(x, nd=6):\n    return round(x, nd)\n") == ["_r"]


def own_rounders(source: str) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef) and n.name.strip("_") in ("r", "rnd", "round")]


@pytest.mark.parametrize("committed, runs", [
    ("mpi.fit.json", ("mpi",)),
    ("nixl-sm-and-tp.fit.json", ("nixl-sm", "nixl-sm-tp")),
])
def test_refitting_a_committed_run_gives_the_committed_document(tmp_path, committed, runs):
    inputs = [str(p.relative_to(ROOT)) for run in runs for p in sorted((RUNS / run).glob("*.jsonl"))]
    out = tmp_path / "refit.json"
    res = subprocess.run([sys.executable, "-m", "kvbench", "fit", *inputs, "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got, want = json.loads(out.read_text()), json.loads((RUNS / committed).read_text())
    got.pop("created"), want.pop("created")
    assert got == want
