"""A rank stopped at the door of MPI start-up, then continued, does not connect to the
launcher while the launcher is ending the job (kvbench.p2p.watchdog.leave_if_held).

Open MPI 5.0.11's prterun ends a job by SIGCONT to every rank, then SIGTERM 0.25 s later.
A rank stopped before MPI_Init that ran on in between connected to prterun's PMIx server,
was killed mid-handshake, and prterun hung for good (the peer-stop suite's MPI start-up
case, 1 to 4 hangs in 4 loaded runs before the fix). These tests replay the launcher's
signals on a plain child process (no MPI): the child enters the phase, stops itself, and
"connects" (writes a marker file) where world.init would call MPI_Init_thread. Without the
grace wait the marker appears before SIGTERM lands; the first test fails then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import sys, pathlib
from kvbench.p2p.watchdog import WATCHDOG
WATCHDOG.start("kvbench p2p", float(sys.argv[2]), stop_at=(None, "mpi-start-up"))
WATCHDOG.phase("MPI start-up")  # stops itself here (SIGSTOP) when stop_at matches
WATCHDOG.leave_if_held("MPI_Init_thread")
pathlib.Path(sys.argv[1]).write_text("connected")
"""


def start_child(tmp_path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    marker = str(tmp_path / "connected")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, marker, str(timeout_s)],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait for the self-stop (state T in /proc)
        state = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return proc, marker
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the child never stopped itself")


def test_a_rank_continued_by_the_launcher_dies_before_it_connects(tmp_path):
    proc, marker = start_child(tmp_path, timeout_s=30)
    time.sleep(1.5)  # held past HELD_S, as a peer's timeout would take
    os.kill(proc.pid, signal.SIGCONT)  # what prterun sends first ...
    time.sleep(0.25)
    os.kill(proc.pid, signal.SIGTERM)  # ... and 0.25 s later
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM, proc.stderr.read()
    assert not os.path.exists(marker), "the rank connected while the launcher ended the job"


def test_a_rank_continued_by_a_person_goes_on(tmp_path):
    proc, marker = start_child(tmp_path, timeout_s=30)
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGCONT)
    proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
    assert open(marker).read() == "connected"


def test_a_rank_held_past_timeout_leaves_with_one_line(tmp_path):
    proc, marker = start_child(tmp_path, timeout_s=1)
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGCONT)
    proc.wait(timeout=30)
    err = proc.stderr.read().splitlines()
    assert proc.returncode == 3, err
    assert err[-1].startswith("kvbench p2p: error: MPI start-up: held ") and \
        err[-1].endswith("its peers have given up: leaving the job"), err
    assert not os.path.exists(marker)
