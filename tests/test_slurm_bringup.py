"""The Slurm fixture's verdicts, proven on planted faults (no Slurm needed, no daemons started).

scripts/slurm-cluster runs with fake `dpkg-query`, `dpkg`, `apt-get` and `munged` first on
PATH: a failed package install must skip the Slurm tests (with the script's reason), a
bring-up that fails after the install (munged dies) must fail them, and a system that needs
packages must not be changed unless CI or KVBENCH_ALLOW_SYSTEM_INSTALL=1 says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.slurm_cluster import ALLOW, bring_up, check_can_bring_up

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="scripts/slurm-cluster up needs root")]


def _fakes(tmp_path: Path, installed: bool, **scripts: str) -> dict[str, str]:
    """An environment whose PATH starts with small shell scripts standing in for commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts.setdefault("dpkg-query", "printf 'install ok installed'" if installed else "exit 1")
    scripts.setdefault("dpkg", "exit 0")  # dpkg -L libpmix2: nothing to link
    for name, body in scripts.items():
        f = bin_dir / name.replace("_", "-")
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", ALLOW)}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return env


def verdict(fn, *args) -> tuple[str, str]:
    """What the fixture logic decided: ('skip'|'fail'|'up', message); a skip is a value here,
    so a wrong skip fails this test instead of skipping it."""
    try:
        fn(*args)
    except pytest.skip.Exception as e:
        return "skip", str(e)
    except pytest.fail.Exception as e:
        return "fail", str(e)
    return "up", ""


def test_a_failed_package_install_skips(tmp_path):
    env = _fakes(tmp_path, installed=False, apt_get="echo 'E: no network' >&2; exit 100")
    kind, msg = verdict(bring_up, tmp_path / "c", env)
    assert kind == "skip" and "cannot install: apt-get update failed" in msg, (kind, msg)


def test_a_bring_up_failure_after_the_install_fails(tmp_path):
    """The old rule skipped on any stderr holding 'apt-get', which the install line always has."""
    env = _fakes(tmp_path, installed=True, munged="echo 'munged: planted failure' >&2; exit 1")
    kind, msg = verdict(bring_up, tmp_path / "c", env)
    assert kind == "fail" and "munged did not start" in msg, (kind, msg)


def test_a_fresh_install_that_then_fails_fails(tmp_path):
    """Packages 'installed' by a fake apt-get (its install line printed), then munged fails."""
    env = _fakes(tmp_path, installed=False, apt_get="exit 0", munged="exit 1")
    kind, msg = verdict(bring_up, tmp_path / "c", env)
    assert kind == "fail" and "(apt-get)" in msg and "munged did not start" in msg, (kind, msg)


def test_missing_packages_are_installed_only_when_allowed(tmp_path):
    env = _fakes(tmp_path, installed=False)
    kind, msg = verdict(check_can_bring_up, env)
    assert kind == "skip" and "apt-get install slurmctld" in msg and f"set {ALLOW}=1" in msg
    assert verdict(check_can_bring_up, {**env, ALLOW: "1"}) == ("up", "")
    assert verdict(check_can_bring_up, {**env, "CI": "true"}) == ("up", "")
