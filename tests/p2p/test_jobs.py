"""The Slurm job scripts without a cluster: valid bash that stops on the first error, finds
jobs/_common.sh from a spooled copy, prints (--dry-run) commands the benchmark and the fit
accept, with the launcher, sizes, link and output folder the environment asks for.
tests/test_slurm.py runs them for real under sbatch."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kvbench.fit import cli as fit
from kvbench.p2p import args as p2p
from tests.conftest import PY, ROOT

JOBS = ROOT / "jobs"
SCRIPTS = sorted(JOBS.glob("*.sbatch"))
P2P_SCRIPTS = [s for s in SCRIPTS if s.stem != "matrix"]  # the matrix job fits itself
GPU_SCRIPTS = {"intra_node_nvlink", "inter_node_rdma", "sharded_tp", "matrix"}


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "KVBENCH_", "OMPI_"))}
    env.update({"KVBENCH_PY": PY, **extra})
    return env


def run_job(script: Path, *args: str, cwd: Path = ROOT, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=job_env(**extra))


def commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def test_there_is_a_script_per_topology():
    names = {s.stem for s in SCRIPTS}
    assert {"intra_node_nvlink", "inter_node_rdma", "inter_node_tcp", "sharded_tp"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_stops_on_errors_before_doing_anything(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --nodes=" in text and "#SBATCH --time=" in text
    code = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert code[0] == "set -euo pipefail"  # in the script itself, not only in a sourced file
    assert "SLURM_SUBMIT_DIR" in text  # sbatch runs a spooled copy: $0's folder is the spool


@pytest.mark.parametrize("script", P2P_SCRIPTS, ids=lambda p: p.name)
def test_dry_run_prints_commands_the_benchmark_and_the_fit_accept(script, tmp_path):
    r = run_job(script, "--dry-run", KVBENCH_OUT_ROOT=str(tmp_path))
    assert r.returncode == 0, r.stderr
    cmds = commands(r.stdout)
    steps = [c for c in cmds if "kvbench.p2p" in c]
    fits = [c for c in cmds if "kvbench.fit" in c]
    assert steps and len(fits) == 1 and cmds[-1] is fits[0]
    for c in steps:
        args = c[c.index("kvbench.p2p") + 1:]
        p2p.raw_sizes(p2p.build_parser().parse_args(args))
        assert args[args.index("--min-iters") + 1] == "10"  # the fewest rounds an interval needs
        launcher = c[2] if c[0] == "env" else c[0]  # env VAR=value: a step's own setting
        assert launcher == "srun" and "--mpi=pmix" in c  # the default launcher
    fargs = fit.build_parser().parse_args(fits[0][fits[0].index("kvbench.fit") + 1:])
    assert float(fargs.line_rate_gbps) > 0 and fargs.expect_link  # armed from the declared link
    if script.stem in GPU_SCRIPTS:
        assert "--require-cuda" in cmds[0]  # the GPU check comes before any launch
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_matrix_dry_run_prints_steps_kvbench_matrix_accepts(tmp_path):
    """One `kvbench matrix` step per transport, armed with the declared link; no fit step (the
    matrix fits every pair itself); the GPU check first; the flags are the matrix's and p2p's."""
    from kvbench.matrix import cli as matrix

    r = run_job(JOBS / "matrix.sbatch", "--dry-run", KVBENCH_OUT_ROOT=str(tmp_path),
                KVBENCH_TRANSPORTS="nccl,nixl", KVBENCH_EXPECT_LOCAL_LINK="nvlink")
    assert r.returncode == 0, r.stderr
    cmds = commands(r.stdout)
    assert "--require-cuda" in cmds[0]
    steps = [c for c in cmds if "kvbench.matrix" in c]
    assert len(steps) == 2 == len(cmds) - 1 and not any("kvbench.fit" in c for c in cmds)
    for c, transport in zip(steps, ("nccl", "nixl"), strict=True):
        assert c[0] == "srun" and "--mpi=pmix" in c
        rules, rest = matrix.measure_parser().parse_known_args(c[c.index("kvbench.matrix") + 1:])
        assert (rules.expect_link, rules.expect_local_link) == ("rdma", "nvlink")  # ib-ndr
        args = p2p.build_parser().parse_args(matrix._p2p_argv(rest))
        assert (args.pattern, args.transport, args.sizes) == ("matrix", transport, "300,2000,8192")
        assert args.min_iters == 10 and args.schedule == "rounds"
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_dry_run_by_environment_and_settings_by_environment(tmp_path):
    r = run_job(JOBS / "sharded_tp.sbatch", KVBENCH_DRY_RUN="1", KVBENCH_LAUNCH="mpirun",
                SLURM_NTASKS="4", KVBENCH_DEVICE="cpu", KVBENCH_TRANSPORTS="mpi,gloo",
                KVBENCH_SIZES="16,64", KVBENCH_P2P_ARGS="--iters 5", KVBENCH_LINK="ib-hdr",
                KVBENCH_OUT_ROOT=str(tmp_path))
    assert r.returncode == 0, r.stderr
    cmds = commands(r.stdout)
    steps = [c for c in cmds if "kvbench.p2p" in c]
    assert [c[c.index("--transport") + 1] for c in steps] == ["mpi", "gloo"]
    for c in steps:
        assert Path(c[0]).name == "mpirun" and c[1:3] == ["-n", "4"]
        assert c[c.index("--tp") + 1] == "2" and c[c.index("--sizes") + 1] == "16,64"
        assert "--iters" in c and "--require-cuda" not in " ".join(cmds[0])
        assert "--min-iters" not in c  # KVBENCH_P2P_ARGS sets the iterations itself
        assert c[c.index("--out") + 1].startswith(str(tmp_path / "sharded_tp-local-"))
    fit_cmd = cmds[-1]
    assert fit_cmd[fit_cmd.index("--line-rate-gbps") + 1] == "25"
    assert fit_cmd[fit_cmd.index("--expect-link") + 1] == "rdma"
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_explicit_line_rate_and_expected_link_win_over_the_declared_link():
    r = run_job(JOBS / "inter_node_tcp.sbatch", "--dry-run", KVBENCH_LINE_RATE_GBPS="3.125",
                KVBENCH_EXPECT_LINK="host")
    fit_cmd = commands(r.stdout)[-1]
    assert fit_cmd[fit_cmd.index("--line-rate-gbps") + 1] == "3.125"
    assert fit_cmd[fit_cmd.index("--expect-link") + 1] == "host"


@pytest.mark.parametrize("extra, args, needle", [
    ({"KVBENCH_LAUNCH": "pdsh"}, (), "KVBENCH_LAUNCH must be srun or mpirun"),
    ({}, ("--wet-run",), "unknown argument --wet-run"),
    ({"KVBENCH_LINK": "token-ring"}, ("--dry-run",), "unknown link 'token-ring'"),
    ({"KVBENCH_PY": "/nonexistent/python"}, (), "no Python at /nonexistent/python"),
])
def test_bad_settings_stop_with_one_line_and_exit_2(extra, args, needle):
    r = run_job(JOBS / "inter_node_tcp.sbatch", *args, **extra)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_srun_with_more_than_two_ranks_per_node_warns_to_use_mpirun():
    r = run_job(JOBS / "sharded_tp.sbatch", "--dry-run", SLURM_TASKS_PER_NODE="4(x2)",
                SLURM_NTASKS="8")
    assert r.returncode == 0 and "use KVBENCH_LAUNCH=mpirun" in r.stderr
    r = run_job(JOBS / "sharded_tp.sbatch", "--dry-run", SLURM_TASKS_PER_NODE="2(x2)")
    assert "KVBENCH_LAUNCH=mpirun" not in r.stderr


def spool_copy(script: Path, tmp_path: Path) -> Path:
    """What sbatch runs: a copy of the script in slurmd's spool folder, nothing beside it."""
    spool = tmp_path / "slurmd-n1" / "job00001"
    spool.mkdir(parents=True)
    return Path(shutil.copy(script, spool / "slurm_script"))


@pytest.mark.parametrize("submit_dir", [ROOT, JOBS], ids=["from the root", "from jobs/"])
def test_a_spooled_copy_finds_common_through_the_submit_dir(tmp_path, submit_dir):
    copy = spool_copy(JOBS / "inter_node_tcp.sbatch", tmp_path)
    r = run_job(copy, "--dry-run", cwd=submit_dir, SLURM_SUBMIT_DIR=str(submit_dir),
                SLURM_JOB_ID="1", SLURM_JOB_NAME="kvbench-tcp")
    assert r.returncode == 0, r.stderr
    assert "kvbench-tcp-1-" in commands(r.stdout)[0][-1]


def test_a_spooled_copy_without_the_submit_dir_stops_at_once(tmp_path):
    # The bug this replaces: `source $(dirname $0)/_common.sh` from the spool, and a script
    # that ran on past the failure.
    copy = spool_copy(JOBS / "inter_node_tcp.sbatch", tmp_path)
    r = run_job(copy, "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and "no _common.sh" in r.stderr and r.stdout == ""


def test_every_run_gets_a_folder_of_its_own(tmp_path):
    script = ('set -euo pipefail; c=$1; shift; KVBENCH_DEFAULT_LINK=eth-10g; source "$c"; '
              'kvb_make_out; a=$OUT; kvb_make_out; echo "$a"; echo "$OUT"')
    r = subprocess.run(["bash", "-c", script, "job", str(JOBS / "_common.sh")], capture_output=True,
                       text=True, env=job_env(KVBENCH_OUT_ROOT=str(tmp_path), SLURM_JOB_ID="7",
                                              SLURM_JOB_NAME="kvbench-tcp"), timeout=60)
    assert r.returncode == 0, r.stderr
    a, b = r.stdout.split()
    assert a != b and Path(a).is_dir() and Path(b).is_dir()
    assert Path(a).name.startswith("kvbench-tcp-7-") and Path(a).parent == tmp_path
