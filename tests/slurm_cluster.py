"""A Slurm cluster on this host for the tests (scripts/slurm-cluster): whether one may be brought
up here (root; system changes only where CI or KVBENCH_ALLOW_SYSTEM_INSTALL=1 allow them), and
bringing it up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

CLUSTER = ROOT / "scripts" / "slurm-cluster"


EXIT_CANNOT_INSTALL = 3  # scripts/slurm-cluster: the package install itself failed


ALLOW = "KVBENCH_ALLOW_SYSTEM_INSTALL"


def system_install_allowed(environ=os.environ) -> bool:
    """apt-get and a link in a system library folder are fine in CI, or when a person says so."""
    return bool(environ.get("CI")) or environ.get(ALLOW) == "1"


def check_can_bring_up(environ=os.environ) -> None:
    """Skip, naming why, where a cluster cannot or may not be brought up here."""
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster needs root (daemons, apt-get install); CI runs as root")
    changes = subprocess.run([str(CLUSTER), "changes"], capture_output=True, text=True,
                             timeout=60, env=environ)
    if changes.returncode != 0 and not system_install_allowed(environ):
        todo = "; ".join(changes.stdout.split("\n")).strip("; ")
        pytest.skip(f"the Slurm tests would change this system ({todo}): set {ALLOW}=1 "
                    "(or CI=1) to allow it")


def bring_up(d: Path, environ=os.environ) -> None:
    """scripts/slurm-cluster up DIR: skip only when the package install itself failed (its
    exit status 3); any other failure (munged, slurmctld, nodes not ready) fails the test."""
    up = subprocess.run([str(CLUSTER), "up", str(d)], capture_output=True, text=True,
                        timeout=1200, env=environ)
    if up.returncode == 0:
        return
    subprocess.run([str(CLUSTER), "down", str(d)], capture_output=True, timeout=120, env=environ)
    last = (up.stderr.strip().splitlines() or ["(no output)"])[-1]
    if up.returncode == EXIT_CANNOT_INSTALL and last.startswith("slurm-cluster: cannot install:"):
        pytest.skip(f"cannot install Slurm here: {last}")
    pytest.fail(f"scripts/slurm-cluster up failed (exit {up.returncode}):\n{up.stderr}")
