"""Helpers of the big-input measurements (fit_big.py, slo_analyze_big.py): the json.loads floor
of a JSON Lines file and a kvbench command timed in a child process with its peak RSS."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_floor(path: Path) -> float:
    """Seconds to json.loads every line and nothing else (what any JSON Lines reader pays)."""
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        for line in fh:
            json.loads(line)
    return time.perf_counter() - t0


def measured(cmd: list[str], **popen) -> tuple[float, float, subprocess.CompletedProcess]:
    """`python CMD...` from the checkout's root, through benchmarks/peak_child.py: (wall s, the
    child's own peak RSS in MiB, its completed process). Its own: VmHWM, not ru_maxrss, which
    counts this process's memory at the fork too (peak_child.py says why)."""
    with tempfile.NamedTemporaryFile("r", prefix="kvbench-peak-") as peak:
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, str(Path(__file__).with_name("peak_child.py")),
                              *cmd], cwd=ROOT, env={**os.environ, "KVBENCH_PEAK_FILE": peak.name},
                             text=True, **popen)
        wall = time.perf_counter() - t0
        text = peak.read().strip()
    return wall, int(text) / 1024 if text else float("nan"), res


def run_child(args: list[str], what: str) -> tuple[float, float, str]:
    """`python -m ARGS` from the checkout's root: (wall s, its peak RSS MiB, stdout); exits on
    failure."""
    wall, peak, res = measured(["-m", *args], capture_output=True)
    if res.returncode != 0:
        sys.exit(f"{what} failed ({res.returncode}): {res.stderr.strip()}")
    return wall, peak, res.stdout


@contextlib.contextmanager
def workdir(directory: str | None, keep: bool, prefix: str, names: tuple[str, ...]):
    """A folder for the generated input and the command's output, whose files NAMES are removed
    afterwards (and the folder, when it was a fresh temporary one) unless keep."""
    tmp = Path(directory or tempfile.mkdtemp(prefix=prefix))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
    finally:
        if not keep:
            for name in names:
                (tmp / name).unlink(missing_ok=True)
            if directory is None:
                os.rmdir(tmp)


def report(head: str, wall_s: float, peak_mib: float, floor_s: float, size_mib: float,
           what: str, note: str) -> None:
    """The two lines every big-input measurement prints (time and memory against the floor)."""
    print(f"{head}: {wall_s:.1f} s wall, peak RSS {peak_mib:.0f} MiB" + (f" [{note}]" if note else ""))
    print(f"baseline json.loads of every line: {floor_s:.1f} s -> {what} / parse floor = "
          f"{wall_s / floor_s:.2f}x; peak RSS / file size = {peak_mib / size_mib:.2f}")


def add_common_flags(p) -> None:
    """--dir, --keep and --note, the same in every big-input measurement."""
    p.add_argument("--dir", default=None, help="where to write the input (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated input and the output")
    p.add_argument("--note", default="", help="e.g. 'busy machine' (printed with the numbers)")
