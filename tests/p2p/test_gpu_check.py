"""scripts/gpu-check without a GPU: valid bash, a dry run that lists every step, commands that
parse, embedded Python that compiles, and a clear refusal on a machine with no GPU. (The real
run needs a GPU machine: it writes results/gpu-<host>-<date>/.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
import torch

from kvbench.p2p import cli as p2p
from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu-check"


def dry_run(**env) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=60)


def test_valid_bash_and_embedded_python_compiles():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    blocks = re.findall(r"<<'PY'\n(.*?)\nPY\n", text, re.S)
    assert len(blocks) == 2
    for b in blocks:
        compile(b, "gpu-check heredoc", "exec")


@pytest.mark.parametrize("gpus,expect", [
    ("2", {"nccl", "nixl", "gloo", "mpi", "layerwise", "sharded", "pytest"}),
    ("1", {"nixl", "gloo", "mpi", "layerwise", "sharded", "pytest"}),
])
def test_dry_run_lists_every_step_and_each_command_parses(gpus, expect):
    res = dry_run(GPUS=gpus, CUDA_AWARE="1")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("# would write results to results/gpu-")
    seen = set()
    for line in lines[:-1]:
        argv = shlex.split(line)
        if "-m" not in argv:
            assert argv[1] == "-"  # an embedded Python step
            continue
        module, args = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
        seen.add("pytest" if module == "pytest" else None)
        if module == "kvbench.p2p":
            ns = p2p.build_parser().parse_args(args)
            assert ns.device == "cuda"
            seen |= {ns.transport, *ns.pattern.split(",")}
    assert expect <= seen, expect - seen
    if gpus == "1":
        assert "nccl" not in seen  # two ranks cannot share one GPU under NCCL


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run")
def test_refuses_without_a_gpu(tmp_path):
    res = subprocess.run([str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "OUT": str(tmp_path / "out")})
    assert res.returncode == 2
    assert res.stderr.strip() == "gpu-check: error: no CUDA GPU visible (torch.cuda.device_count() is 0)"
    assert not (tmp_path / "out").exists()
