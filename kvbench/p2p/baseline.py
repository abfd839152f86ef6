"""Yardsticks timed in the same run as the handoff they judge, on the same bytes.

Host memory (cpu, cpu-async), two:
- `host_copy`: one process copies the bytes from one buffer into another, with the fastest
  single-thread copy the host has: each of kvbench.p2p.hostcopy.CANDIDATES (numpy.copyto,
  libc memmove through ctypes, torch `copy_`) is timed, interleaved, and the fastest is the
  floor, named (`baseline_host_copy_method`, each candidate in
  `baseline_host_copy_by_method_gbps`). torch's `copy_` runs at half of memcpy on some hosts
  (issue 40), so a floor timed with it alone would be kvbench's, not the machine's. No
  transport between two processes can beat one copy: it is the floor for every one-copy
  transport (ipc, MPI's shared memory with CMA/XPMEM).
- `bare_mpi`: a bare mpi4py Send/Recv loop rank 0 -> 1 plus a 1-byte ack; no tensors, no
  registry, no polling helpers. If kvbench's own `mpi` numbers fall well below it, the
  harness is in the way.

GPU memory (cuda), chosen from the GPUs ranks 0 and 1 recorded (not from what rank 0
happens to see): the same-GPU copy always, and when the two ranks hold different GPUs of one
host the copy between exactly those two (torch's cross-device copy_, cudaMemcpyPeer over
NVLink/PCIe). Ranks on different hosts get no device yardstick (no copy inside one node
stands for their link), and the record says so.

`vs_baseline` is kvbench's ratio to the last yardstick listed (bare MPI on host memory, the
peer copy when there is one on a GPU); `vs_<kind>` is the ratio to each.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from kvbench.p2p.harness import barrier, nap
from kvbench.records.stats import percentile
from kvbench.units import gb_per_s

_MAX = 1 << 30

LABELS = {"host_copy": "single-process copy", "bare_mpi": "bare mpi4py Send/Recv",
          "device_copy": "same-GPU copy", "peer_copy": "GPU-to-GPU peer copy"}


def same_gpu(a: Mapping, b: Mapping) -> bool:
    """Whether two recorded GPU choices (kvbench.p2p.gpu_select.GpuChoice) are one device."""
    if a.get("host") != b.get("host"):
        return False
    if a.get("uuid") and b.get("uuid"):
        return a["uuid"] == b["uuid"]
    return (a.get("index"), a.get("cuda_visible_devices")) == \
        (b.get("index"), b.get("cuda_visible_devices"))


def baseline_kinds(device: str, gpus: Sequence[Mapping | None] | None = None
                   ) -> tuple[list[str], str | None]:
    """(the yardsticks a run gets, the one vs_baseline uses last; a note when there is none),
    from the device and ranks 0 and 1's recorded GPUs."""
    if device != "cuda":
        return ["host_copy", "bare_mpi"], None
    a, b = (list(gpus or []) + [None, None])[:2]
    if a is None or b is None:
        return [], "no device yardstick: ranks 0 and 1 did not both record a GPU"
    if a.get("host") != b.get("host"):
        return [], (f"no device yardstick: ranks 0 and 1 are on different hosts ({a.get('host')}, "
                    f"{b.get('host')}); no copy inside one node stands for their link")
    if same_gpu(a, b):
        return ["device_copy"], None
    return ["device_copy", "peer_copy"], None


def baseline_gbps(comm, nbytes: int | None, kinds: Sequence[str], args,
                  gpus: Sequence[Mapping | None] | None = None
                  ) -> tuple[dict[str, float | None], dict] | None:
    """Median GB/s of each yardstick for `nbytes` (collective; rank 0 gets ({kind: GB/s},
    detail), detail naming the host copy's method and each candidate's GB/s when timed).
    Yardsticks timed by rank 0 alone leave the other ranks asleep in a polled barrier."""
    nbytes = comm.bcast(nbytes, root=0)
    iters = comm.bcast(max(args.min_iters, min(args.iters, 10)), root=0)
    rank = comm.Get_rank()
    out: dict[str, float | None] = {}
    detail: dict = {}
    for kind in kinds:
        if kind == "bare_mpi":
            out[kind] = bare_mpi_gbps(comm, nbytes, iters)
            continue
        got = None
        if rank == 0:
            if kind == "host_copy":
                by_method = host_copy_gbps(nbytes, iters)
                best = max(by_method, key=by_method.get)
                got = by_method[best]
                detail = {"host_copy_method": best, "host_copy_by_method_gbps": by_method}
            else:
                got = _device_copy(nbytes, iters, gpus, peer=kind == "peer_copy")
        barrier(comm, args.timeout, f"the {LABELS[kind]} yardstick",
                pause=nap if rank != 0 else None)
        out[kind] = got
    return (out, detail) if rank == 0 else None


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


def host_copy_gbps(nbytes: int, iters: int, warmup: int = 2) -> dict[str, float]:
    """Median GB/s of one process copying `nbytes` between two host buffers allocated as the
    KV is (kvbench.p2p.layout.empty), every page touched first, by each of
    hostcopy.CANDIDATES: {method: GB/s}. The candidates take turns within each iteration,
    so a load that comes and goes weighs on all of them alike."""
    import torch

    from kvbench.p2p.hostcopy import CANDIDATES
    from kvbench.p2p.layout import empty

    src = empty(nbytes, torch.uint8, "cpu").fill_(0x5A)
    dst = empty(nbytes, torch.uint8, "cpu").fill_(0)
    copies = {name: make(dst, src) for name, make in CANDIDATES.items()}
    times: dict[str, list[float]] = {name: [] for name in copies}
    for i in range(warmup + iters):
        for name, copy in copies.items():
            t0 = time.perf_counter()
            copy()
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: gb_per_s(nbytes, percentile(ts, 50)) for name, ts in times.items()}


def local_index(choice: Mapping) -> int | None:
    """This process's CUDA index of a recorded GPU (by UUID; None: not visible here)."""
    import torch

    from kvbench.p2p.gpu_select import _identity

    for i in range(torch.cuda.device_count()):
        if choice.get("uuid") and _identity(i)[0] == choice["uuid"]:
            return i
    return None


def _device_copy(nbytes: int, iters: int, gpus, peer: bool) -> float | None:
    """Rank 0: the same-GPU copy on its GPU, or the copy from its GPU to rank 1's (None when
    rank 1's GPU is not visible to rank 0, e.g. one GPU per task under Slurm)."""
    import torch

    here = torch.cuda.current_device()
    there = local_index(gpus[1]) if peer else here
    return None if there is None else _copy_gbps(nbytes, iters, here, there)


def _copy_gbps(nbytes: int, iters: int, here: int, there: int, warmup: int = 2) -> float:
    """Median GB/s of copy_ between two device buffers (GPU `here` -> GPU `there`)."""
    import torch

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
