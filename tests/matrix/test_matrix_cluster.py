"""The done-when of the link matrix, for real: a Slurm cluster (Debian's slurmctld/slurmd/munge,
scripts/slurm-cluster in network-namespace mode) of three nodes, each its own network
namespace and host name; jobs/matrix.sbatch under sbatch, one rank per node, srun --mpi=pmix,
NIXL over UCX's TCP transport. benchmarks/matrix_cluster.py plants a pair shaped by tc to a
known rate (n2 -> n1) and a pair routed over a second interface (n1 -> n3); the matrix must name
those two, for those reasons, the shaped rate within 10% of the shaping, and no other pair.
Every namespace, qdisc, route and daemon is removed afterwards (checked)."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvbench.records.schema.job import whole_dicts
from tests.conftest import PY, ROOT
from tests.slurm_cluster import check_can_bring_up

pytestmark = [pytest.mark.slurm, pytest.mark.root, pytest.mark.mpi]

SCRIPT = ROOT / "benchmarks" / "matrix_cluster.py"


def _namespaces() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def test_the_matrix_names_the_shaped_pair_and_the_odd_path_pair_and_no_other(tmp_path):
    check_can_bring_up()
    before = _namespaces()
    r = subprocess.run([PY, str(SCRIPT), "--out", str(tmp_path), "--timeout", "420"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip().splitlines()[-1])
    assert _namespaces() - before == set()  # nothing left behind, pass or fail
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    summary = json.loads(next(tmp_path.glob("*/matrix-cluster-summary.json")).read_text())
    assert summary["pass"] and all(summary["checks"].values())
    assert summary["named"] == {"1,0": ["slow"], "0,2": ["path_differs"]}
    assert abs(summary["relative_error"]) <= 0.10
    assert "tcp/eth1" in summary["odd_path"]
    assert summary["job_state"] == "COMPLETED" and summary["exit_code"] == "0:0"
    doc = json.loads(open(summary["matrix"]).read())
    assert [p["sender"]["host"] for p in doc["pairs"] if p["pair"][1] == 0] == ["n2", "n3"]
    folder = next(tmp_path.glob("kvbench-matrix-*"))
    records = [x for f in folder.glob("kvbench-p2p-*.jsonl") for x in whole_dicts(f)]  # lean: made whole
    nodes = {rank["variables"].get("SLURMD_NODENAME") or rank["variables"].get("SLURM_NODEID")
             for x in records for rank in x["env"]["ranks"]}
    assert len(nodes) == 3  # one rank on each node
    assert {x["hosts"][0] for x in records} == {"n1"} and records[0]["hosts"] == ["n1", "n2", "n3"]
    assert sorted(f.suffix for f in folder.glob("kvbench-matrix-*")) == [".csv", ".json", ".md", ".png"]
