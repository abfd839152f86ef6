"""Whether the loaded MPI library takes device pointers: asked of libmpi itself.

mpi4py wraps no CUDA query (there is no `MPI.Query_cuda_support`), so the answer comes from
the library mpi4py loaded, through ctypes: Open MPI's (and MPICH 4.1+'s)
`MPIX_Query_cuda_support()`, else MPICH's `MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &ok)`.
The library is found where the process mapped it (/proc/self/maps), so the query reaches the
very copy MPI runs with. The pip Open MPI wheel is built without CUDA: it has the symbol and
answers 0; device-direct needs the cluster's CUDA-aware MPI.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_LIBMPI = re.compile(r"(/\S*/libmpi\.so[.\d]*)\s*$")
MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h: CUDA 0, ZE 1, HIP 2


@dataclass(frozen=True)
class CudaSupport:
    aware: bool
    how: str  # what was asked, of which library, and the answer (recorded in transport_info)


def loaded_libmpi(maps: str | None = None) -> str | None:
    """Path of the libmpi this process has mapped (None: not found)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        m = _LIBMPI.search(line)
        if m:
            return m.group(1)
    return None


def query(lib, where: str) -> CudaSupport:
    """Ask an opened library (a ctypes.CDLL or a stand-in with the same attributes)."""
    fn = getattr(lib, "MPIX_Query_cuda_support", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        answer = int(fn())
        return CudaSupport(answer != 0, f"MPIX_Query_cuda_support() = {answer} ({where})")
    fn = getattr(lib, "MPIX_GPU_query_support", None)
    if fn is not None:
        ok = ctypes.c_int(0)
        rc = int(fn(ctypes.c_int(MPIX_GPU_SUPPORT_CUDA), ctypes.byref(ok)))
        if rc == 0:
            return CudaSupport(ok.value != 0, f"MPIX_GPU_query_support(CUDA) = {ok.value} ({where})")
        return CudaSupport(False, f"MPIX_GPU_query_support(CUDA) failed with {rc} ({where})")
    return CudaSupport(False, f"no CUDA query in {where}: taken as not CUDA-aware")


@lru_cache(maxsize=1)
def cuda_support() -> CudaSupport:
    """The loaded MPI's answer (MPI is initialised first: the query needs it)."""
    from mpi4py import MPI  # noqa: F401 - loads and initialises libmpi

    path = loaded_libmpi()
    if path is None:
        return CudaSupport(False, "libmpi not found among the mapped libraries: taken as not "
                                  "CUDA-aware")
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return CudaSupport(False, f"could not open {path}: {exc}")
    return query(lib, path)
