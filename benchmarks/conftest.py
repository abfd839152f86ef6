"""pytest-benchmark suite of kvbench's own hot paths: `pytest benchmarks --benchmark-only`.

Only the test_*.py files here are the suite; the other scripts in benchmarks/ (shaped_link.py,
fit_coverage.py, slo_analyze_big.py, fit_big.py, compare.py) are run by hand and are never
collected. KVBENCH_BENCH_SHORT=1 (what CI uses, `make bench-self`) times each heavy benchmark
once instead of three times; the workloads are the same, so a short run compares with the
committed baseline (benchmarks/baseline/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SHORT = os.environ.get("KVBENCH_BENCH_SHORT") == "1"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


_LOAD_AT_START = _load()


def pytest_benchmark_update_machine_info(config, machine_info):
    """The machine (pytest-benchmark: CPU, Python) plus what else changes a timing here."""
    machine_info["kvbench"] = {
        "versions": {d: _version(d) for d in ("kvbench", "numpy", "torch", "pandas", "scipy",
                                               "pydantic", "prometheus-client", "mpi4py")},
        "cpu_count": os.cpu_count(),
        "load_average_at_start": _LOAD_AT_START,
        "load_average_at_end": _load(),
        "short_mode": SHORT,
        "git_describe": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip() or None,
    }


@pytest.fixture(scope="session")
def heavy_rounds() -> int:
    """Rounds of a benchmark that takes seconds per call."""
    return 1 if SHORT else 3
