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
    """Why the kernels cannot run here, in one line, or None."""
    if not torch.cuda.is_available():
        return "--pack-kernel cuda needs a CUDA GPU and none is visible"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "--pack-kernel cuda needs CuPy: pip install 'kvbench[cuda]' (cupy-cuda12x)"
    try:
        source_path()
    except FileNotFoundError as exc:
        return str(exc)
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
