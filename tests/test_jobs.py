"""The Slurm job scripts: valid bash, and every kvbench command in them parses."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from kvbench import fit, p2p

JOBS = Path(__file__).resolve().parents[1] / "jobs"
SCRIPTS = sorted(JOBS.glob("*.sbatch"))


def test_there_is_a_script_per_topology():
    names = {s.stem for s in SCRIPTS}
    assert {"intra_node_nvlink", "inter_node_rdma", "inter_node_tcp", "sharded_tp"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_bash_and_its_commands_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --nodes=" in text and "#SBATCH --time=" in text
    commands = [line for line in text.splitlines() if "-m kvbench." in line]
    assert commands
    for line in commands:
        argv = shlex.split(line.replace('"$OUT"', "out").replace('"$KVBENCH_PY"', "py")
                           .replace("$OUT", "out"))
        module, args = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
        if module == "kvbench.p2p":
            ns = p2p.build_parser().parse_args(args)
            p2p.raw_sizes(ns)  # byte sizes parse
        elif module == "kvbench.fit":
            fit.build_parser().parse_args(args)
        else:
            pytest.fail(f"unexpected module {module}")
