"""The host's fastest single-thread copy between two host buffers, and its name.

torch's `Tensor.copy_` on CPU tensors runs well below the C library's memcpy on some hosts
(issue 40: 6.8 GB/s against 12.9 GB/s for the same 625 MiB on this project's Intel hosts;
about 19 GB/s both on AMD), so a transport that copies host bytes with `copy_` measures torch,
not the host. kvbench's own host-to-host copies (the ipc transport's one copy) go through
`memcpy` below (libc `memmove` through ctypes, on the tensors' data pointers; ctypes releases
the GIL for the call), and `--baseline`'s single-process yardstick times the candidates in
`CANDIDATES` and keeps the fastest, by name (kvbench/p2p/baseline.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from kvbench.p2p.registry import LazyModule

# imported on first use: the ipc transport imports this module, and the registry imports it
# without torch (kvbench.p2p.registry)
torch = LazyModule("torch")

METHOD = "ctypes.memmove"  # what `memcpy` runs, as records name it


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src`'s bytes into `dst`: two contiguous host tensors of the same byte size
    (a ValueError otherwise: a wrong call must not scribble past a buffer)."""
    n = nbytes_of(dst)
    if nbytes_of(src) != n:
        raise ValueError(f"memcpy: {nbytes_of(src)} bytes into a {n}-byte buffer")
    for t in (dst, src):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("memcpy: both tensors must be contiguous host tensors")
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _numpy_copyto(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    d, s = dst.numpy(), src.numpy()  # views over the same memory, made once
    return lambda: np.copyto(d, s)


def _torch_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:  # one thread, like the others (copy_ splits a large copy over torch's pool)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            dst.copy_(src)
        finally:
            torch.set_num_threads(threads)
    return copy


def _memmove(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    return lambda: memcpy(dst, src)


# name -> (dst, src) -> a no-argument single-thread copy of src into dst. numpy.copyto first:
# the machine's memcpy as numpy calls it, the reference issue 40 names; torch copy_ last, the
# copy kvbench used before, kept so that a record shows what it would have judged against.
CANDIDATES: dict[str, Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]] = {
    "numpy.copyto": _numpy_copyto,
    METHOD: _memmove,
    "torch copy_": _torch_copy,
}
