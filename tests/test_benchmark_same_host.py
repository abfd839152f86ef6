"""benchmarks/same_host.py's in-process A/B: the floor, the copy out of an ipc mapping and
the copy out of small pages, each timed, with the host's shared-memory huge-page policy; its
--ab-bytes list parsed, a bad one refused in one line (exit 2)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvbench.p2p.transports.ipc_mem import shmem_huge_pages

ROOT = Path(__file__).resolve().parents[1]


def _same_host():
    spec = importlib.util.spec_from_file_location("same_host", ROOT / "benchmarks" / "same_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_ab_times_three_copies_of_the_same_bytes():
    mod = _same_host()
    ab = mod.mapping_ab(4 << 20, rounds=4)
    for key in ("floor_gbps", "mapped_gbps", "small_pages_gbps", "ratio", "small_pages_ratio"):
        assert ab[key] > 0, (key, ab)
    assert ab["bytes"] == 4 << 20 and ab["shmem_huge_pages"] == shmem_huge_pages()
    line = mod.ab_line(ab)
    assert "out of an ipc mapping" in line and "out of small pages" in line


def test_ab_bytes_is_a_list_and_zero_skips(tmp_path):
    mod = _same_host()
    assert mod.parse(["--out", str(tmp_path)]).ab_bytes == [98_304_000, 655_360_000]
    assert mod.parse(["--out", str(tmp_path), "--ab-bytes", "0"]).ab_bytes == []
    assert mod.parse(["--out", str(tmp_path), "--ab-bytes", "1000,2000"]).ab_bytes == [1000, 2000]
    for bad in ("ten", "-5"):
        with pytest.raises(SystemExit) as exc:
            mod.parse(["--out", str(tmp_path), "--ab-bytes", bad])
        assert exc.value.code == 2


def test_busy_is_load_beyond_a_runs_own_threads(monkeypatch):
    """NIXL's progress thread spins one more thread a rank: its run's own load is not another
    job's (before: every NIXL run with it called the machine busy)."""
    mod = _same_host()
    monkeypatch.setattr(mod.os, "cpu_count", lambda: 2)
    own = mod.OWN_THREADS.get("nixl (progress thread)", 2)
    assert own == 4
    assert not mod.machine_busy(0.3, [(2.5, 2), (4.6, own)])
    assert mod.machine_busy(0.3, [(4.6, 2)])  # the same load after a run of two ranks
    assert mod.machine_busy(1.5, [])  # loaded before the first run
