"""Is the MPI CUDA-aware? Asked of the loaded libmpi through ctypes (issue 20, defect 1).

mpi4py has no `MPI.Query_cuda_support`: the old lookup always said no, so `auto` always
staged and `yes` always refused, even on a CUDA-aware MPI. The pip Open MPI wheel used here
has `MPIX_Query_cuda_support` and answers 0 (built without CUDA); stand-in libraries answer 1
to show that a CUDA-aware library is believed."""

from __future__ import annotations

import ctypes

from kvbench.p2p.transports import mpi, mpi_cuda


def test_the_wheels_libmpi_is_asked_and_answers_no():
    got = mpi_cuda.cuda_support()
    assert got.aware is False
    assert got.how.startswith("MPIX_Query_cuda_support() = 0 ("), got.how
    assert "libmpi.so" in got.how
    assert mpi.cuda_aware() is False


def test_the_library_is_the_one_mpi4py_mapped():
    from mpi4py import MPI  # noqa: F401

    path = mpi_cuda.loaded_libmpi()
    assert path is not None and "libmpi.so" in path
    assert hasattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")


def test_maps_parsing_finds_libmpi_among_other_libraries():
    maps = ("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
            "7f02-7f03 r-xp 0 08:01 2 /opt/mpi/lib/libmpi.so.12.4.1\n"
            "7f04-7f05 r-xp 0 08:01 3 /opt/mpi/lib/libmpi_cxx.so.40\n")
    assert mpi_cuda.loaded_libmpi(maps) == "/opt/mpi/lib/libmpi.so.12.4.1"
    assert mpi_cuda.loaded_libmpi("7f00-7f01 r-xp 0 0:0 1 /usr/lib/libc.so.6\n") is None


class _Lib:
    """A stand-in library exposing only the functions given."""

    def __init__(self, **fns):
        self.__dict__.update(fns)


def test_a_cuda_aware_open_mpi_is_believed():
    got = mpi_cuda.query(_Lib(MPIX_Query_cuda_support=lambda: 1), "/x/libmpi.so.40")
    assert got == mpi_cuda.CudaSupport(True, "MPIX_Query_cuda_support() = 1 (/x/libmpi.so.40)")


def test_mpich_gpu_query_is_the_fallback():
    def gpu_query(kind, out):
        assert kind.value == mpi_cuda.MPIX_GPU_SUPPORT_CUDA
        out._obj.value = 1  # what MPICH writes through the pointer
        return 0

    got = mpi_cuda.query(_Lib(MPIX_GPU_query_support=gpu_query), "/y/libmpi.so.12")
    assert got.aware is True and got.how.startswith("MPIX_GPU_query_support(CUDA) = 1")
    failed = mpi_cuda.query(_Lib(MPIX_GPU_query_support=lambda k, o: 5), "/y/libmpi.so.12")
    assert failed.aware is False and "failed with 5" in failed.how


def test_a_library_without_a_query_is_not_cuda_aware():
    got = mpi_cuda.query(_Lib(), "/z/libmpi.so")
    assert got.aware is False and "no CUDA query in /z/libmpi.so" in got.how
