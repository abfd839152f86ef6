"""The CUDA pack/unpack kernels in `cuda/kv_pack.cu`, compiled at run time with NVRTC.

Used by paged KV on a GPU with `--pack-kernel cuda` (instead of torch's index_select /
index_copy_), so the cost of packing scattered blocks for a one-message handoff can be
measured with a purpose-built copy. Needs CuPy (`pip install 'kvbench[cuda]'`).

A message plan packs through a `BlockPacker`: one launch of `copy_blocks` per message (for a
whole handoff: every layer and part at once) over device tables of block addresses built
once per plan, with the CuPy function, the stream wrapper and the tables' CuPy views made
once and reused (issue 40: re-wrapping them per (layer, part) launch cost about 0.26 ms of
host time per launch on an H100 host). `block_pointers` (the tables) and
`copy_blocks_reference` (the kernel's semantics on host memory) run on a CPU and are tested
there against torch's pack; the kernel itself runs only on a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

SOURCE_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "cuda" / "kv_pack.cu",  # a checkout / editable install
    Path(__file__).resolve().parent / "cuda" / "kv_pack.cu",  # if packaged alongside
)
THREADS = 256


def source_path() -> Path:
    for p in SOURCE_CANDIDATES:
        if p.exists():
            return p
    raise FileNotFoundError("cuda/kv_pack.cu not found next to the kvbench package")


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, in one line, or None. The kernels are compiled here
    (NVRTC, once per process): a CuPy built for another CUDA than torch's imports fine and
    fails only at compile or launch time, which must not happen inside a measurement."""
    if not torch.cuda.is_available():
        return "--pack-kernel cuda needs a CUDA GPU and none is visible"
    major = (torch.version.cuda or "12").split(".")[0]
    try:
        import cupy
    except ImportError:
        return (f"--pack-kernel cuda needs CuPy: pip install cupy-cuda{major}x (torch's CUDA is "
                f"{torch.version.cuda}; the 'cuda' extra installs cupy-cuda12x)")
    try:
        source_path()
    except FileNotFoundError as exc:
        return str(exc)
    try:
        for name in ("gather_blocks", "scatter_blocks", "copy_blocks"):
            _module().get_function(name)
    except Exception as exc:  # noqa: BLE001 - NVRTC, driver or CUDA version mismatch
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return (f"--pack-kernel cuda: CuPy {getattr(cupy, '__version__', '?')} could not compile "
                f"{source_path().name} (torch's CUDA {torch.version.cuda}): {first[:200]}")
    return None


@lru_cache(maxsize=1)
def _module():
    import cupy

    return cupy.RawModule(code=source_path().read_text(), options=("--std=c++17",))


@lru_cache(maxsize=8)
def _function(name: str):
    return _module().get_function(name)


_STREAMS: dict[int, object] = {}  # torch stream handle -> its CuPy ExternalStream, made once


def _stream():
    """The current torch stream as a CuPy stream (wrapped once per stream)."""
    import cupy

    handle = torch.cuda.current_stream().cuda_stream
    if handle not in _STREAMS:
        _STREAMS[handle] = cupy.cuda.ExternalStream(handle)
    return _STREAMS[handle]


def _launch(name: str, src: torch.Tensor, table: torch.Tensor, dst: torch.Tensor,
            block_bytes: int, n_blocks: int) -> None:
    import cupy

    fn = _function(name)
    stream = _stream()
    grid = (min(max(n_blocks, 1), 65535),)
    with stream:
        fn(grid, (THREADS,), (cupy.asarray(src.reshape(-1).view(torch.uint8)),
                              cupy.asarray(table.to(torch.int64).contiguous()),
                              cupy.asarray(dst.reshape(-1).view(torch.uint8)),
                              cupy.int64(block_bytes), cupy.int64(n_blocks)))


def gather_blocks(pool: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = pool[table[i]] for a pool shaped [blocks, ...] (any dtype, contiguous)."""
    block_bytes = pool[0].numel() * pool.element_size()
    _launch("gather_blocks", pool, table, out, block_bytes, table.numel())
    return out


def scatter_blocks(packed: torch.Tensor, table: torch.Tensor, pool: torch.Tensor) -> None:
    """pool[table[i]] = packed[i]: the inverse of gather_blocks."""
    block_bytes = pool[0].numel() * pool.element_size()
    _launch("scatter_blocks", packed, table, pool, block_bytes, table.numel())


# -- one launch per message: tables of block addresses ---------------------------------------


def block_bytes_of(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def block_pointers(steps: Sequence[tuple[torch.Tensor, Sequence[int], torch.Tensor]]
                   ) -> tuple[list[int], list[int], int]:
    """Gather addresses for (pool, block ids, out) steps: pool is [blocks, ...] with each
    block contiguous (any stride between blocks: joint and split pages alike), out is
    [len(ids), ...] contiguous. Returns (source address per block, destination address per
    block, bytes per block); a scatter is the same tables swapped. Every step must have the
    same block size (one kernel argument)."""
    src: list[int] = []
    dst: list[int] = []
    size = None
    for pool, ids, out in steps:
        bb = block_bytes_of(pool)
        if size is not None and bb != size:
            raise ValueError(f"blocks of {bb} and {size} bytes in one table")
        if not pool[0].is_contiguous() or not out.is_contiguous():
            raise ValueError("block_pointers: every block and every output must be contiguous")
        size = bb
        base, stride = pool.data_ptr(), pool.stride(0) * pool.element_size()
        src += [base + b * stride for b in ids]
        dst += [out.data_ptr() + k * bb for k in range(len(ids))]
    return src, dst, size or 0


def copy_blocks_reference(src: Sequence[int], dst: Sequence[int], block_bytes: int) -> None:
    """What copy_blocks does, on host memory (memmove per block): the CPU reference."""
    for s, d in zip(src, dst, strict=True):
        ctypes.memmove(d, s, block_bytes)


class BlockPacker:
    """A plan's pack and unpack as one copy_blocks launch per message, on the current stream.
    `steps`: (message, pool, block ids, staging view) in message order. The address tables
    live on the GPU (int64), built once; each message's slice of them, as CuPy views, too."""

    def __init__(self, steps: Sequence[tuple[int, torch.Tensor, Sequence[int], torch.Tensor]]):
        import cupy

        src, dst, self.block_bytes = block_pointers([(p, ids, v) for _, p, ids, v in steps])
        dev = steps[0][3].device
        self._tables = (torch.tensor(src, dtype=torch.int64, device=dev),
                        torch.tensor(dst, dtype=torch.int64, device=dev))
        gather = [cupy.asarray(t) for t in self._tables]
        self.ranges: dict[int | None, tuple[int, int]] = {None: (0, len(src))}
        at = 0
        for message, _, ids, _ in steps:
            a, b = self.ranges.get(message, (at, at))
            self.ranges[message] = (a, b + len(ids))
            at += len(ids)
        self._views = {m: (gather[0][a:b], gather[1][a:b], b - a)
                       for m, (a, b) in self.ranges.items()}
        self._fn = _function("copy_blocks")

    def pack(self, message: int | None = None) -> None:
        """Blocks -> staging (message None: every message, one launch)."""
        src, dst, n = self._views[message]
        self._run(src, dst, n)

    def unpack(self, message: int | None = None) -> None:
        """Staging -> blocks."""
        src, dst, n = self._views[message]
        self._run(dst, src, n)

    def _run(self, src, dst, n: int) -> None:
        import cupy

        if not n:
            return
        with _stream():
            self._fn((min(n, 65535),), (THREADS,),
                     (src, dst, cupy.int64(self.block_bytes), cupy.int64(n)))
