"""Which GPU each rank takes: the decision logic under each launcher's environment (pure),
the refusal of two ranks on one GPU, the CLI check the GPU job scripts run, and the real
binding on a CUDA machine (skipped here)."""

from __future__ import annotations

import pytest

from kvbench.p2p.gpu_select import device_index, local_rank, shared_gpu_error
from tests.conftest import run_cli, run_mpi

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a core dependency
    HAS_CUDA = False


# Launcher environments as measured on the project's Slurm 22.05 cluster (scripts/slurm-cluster)
# with the pip Open MPI 5 wheel: what each rank sees, and what the split reports.
@pytest.mark.parametrize("env, split, want, source", [
    # srun --mpi=pmix, 2 ranks on a node: the split puts each rank alone (size 1), SLURM_LOCALID is right
    ({"SLURM_LOCALID": "1", "SLURM_PROCID": "1"}, (0, 1), 1, "SLURM_LOCALID"),
    ({"SLURM_LOCALID": "0"}, (0, 1), 0, "SLURM_LOCALID"),
    # mpirun inside sbatch: SLURM_LOCALID is the daemon's (0 for every rank), Open MPI's wins
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (1, 2), 1, "OMPI_COMM_WORLD_LOCAL_RANK"),
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (0, 2), 0, "OMPI_COMM_WORLD_LOCAL_RANK"),
    # MPICH / Intel MPI's hydra
    ({"MPI_LOCALRANKID": "3"}, (3, 4), 3, "MPI_LOCALRANKID"),
    # no launcher variable (a bare mpiexec of another MPI): the split decides
    ({}, (2, 4), 2, "COMM_TYPE_SHARED"),
    # a launcher number that cannot be right (stale SLURM_LOCALID from an outer step) loses
    ({"SLURM_LOCALID": "5"}, (1, 2), 1, "COMM_TYPE_SHARED"),
    # garbage is ignored
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "x", "SLURM_LOCALID": "1"}, (0, 1), 1, "SLURM_LOCALID"),
])
def test_local_rank_under_each_launcher(env, split, want, source):
    lr = local_rank(env, *split)
    assert (lr.rank, lr.source) == (want, source)


def test_local_rank_says_why_it_trusted_the_launcher_over_a_size_one_split():
    lr = local_rank({"SLURM_LOCALID": "1"}, 0, 1)
    assert lr.note and "alone" in lr.note and "SLURM_LOCALID=1" in lr.note
    assert local_rank({"SLURM_LOCALID": "0"}, 0, 1).note is None


@pytest.mark.parametrize("local, visible, allow, want", [
    (0, 2, False, 0), (1, 2, False, 1),
    (1, 1, False, 0),  # Slurm bound one GPU to this task: it is the rank's own
    (3, 4, False, 3),
    (2, 2, True, 0),   # explicitly shared
])
def test_device_index(local, visible, allow, want):
    assert device_index(local, visible, allow) == (want, None)


def test_device_index_refuses_more_ranks_than_gpus_and_says_how_to_allow_it():
    index, error = device_index(2, 2, False)
    assert index is None and "share a GPU" in error and "--allow-shared-gpu" in error
    assert device_index(0, 0, True)[1] == "needs a CUDA GPU and none is visible"


def _choice(host, uuid, index=0):
    return {"host": host, "uuid": uuid, "index": index}


def test_two_ranks_on_one_physical_gpu_are_refused():
    # Two Slurm nodes on one host that each expose "GPU 0" are the same device.
    err = shared_gpu_error([_choice("vm", "GPU-a"), _choice("vm", "GPU-a")], False)
    assert err and err.startswith("ranks 0 and 1 both use GPU GPU-a on vm")
    assert "\n" not in err


def test_same_index_on_different_hosts_or_devices_is_fine():
    assert shared_gpu_error([_choice("a", "GPU-a"), _choice("b", "GPU-a")], False) is None
    assert shared_gpu_error([_choice("a", "GPU-a"), _choice("a", "GPU-b")], False) is None
    assert shared_gpu_error([_choice("a", "GPU-a"), _choice("a", "GPU-a")], True) is None
    # without a UUID the index identifies the device
    assert shared_gpu_error([_choice("a", None, 0), _choice("a", None, 0)], False)
    assert shared_gpu_error([_choice("a", None, 0), _choice("a", None, 1)], False) is None


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a CUDA GPU")
def test_require_cuda_check_is_one_line_and_exit_2_without_a_gpu():
    r = run_cli("kvbench.p2p.gpu_select", "--require-cuda", env={"CUDA_VISIBLE_DEVICES": "0,1",
                                                          "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "Traceback" not in r.stderr
    assert "CUDA_VISIBLE_DEVICES=0,1" in lines[0]


def test_p2p_accepts_allow_shared_gpu():
    from kvbench.p2p import args as p2p

    assert p2p.build_parser().parse_args(["--allow-shared-gpu"]).allow_shared_gpu is True
    assert p2p.build_parser().parse_args([]).allow_shared_gpu is False


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (binds each rank to its own device "
                                         "and records its UUID and PCI bus id)")
def test_each_rank_binds_its_own_gpu_and_records_it(tmp_path):  # pragma: no cover - GPU only
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs on this node")
    r = run_mpi(2, "kvbench.p2p", "--device", "cuda", "--transport", "mpi", "--bytes", "1M",
                "--iters", "3", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    import json

    rec = json.loads(next(tmp_path.glob("*.jsonl")).read_text().splitlines()[0])
    gpus = rec["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["uuid"] != gpus[1]["uuid"] and all(g["pci_bus_id"] for g in gpus)
