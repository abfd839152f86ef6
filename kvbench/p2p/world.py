"""MPI for `kvbench p2p`: a start-up and a tear-down that cannot hang, and a world
communicator whose blocking collectives are bounded by the watchdog (kvbench.p2p.watchdog).

Start-up: mpi4py normally calls MPI_Init_thread when `mpi4py.MPI` is imported, and holds
Python's GIL while it waits for every rank of the job to arrive. A peer stopped before it
reached MPI_Init then hangs this rank where no Python thread can run. So `init` imports
mpi4py with `rc.initialize = False`, arms the watchdog, and calls the MPI library's own
MPI_Init_thread through ctypes, which releases the GIL while the call blocks; MPI_Finalize
(a fence over every rank in Open MPI) is called the same way. mpi4py then works on the
initialised library as usual (errors raise exceptions, as mpi4py sets them up itself).

`world()` is MPI.COMM_WORLD as a subclass whose blocking collectives (`allgather`, `gather`,
`bcast`, `allreduce`, `Barrier`, `Dup`, `Split_type`) run under `WATCHDOG.bounded`; the
point-to-point calls the timed handoff makes (Ibarrier, Irecv, Send of the 1-byte notice)
are mpi4py's own, untouched. Communicators derived from it (`Dup`) are bounded too.
`allreduce` of Python objects is an allgather and a local reduction: mpi4py's pickle-based
allreduce runs a Python operator inside MPI and keeps the GIL while it waits.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys

from kvbench.p2p.watchdog import WATCHDOG

_LIB = re.compile(r"/lib(mpi|mpich)[^/]*\.so[^/]*$")


def _libmpi():
    """The loaded MPI library (ctypes handle) exporting MPI_Init_thread, or None."""
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if _LIB.search(line.strip())})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPI_Init_thread") and hasattr(lib, "MPI_Finalize"):
            return lib
    return None


def init() -> bool:
    """Start MPI, bounded by the watchdog; True if this call started it (then `finalize` is
    this caller's to call). A program that imported mpi4py.MPI first owns MPI itself."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    if MPI.Is_initialized():
        return False
    WATCHDOG.phase("MPI start-up")
    WATCHDOG.leave_if_held("MPI_Init_thread")
    with WATCHDOG.bounded("MPI_Init_thread"):
        lib = _libmpi()
        if lib is None:  # keeps the GIL while it waits: only the watchdog's alarm bounds it
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        else:
            provided = ctypes.c_int(0)
            code = lib.MPI_Init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE),
                                       ctypes.byref(provided))
            if code != 0:
                raise RuntimeError(f"MPI_Init_thread failed with error code {code}")
            for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):  # what mpi4py's own start-up does
                comm.Set_errhandler(MPI.ERRORS_RETURN)
    return True


def finalize() -> None:
    """MPI_Finalize, bounded (call it only if `init` returned True)."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    with WATCHDOG.bounded("MPI_Finalize"):
        lib = _libmpi()
        if lib is None:
            MPI.Finalize()
        else:
            lib.MPI_Finalize()


@functools.cache
def _bounded_class():
    from mpi4py import MPI

    class BoundedComm(MPI.Intracomm):
        """An intracommunicator whose blocking collectives cannot outlive --timeout."""

        __slots__ = ()

        def allgather(self, sendobj):
            with WATCHDOG.bounded("MPI allgather"):
                return super().allgather(sendobj)

        def gather(self, sendobj, root=0):
            with WATCHDOG.bounded("MPI gather"):
                return super().gather(sendobj, root)

        def bcast(self, obj, root=0):
            with WATCHDOG.bounded("MPI bcast"):
                return super().bcast(obj, root)

        def allreduce(self, sendobj, op=MPI.SUM):
            return functools.reduce(op, self.allgather(sendobj))

        def Barrier(self):
            with WATCHDOG.bounded("MPI barrier"):
                return super().Barrier()

        barrier = Barrier

        def Dup(self, info=None):
            with WATCHDOG.bounded("MPI_Comm_dup"):
                return super().Dup() if info is None else super().Dup(info)

        def Split_type(self, split_type, key=0, info=MPI.INFO_NULL):
            with WATCHDOG.bounded("MPI_Comm_split_type"):
                return super().Split_type(split_type, key, info)

    return BoundedComm


def world():
    """MPI.COMM_WORLD with its blocking collectives bounded (see the module doc)."""
    from mpi4py import MPI

    return _bounded_class()(MPI.COMM_WORLD)
