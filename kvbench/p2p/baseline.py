"""Yardsticks for harness overhead, timed in the same run as the handoff they judge.

Host memory (cpu, cpu-async): a bare mpi4py Send/Recv loop on the same bytes, rank 0 -> 1
plus a 1-byte ack; no tensors, no registry, no polling helpers. If kvbench's own `mpi`
numbers fall well below it, the harness is in the way.

GPU memory (cuda): a host-buffer MPI loop would compare a device handoff against a host
memcpy. Instead rank 0 times a copy of the same bytes within its GPU (torch copy_) and, when
it sees two GPUs, from its GPU to the next one (torch's cross-device copy_, i.e.
cudaMemcpyPeer over NVLink/PCIe); vs_baseline compares against the peer copy when there is
one, else the same-device copy.
"""

from __future__ import annotations

import time

import numpy as np

from kvbench.records.stats import percentile
from kvbench.units import gb_per_s

_MAX = 1 << 30


def baseline_kinds(device: str, visible_gpus: int) -> list[str]:
    """Which yardsticks a run on `device` gets, the one vs_baseline uses last."""
    if device == "cuda":
        return ["device_copy", "peer_copy"] if visible_gpus >= 2 else ["device_copy"]
    return ["bare_mpi"]


LABELS = {"bare_mpi": "bare mpi4py Send/Recv", "device_copy": "same-GPU copy",
          "peer_copy": "GPU-to-GPU peer copy"}


def baseline_gbps(comm, nbytes: int | None, device: str, args) -> dict[str, float] | None:
    """Median GB/s of each yardstick for `nbytes` (collective; rank 0 gets {kind: GB/s})."""
    nbytes = comm.bcast(nbytes, root=0)
    iters = comm.bcast(max(args.min_iters, min(args.iters, 10)), root=0)
    visible = 0
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count()
    out = {}
    for kind in baseline_kinds(device, visible):
        if kind == "bare_mpi":
            out[kind] = bare_mpi_gbps(comm, nbytes, iters)
        else:
            got = _copy_gbps(nbytes, iters, peer=kind == "peer_copy") if comm.Get_rank() == 0 else None
            comm.Barrier()
            out[kind] = got
    return out if comm.Get_rank() == 0 else None


def bare_mpi_gbps(comm, nbytes: int, iters: int, warmup: int = 2) -> float | None:
    """Median GB/s of a plain Send/Recv + 1-byte ack, rank 0 -> 1 (collective; rank 0 gets it)."""
    rank = comm.Get_rank()
    # Touch every page: an untouched buffer reads as the shared zero page, which is
    # cache-hot and makes the yardstick unrealistically fast.
    buf = np.full(nbytes if rank < 2 else 0, 0x5A, dtype=np.uint8)
    pieces = [buf[a:a + _MAX] for a in range(0, nbytes, _MAX)]
    ack = np.zeros(1, dtype=np.uint8)
    times = []
    from mpi4py import MPI

    for i in range(warmup + iters):
        comm.Barrier()
        if rank == 0:
            t0 = MPI.Wtime()
            for p in pieces:
                comm.Send(p, dest=1, tag=9001)
            comm.Recv(ack, source=1, tag=9002)
            if i >= warmup:
                times.append((MPI.Wtime() - t0) * 1e3)
        elif rank == 1:
            for p in pieces:
                comm.Recv(p, source=0, tag=9001)
            comm.Send(ack, dest=0, tag=9002)
    comm.Barrier()
    return gb_per_s(nbytes, percentile(times, 50)) if rank == 0 else None


def _copy_gbps(nbytes: int, iters: int, peer: bool, warmup: int = 2) -> float:
    """Median GB/s of copy_ between two device buffers (same GPU, or this GPU -> the next)."""
    import torch

    here = torch.cuda.current_device()
    there = (here + 1) % torch.cuda.device_count() if peer else here
    src = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=f"cuda:{here}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{there}")
    times = []
    for i in range(warmup + iters):  # wall time, both devices synchronised: what a handoff pays
        torch.cuda.synchronize(here)
        torch.cuda.synchronize(there)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(here)
        torch.cuda.synchronize(there)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return gb_per_s(nbytes, percentile(times, 50))
