"""A bare mpi4py Send/Recv loop on the same bytes: the yardstick for harness overhead.

No tensors, no registry, no polling helpers: rank 0 sends a numpy buffer, rank 1 receives
it and answers with one byte. If kvbench's own `mpi` numbers fall well below this, the
harness is in the way.
"""

from __future__ import annotations

import numpy as np

from kvbench.stats import percentile
from kvbench.units import gb_per_s

_MAX = 1 << 30


def bare_mpi_gbps(comm, nbytes: int | None, device: str, args, warmup: int = 2,
                  iters: int | None = None) -> float | None:
    """Median GB/s of a plain Send/Recv + 1-byte ack, rank 0 -> 1 (collective; rank 0 gets it)."""
    nbytes = comm.bcast(nbytes, root=0)
    iters = comm.bcast(iters or max(args.min_iters, min(args.iters, 10)), root=0)
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
