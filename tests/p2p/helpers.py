"""Helpers the p2p tests share: engine jobs (tests/plant.py) and their layouts, the engine-shape
replica's arguments and a clock that waiting moves, a private /dev/shm for a job, and the
Mooncake tests' gate (the wheel and its libraries, or a skip naming the command), their
mpirun job in its own session and the masters a job may leave."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from argparse import Namespace
from pathlib import Path

import pytest

from kvbench.p2p.transports.mooncake import libs
from kvbench.p2p.transports.nixl import engine_shape as es
from tests.conftest import PY, ROOT, mpi_env, mpirun_path, run_mpi


class Clock:
    """perf_counter, sleep and sched_yield: waiting moves the clock (a yield by 0.1 ms, a
    look at the clock by 10 us, so a spinning wait ends too)."""

    def __init__(self, monkeypatch):
        self.t, self.waited = 100.0, []
        monkeypatch.setattr(es.time, "perf_counter", self.now)
        monkeypatch.setattr(es.time, "sleep", self.sleep)
        monkeypatch.setattr(es.os, "sched_yield", self.yield_)

    def now(self):
        self.t += 1e-5
        return self.t

    def sleep(self, s):
        self.waited.append(("sleep", round(s, 9)))
        self.t += s

    def yield_(self):
        self.waited.append(("yield", None))
        self.t += 1e-4


def engine_args(**kw) -> Namespace:
    base = dict(nixl_shape="engine", nixl_poll=None, transport="nixl", layout="paged",
                granularity="block", pattern="sequential", nixl_op=None, nixl_recreate=False,
                nixl_reregister=False, nixl_prep="prepped", nixl_batch=None, nixl_threads=None,
                bytes=None, minbytes=None, maxbytes=None)
    return Namespace(**{**base, **kw})


TINY = {"model_type": "tiny-4l", "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128}


LAYOUTS = [(lay, gran) for lay in ("contiguous", "paged") for gran in ("whole", "layer", "block")]


def run_job(tmp, ranks: int, fault: str, cases: dict[str, str], timeout=420):
    """One MPI job running every case under `fault`: ({case: (status line, [records])}, secs)."""
    out_dir = tmp / f"{fault}-{ranks}"
    lines = [f"{name}\t{args} --out {out_dir / name}" for name, args in cases.items()]
    path = tmp / f"{fault}-{ranks}.txt"
    path.write_text("\n".join(lines) + "\n")
    t0 = time.monotonic()
    res = run_mpi(ranks, "tests.plant", fault, str(path), timeout=timeout)
    took = time.monotonic() - t0
    status = {}
    for line in res.stdout.splitlines():
        if line.startswith('{"case"'):
            d = json.loads(line)
            status[d["case"]] = d
    out = {}
    for name in cases:
        recs = [json.loads(x) for f in sorted((out_dir / name).glob("*.jsonl"))
                for x in f.read_text().splitlines()]
        out[name] = (status.get(name), recs)
    assert set(status) == set(cases), res.stdout[-3000:] + res.stderr[-3000:]
    return out, took


HANG_S = 150  # a job still running after this has hung: the test fails


# Run inside a private mount namespace: an empty /dev/shm of its own, listed after the job.
PRIVATE_SHM = """mount -t tmpfs -o size=2g kvbench-shm /dev/shm || exit 90
"$@"; rc=$?
echo "SHM-LEFT:$(ls -A /dev/shm | tr '\\n' ' ')" >&2
exit $rc
"""


def private_shm_works() -> bool:
    if os.geteuid() != 0:
        return False
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          PRIVATE_SHM, "sh", "true"], capture_output=True, text=True)
    return res.returncode == 0 and "SHM-LEFT:" in res.stderr


def system_install_allowed(environ=os.environ) -> bool:
    return bool(environ.get("CI")) or environ.get(libs.ALLOW) == "1"


def mooncake_or_skip() -> None:
    """Skip, naming what to do, where Mooncake cannot run; make the private library copy
    where the machine may be changed."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip(f"Mooncake is not installed: {libs.INSTALL_HINT}")
    gone = libs.missing()
    if gone and system_install_allowed():
        try:
            libs.fetch()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"could not make the private copy of {', '.join(gone)}: {exc}")
        gone = libs.missing()
    if gone:
        pytest.skip(f"{libs.libs_hint(gone)}; or set {libs.ALLOW}=1 (or CI=1) to let the "
                    "tests run it")


def masters_left() -> list[str]:
    """mooncake_master processes whose parent is gone (a job's master outliving it)."""
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if "mooncake/mooncake_master" in cmd and "--metrics_host=127.0.0.1" in cmd \
                    and ppid == 1:
                left.append(f"{d.name}: {cmd[:120]}")
    return left


class MooncakeJob:
    """One mpirun job in its own session; every process whose command line holds its marker
    is found afterwards (none may be left)."""

    def __init__(self, tmp: Path, *flags: str, hang_s: float = 180, during=None):
        self.marker = str(tmp / "out")
        cmd = [mpirun_path(), "-n", "2", PY, "-m", "kvbench.p2p", "--transport", "mooncake",
               *flags, "--out", self.marker]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        if during is not None:
            during()
        try:
            self.out, self.err = proc.communicate(timeout=hang_s)
            self.rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: prterun and the ranks
            self.out, self.err = proc.communicate()
            self.rc = None
        self.seconds = time.monotonic() - t0

    def errors(self) -> list[str]:
        tag = "kvbench p2p: error:"
        return [line[line.index(tag):] for line in self.err.splitlines() if tag in line]

    def processes_left(self) -> list[str]:
        for _ in range(50):
            left = []
            for d in Path("/proc").iterdir():
                if d.name.isdigit() and int(d.name) != os.getpid():
                    try:
                        cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    except OSError:
                        continue
                    if self.marker in cmd:
                        left.append(f"{d.name}: {cmd[:120]}")
            if not left:
                return []
            time.sleep(0.2)
        return left
