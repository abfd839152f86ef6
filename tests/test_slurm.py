"""The job scripts under sbatch on a real Slurm cluster (Debian's slurmctld/slurmd/munge,
two slurmd nodes on this host, brought up once per test run by scripts/slurm-cluster).

CPU-capable jobs must end COMPLETED with records from both nodes, every data check clean,
fit.json and the plot written. GPU jobs are submitted with fake GPUs (gres backed by
/dev/null: this proves Slurm accepts and places them, nothing about CUDA) and must stop with
the one-line "needs a CUDA GPU" error and exit 2, before writing anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT
from tests.slurm_cluster import (
    CLUSTER,
    bring_up,
    check_can_bring_up,
)

pytestmark = [pytest.mark.slurm, pytest.mark.root, pytest.mark.mpi, pytest.mark.slow]

WAIT_S = 900  # per job, on a busy 2-core machine
SMALL = {"KVBENCH_P2P_ARGS": "--iters 5 --warmup 1 --seconds-per-point 1"}


@dataclass
class Cluster:
    dir: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout,
                              cwd=ROOT)


def _daemon_pids(d: Path) -> dict[str, int]:
    out = {}
    for f in (d / "run").glob("*.pid"):
        pid = int(f.read_text().strip() or 0)
        if pid and Path(f"/proc/{pid}").exists():
            out[f.stem] = pid
    return out


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    check_can_bring_up()
    d = tmp_path_factory.mktemp("slurm-cluster")
    bring_up(d)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "KVBENCH_"))}
    env.update(SLURM_CONF=str(d / "etc" / "slurm.conf"), KVBENCH_PY=PY)
    try:
        yield Cluster(d, env)
    finally:
        down = subprocess.run([str(CLUSTER), "down", str(d)], capture_output=True, text=True,
                              timeout=300)
        left = _daemon_pids(d)
        assert down.returncode == 0 and not left, f"daemons left running: {left}\n{down.stderr}"


@dataclass
class Job:
    id: str
    out_root: Path
    log: Path

    def state(self, c: Cluster) -> dict[str, str]:
        r = c.run("scontrol", "show", "job", "-d", "-o", self.id)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def submit(c: Cluster, tmp: Path, script: str, *sbatch_args: str, **env: str) -> Job:
    out_root = tmp / "results"
    out_root.mkdir(parents=True)
    log = tmp / "job.out"
    r = subprocess.run(["sbatch", "--parsable", "-o", str(log), *sbatch_args, f"jobs/{script}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**c.env, "KVBENCH_OUT_ROOT": str(out_root), **env})
    assert r.returncode == 0, f"sbatch refused {script}: {r.stderr}"
    return Job(r.stdout.strip().split(";")[0], out_root, log)


def wait(c: Cluster, job: Job) -> dict[str, str]:
    deadline = time.monotonic() + WAIT_S
    while True:
        st = job.state(c)
        if st.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return st
        if time.monotonic() > deadline:
            c.run("scancel", job.id)
            pytest.fail(f"job {job.id} still {st.get('JobState')} after {WAIT_S} s:\n"
                        + (job.log.read_text()[-3000:] if job.log.exists() else ""))
        time.sleep(2)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every job submitted at once (Slurm places them side by side), then waited for."""
    t = tmp_path_factory.mktemp("jobs")
    submitted = {
        # The no-RDMA job as a user submits it, under the default launcher (srun --mpi=pmix).
        "tcp": submit(cluster, t / "tcp", "inter_node_tcp.sbatch", KVBENCH_SIZES="16,64",
                      KVBENCH_BYTES="256K,1M,4M", **SMALL),
        # Four ranks over the two nodes under mpirun (srun starts at most two per node with
        # the pip Open MPI wheel), on CPUs with the MPI transport.
        "sharded": submit(cluster, t / "sharded", "sharded_tp.sbatch", "--ntasks-per-node=2",
                          KVBENCH_LAUNCH="mpirun", KVBENCH_DEVICE="cpu", KVBENCH_TRANSPORTS="mpi",
                          KVBENCH_SIZES="16,64", KVBENCH_EXPECT_LINK="host", **SMALL),
        # The RDMA job's steps on CPUs (MPI): its layerwise step and the fit over a folder
        # holding layerwise records (the fit skips the non-link groups, not abort).
        "rdma_cpu": submit(cluster, t / "rdma_cpu", "inter_node_rdma.sbatch",
                           KVBENCH_DEVICE="cpu", KVBENCH_TRANSPORTS="mpi",
                           KVBENCH_LAYERWISE_TRANSPORT="mpi", KVBENCH_SIZES="16,64",
                           KVBENCH_LAYERWISE_SIZES="16,64", KVBENCH_EXPECT_LINK="host", **SMALL),
        # GPU jobs exactly as shipped: placed on fake GPUs, refused before any launch.
        "gpu_nvlink": submit(cluster, t / "gpu_nvlink", "intra_node_nvlink.sbatch"),
        "gpu_rdma": submit(cluster, t / "gpu_rdma", "inter_node_rdma.sbatch"),
        "gpu_tp": submit(cluster, t / "gpu_tp", "sharded_tp.sbatch"),
        # (four nodes as shipped; this cluster has two)
        "gpu_matrix": submit(cluster, t / "gpu_matrix", "matrix.sbatch", "-N", "2"),
    }
    return {name: (job, wait(cluster, job)) for name, job in submitted.items()}


def run_folder(job: Job) -> Path:
    runs = list(job.out_root.iterdir())
    assert len(runs) == 1, f"expected one run folder in {job.out_root}: {runs}"
    return runs[0]


@pytest.mark.parametrize("name", ["tcp", "sharded", "rdma_cpu"])
def test_cpu_job_completes_on_both_nodes_with_clean_records_and_a_fit(jobs, name):
    job, st = jobs[name]
    log = job.log.read_text()
    assert (st["JobState"], st["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    folder = run_folder(job)
    assert f"writing to {folder}" in log
    records = [json.loads(line) for f in sorted(folder.glob("kvbench-p2p-*.jsonl"))
               for line in f.read_text().splitlines()]
    assert records
    assert all(r["wrong"] in (0, None) for r in records)  # None: variants checked elsewhere
    assert any(r["wrong"] == 0 for r in records)
    for r in records:
        node_ids = {rank["variables"].get("SLURM_NODEID") for rank in r["env"]["ranks"]}
        assert node_ids == {"0", "1"}, node_ids  # ranks on both nodes
        assert r["env"]["ranks"][0]["variables"].get("SLURM_JOB_ID") == job.id
    doc = json.loads((folder / "fit.json").read_text())
    assert doc["groups"] and doc["line_rate_gb_s"] > 0
    codes = {w["code"] for g in doc["groups"] for w in g["warnings"]}
    assert "link_mismatch" not in codes  # the transports' paths are the declared link
    assert (folder / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tcp_job_ran_its_steps_under_srun_with_gloo(jobs):
    job, _ = jobs["tcp"]
    steps = [ln for ln in job.log.read_text().splitlines() if ln.startswith("+ ")]
    assert len(steps) == 3 and [s.split()[1] for s in steps[:2]] == ["srun", "srun"]
    assert all("--transport gloo" in s for s in steps[:2])
    assert "-m kvbench.fit" in steps[2] and "--expect-link tcp" in steps[2]


def test_rdma_job_fit_skips_the_layerwise_totals_instead_of_aborting(jobs):
    job, _ = jobs["rdma_cpu"]
    log = job.log.read_text()
    assert "pattern sequential,layerwise" in log.replace("--", "")
    assert "skipped" in log and "compute" in log  # the fit names the groups it left out


def test_sharded_job_ran_four_ranks_over_two_nodes_under_mpirun(jobs):
    job, _ = jobs["sharded"]
    rec = json.loads(next(run_folder(job).glob("*.jsonl")).read_text().splitlines()[0])
    assert rec["world_size"] == 4 and rec["pattern"] == "sharded"
    nodes = [rank["variables"]["SLURM_NODEID"] for rank in rec["env"]["ranks"]]
    assert sorted(nodes) == ["0", "0", "1", "1"]
    assert "mpirun -n 4" in job.log.read_text()


# (job, GPUs over the whole allocation, nodes): as each script's #SBATCH lines ask
@pytest.mark.parametrize("name, gpus, nodes", [("gpu_nvlink", "gpu:2", 1), ("gpu_rdma", "gpu:2", 2),
                                               ("gpu_tp", "gpu:8", 2), ("gpu_matrix", "gpu:2", 2)])
def test_gpu_job_is_placed_then_stops_with_one_line_and_exit_2(jobs, name, gpus, nodes):
    job, st = jobs[name]
    log = job.log.read_text()
    assert (st["JobState"], st["ExitCode"]) == ("FAILED", "2:0"), log
    assert st.get("JOB_GRES") == gpus and st["NumNodes"] == str(nodes)
    assert re.match(r"n[12]$", st["BatchHost"])
    errors = [ln for ln in log.splitlines() if "error" in ln]
    assert len(errors) == 1 and "needs a CUDA GPU" in errors[0], log
    assert "CUDA_VISIBLE_DEVICES=" in errors[0]  # Slurm's binding of the fake GPUs
    # nothing was launched: no `-m kvbench.p2p` (or matrix) step (the GPU check is
    # kvbench.p2p.gpu_select)
    assert "Traceback" not in log and not re.search(r"-m kvbench\.(p2p|matrix)(\s|$)", log, re.M)
    assert list(job.out_root.iterdir()) == []  # and nothing written


def test_status_reports_the_daemons_and_both_nodes(cluster):
    r = subprocess.run([str(CLUSTER), "status", str(cluster.dir)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    for daemon in ("munged", "slurmctld", "slurmd-n1", "slurmd-n2"):
        assert re.search(rf"^{daemon}: running \(pid \d+\)$", r.stdout, re.M), r.stdout
    assert re.search(r"^n1 ", r.stdout, re.M) and re.search(r"^n2 ", r.stdout, re.M)
    again = subprocess.run([str(CLUSTER), "up", str(cluster.dir)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "already up" in again.stderr
    assert set(_daemon_pids(cluster.dir)) == {"munged", "slurmctld", "slurmd-n1", "slurmd-n2"}
