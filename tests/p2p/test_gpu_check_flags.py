"""Hostile flags given to scripts/gpu-check (--dry-run, no GPU needed): empty lists and items,
a budget scale with underscores or past the ceiling, each one line and exit 2; a scale within
the ceiling is taken. (Found by issue 43, hostile round 4, group 9.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def gpu_check(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check"), "--one-gpu",
                           "--dry-run", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path / "out")})


@pytest.mark.parametrize("args, needle", [
    (["--steps", ""], "argument --steps: empty list"), (["--steps", "fit,"], "empty item"),
    (["--budget-scale", "1_0"], "from 1 to 10, got '1_0'"),
    (["--budget-scale", "3"], "past its ceiling of 300 s"),
])
def test_gpu_check_flags(tmp_path, args, needle):
    r = gpu_check(tmp_path, *args)
    assert r.returncode == 2 and needle in r.stderr and r.stdout == "", r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_gpu_check_scales_within_the_ceiling(tmp_path):
    r = gpu_check(tmp_path, "--budget-scale", "1.5", "--steps", "fit")
    assert r.returncode == 0 and "(285 s free)" in r.stdout, r.stderr
