"""The benchmarks' peak memory of a child is the child's own (benchmarks/peak_child.py,
VmHWM), not ru_maxrss, which Linux starts from the parent's resident size at the fork: a
benchmark that held its input when it started the report reported the input's size."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="VmHWM is read from Linux's /proc")


def _bigfile():
    spec = importlib.util.spec_from_file_location("bigfile", ROOT / "benchmarks" / "bigfile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _child_ru_maxrss_mib() -> float:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    _, _, usage = os.wait4(p.pid, 0)
    return usage.ru_maxrss / 1024


def test_a_small_child_of_a_big_parent_is_small(tmp_path):
    held = bytearray(300 << 20)
    held[::4096] = b"\1" * len(held[::4096])  # resident, not only reserved
    assert _child_ru_maxrss_mib() > 300  # the fault this guards against, on this kernel
    wall, peak, res = _bigfile().measured(["-m", "json.tool", "--help"], capture_output=True)
    assert res.returncode == 0 and 0 < peak < 100 and wall > 0
    del held


def test_a_big_child_is_big(tmp_path):
    script = tmp_path / "alloc.py"
    script.write_text("b = bytearray(200 << 20)\nb[::4096] = b'\\1' * len(b[::4096])\n")
    _, peak, res = _bigfile().measured([str(script)], capture_output=True)
    assert res.returncode == 0 and 200 < peak < 300
