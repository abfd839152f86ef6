"""`pip install kvbench` without the `p2p` extra: fit, plan, slo analyze, report, model and
kvbench.results.load work with neither torch nor mpi4py importable, and `kvbench p2p` says
in one line what to install.

Each command runs in a fresh interpreter whose sitecustomize puts an import hook first on
sys.meta_path that refuses torch and mpi4py (and their submodules) as an absent package
would: ModuleNotFoundError. What this proves: no code path these commands take imports
either module unguarded. What it does not: that pip resolves the light dependency set
(the metadata test below checks what pyproject declares)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT

BLOCKED = ("torch", "mpi4py")
HOOK = f'''\
import importlib.abc, sys

class _Absent(importlib.abc.MetaPathFinder):
    """torch and mpi4py as if not installed (tests/test_light_install.py)."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
'''
RUNS = ROOT / "tests/data/runs"
P2P = RUNS / "mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl"
REQUESTS = RUNS / "lab-sweep/runs/warm/aggregated/2rps-rep1/records.jsonl"


@pytest.fixture(scope="module")
def light_env(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("light-site")
    (site / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join([str(site), str(ROOT)])
    return dict(os.environ, PYTHONPATH=path, MPLBACKEND="Agg")


def light(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PY, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def test_the_hook_makes_torch_and_mpi4py_absent(light_env):
    """Without this the rest proves nothing: the venv does have both."""
    for name in BLOCKED:
        res = light(light_env, "-c", f"import {name}")
        assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr, res.stderr
    assert light(light_env, "-c", "import numpy, pandas, scipy").returncode == 0


def test_fit_plan_model_slo_report_and_load_run_without_torch_or_mpi4py(light_env, tmp_path):
    fit = tmp_path / "run.fit.json"
    steps = [
        ("-m", "kvbench", "model", "--model", "seed-70b-gqa", "--prompt-tokens", "300,2000"),
        ("-m", "kvbench", "fit", str(P2P), "--out", str(fit), "--bootstrap", "200"),
        ("-m", "kvbench", "plan", "--fit", str(fit), "--model", "seed-70b-gqa",
         "--prompt-tokens", "300,2000"),
        ("-m", "kvbench", "plan", "export", "--fit", str(fit), "--to", "blis", "--tp", "2"),
        ("-m", "kvbench", "slo", "analyze", str(REQUESTS), "--ttft-max-ms", "500",
         "--denominator", "all_offered_after_warmup", "--attainment-min", "0.95",
         "--format", "json", "--out", str(tmp_path / "slo.json")),
        ("-m", "kvbench", "report", str(RUNS / "fit-example"), "--out", str(tmp_path / "rep"),
         "--bootstrap", "200", "--quiet"),
        ("-c", "import sys; from kvbench import results; "
               f"df = results.load({str(P2P)!r}); s = results.load({str(P2P)!r}, samples=True); "
               f"f = results.load({str(RUNS / 'mpi-20261202')!r}, kind='fit'); "
               "print(len(df), len(s), len(f)); "
               f"assert not {{'torch', 'mpi4py'}} & set(sys.modules)"),
    ]
    for args in steps:
        res = light(light_env, *args)
        assert res.returncode == 0, (args, res.stderr[-2000:])
        assert "Traceback" not in res.stderr, (args, res.stderr[-2000:])
    assert json.loads(fit.read_text())["groups"]
    assert json.loads((tmp_path / "slo.json").read_text())["groups"]
    assert (tmp_path / "rep" / "report.md").is_file()
    assert [int(n) for n in res.stdout.split()] == [5, 141, 1]  # the published run's rows


@pytest.mark.parametrize("how", [("-m", "kvbench", "p2p"), ("-m", "kvbench.p2p")])
def test_p2p_without_its_extra_says_what_to_install(light_env, tmp_path, how):
    res = light(light_env, *how, "--sizes", "300", "--out", str(tmp_path / "out"))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("kvbench p2p: error: torch and mpi4py are not installed")
    assert "pip install 'kvbench[p2p]'" in res.stderr
    assert not (tmp_path / "out").exists()


def test_pyproject_keeps_torch_and_mpi4py_in_the_p2p_extra():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}  # noqa: E731
    assert not names(project["dependencies"]) & set(BLOCKED)
    assert names(project["optional-dependencies"]["p2p"]) >= set(BLOCKED)
    assert project["license"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "kvbench" / "py.typed").is_file()
    assert Path(sys.executable).exists()
