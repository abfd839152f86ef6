"""The right GPU for each rank: its node-local rank, from the launcher, checked.

Without a choice every rank opens GPU 0, and an "NVLink" run between two ranks is a copy
inside one device. The node-local rank comes from the launcher (Open MPI's
OMPI_COMM_WORLD_LOCAL_RANK, MPICH/Intel MPI's MPI_LOCALRANKID, Slurm's SLURM_LOCALID) and is
checked against MPI's shared-memory split (COMM_TYPE_SHARED):

- Under `srun --mpi=pmix` with the pip Open MPI wheel the split puts every rank alone (size
  1: the PMIx server gives no locality), so the launcher's number is the only evidence.
- Under `mpirun` inside an allocation SLURM_LOCALID is that of the daemon (0 for every rank
  of a node); OMPI_COMM_WORLD_LOCAL_RANK comes first and is right.
- A launcher number that does not fit the split (>= its size when the split sees several
  ranks) loses to the split.

Two ranks on one physical GPU (same host, same UUID) are refused with one line and exit
status 2 unless --allow-shared-gpu: a handoff inside one device measures no link. Each
rank's choice (index, UUID, PCI bus id, where the local rank came from) is recorded.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

# Launcher variables for the node-local rank, most specific first.
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


@dataclass(frozen=True)
class LocalRank:
    rank: int
    source: str  # the variable it came from, or "COMM_TYPE_SHARED"
    note: str | None = None


def local_rank(env: Mapping[str, str], split_rank: int, split_size: int) -> LocalRank:
    """The node-local rank from the launcher's variables, checked against the split."""
    for var in LOCAL_RANK_VARS:
        raw = env.get(var)
        if raw is None or not raw.strip().isdigit():
            continue
        n = int(raw)
        if split_size > 1 and n >= split_size:
            return LocalRank(split_rank, "COMM_TYPE_SHARED",
                             f"{var}={n} does not fit {split_size} ranks sharing this node")
        note = None
        if split_size == 1 and n > 0:
            note = (f"{var}={n} but COMM_TYPE_SHARED sees this rank alone (the launcher gives "
                    "MPI no locality, e.g. srun --mpi=pmix): trusting the launcher")
        elif split_size > 1 and n != split_rank:
            note = f"{var}={n}, COMM_TYPE_SHARED rank {split_rank}: trusting the launcher"
        return LocalRank(n, var, note)
    return LocalRank(split_rank, "COMM_TYPE_SHARED")


def device_index(local: int, n_visible: int, allow_shared: bool) -> tuple[int | None, str | None]:
    """(CUDA device index, error). One visible GPU is this rank's own (Slurm's per-task
    binding); several are shared by the node's ranks, one each by local rank."""
    if n_visible < 1:
        return None, "needs a CUDA GPU and none is visible"
    if n_visible == 1:
        return 0, None
    if local < n_visible:
        return local, None
    if allow_shared:
        return local % n_visible, None
    return None, (f"node-local rank {local} but only {n_visible} GPUs are visible: two ranks "
                  "would share a GPU (pass --allow-shared-gpu to measure that anyway)")


def shared_gpu_error(choices: Sequence[Mapping], allow_shared: bool) -> str | None:
    """One line when two ranks ended up on the same physical GPU of one host."""
    if allow_shared:
        return None
    seen: dict[tuple, int] = {}
    for rank, c in enumerate(choices):
        key = (c.get("host"), c.get("uuid") or f"index {c.get('index')}")
        if key in seen:
            return (f"ranks {seen[key]} and {rank} both use GPU {key[1]} on {key[0]}: a handoff "
                    "inside one device measures no link (give each rank its own GPU, e.g. "
                    "--ntasks-per-node <= GPUs per node, or pass --allow-shared-gpu)")
        seen[key] = rank
    return None


@dataclass(frozen=True)
class GpuChoice:
    host: str
    index: int
    uuid: str | None
    pci_bus_id: str | None
    name: str | None
    local_rank: int
    local_rank_source: str
    note: str | None
    cuda_visible_devices: str | None


def _identity(index: int) -> tuple[str | None, str | None, str | None]:
    """(UUID, PCI bus id, name) of a CUDA device, as far as this torch build tells."""
    import torch

    p = torch.cuda.get_device_properties(index)
    uuid = getattr(p, "uuid", None)
    uuid = f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith("GPU-") else uuid
    bus = None
    if hasattr(p, "pci_bus_id"):
        bus = (f"{getattr(p, 'pci_domain_id', 0):08x}:{p.pci_bus_id:02x}:"
               f"{getattr(p, 'pci_device_id', 0):02x}.0")
    return (str(uuid) if uuid is not None else None), bus, p.name


def select_local_gpu(comm, allow_shared: bool = False,
                     env: Mapping[str, str] | None = None) -> tuple[list[dict | None], str | None]:
    """Collective: every rank picks and binds its GPU. Returns every rank's choice (dicts, in
    rank order) and the first error any rank hit; the same on every rank."""
    import torch
    from mpi4py import MPI

    env = os.environ if env is None else env
    split = comm.Split_type(MPI.COMM_TYPE_SHARED)
    lr = local_rank(env, split.Get_rank(), split.Get_size())
    split.Free()
    index, error = device_index(lr.rank, torch.cuda.device_count(), allow_shared)
    choice = None
    if index is not None:
        torch.cuda.set_device(index)
        uuid, bus, name = _identity(index)
        choice = asdict(GpuChoice(socket.gethostname(), index, uuid, bus, name, lr.rank,
                                  lr.source, lr.note, env.get("CUDA_VISIBLE_DEVICES")))
    everyone = comm.allgather((choice, error))
    first = next(((r, e) for r, (_, e) in enumerate(everyone) if e), None)
    choices = [c for c, _ in everyone]
    if first:
        return choices, f"rank {first[0]}: {first[1]}"
    return choices, shared_gpu_error(choices, allow_shared)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvbench.p2p.gpu_select --require-cuda`: the job scripts' check before launch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv not in ([], ["--require-cuda"]):
        print("usage: python -m kvbench.p2p.gpu_select [--require-cuda]", file=sys.stderr)
        return 2
    import torch

    host = socket.gethostname()
    node = os.environ.get("SLURMD_NODENAME", host)
    if not torch.cuda.is_available():
        print(f"kvbench: error: this job needs a CUDA GPU and none is visible on {node} "
              f"(torch {torch.__version__}: torch.cuda.is_available() is False; "
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})",
              file=sys.stderr)
        return 2
    for i in range(torch.cuda.device_count()):
        uuid, bus, name = _identity(i)
        print(f"{node}: cuda:{i} {name} {uuid or '-'} {bus or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
