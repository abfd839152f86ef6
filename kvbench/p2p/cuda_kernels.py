"""The CUDA pack/unpack kernels in `cuda/kv_pack.cu`, compiled at run time with NVRTC.

Used by paged KV on a GPU with `--pack-kernel cuda` (instead of torch's index_select /
index_copy_), so the cost of packing scattered blocks for a one-message handoff can be
measured with a purpose-built copy. Needs CuPy (`pip install 'kvbench[cuda]'`).
"""

from __future__ import annotations

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
        for name in ("gather_blocks", "scatter_blocks"):
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


def _launch(name: str, src: torch.Tensor, table: torch.Tensor, dst: torch.Tensor,
            block_bytes: int, n_blocks: int) -> None:
    import cupy

    fn = _module().get_function(name)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
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
