"""cuda/kv_pack.cu: compiles with nvcc where nvcc exists; matches torch's index ops on a GPU."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from kvbench.p2p import cuda_kernels
from tests.conftest import run_cli


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot compile-check")
def test_kernels_compile_with_nvcc(tmp_path):
    ptx = tmp_path / "kv_pack.ptx"
    subprocess.run(["nvcc", "--ptx", "-arch=sm_80", str(cuda_kernels.source_path()), "-o", str(ptx)],
                   check=True, capture_output=True, timeout=120)
    text = ptx.read_text()
    assert ".entry gather_blocks" in text and ".entry scatter_blocks" in text


def test_pack_kernel_cuda_refused_without_gpu_or_cupy(tmp_path):
    reason = cuda_kernels.unavailable_reason()
    if reason is None:
        pytest.skip("GPU and CuPy present: the refusal path does not apply")
    res = run_cli("kvbench.p2p", "--pack-kernel", "cuda", "--layout", "paged", "--out", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"kvbench p2p: error: {reason}"]


@pytest.mark.gpu
@pytest.mark.skipif(cuda_kernels.unavailable_reason() is not None,
                    reason=str(cuda_kernels.unavailable_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gather_scatter_match_torch_on_gpu(dtype):
    nbytes = 40 * 16 * 8 * 128 * torch.empty((), dtype=dtype).element_size()
    pool = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    pool = pool.view(dtype).view(40, 16, 8, 128)
    table = torch.randperm(40, device="cuda")[:25]
    out = torch.empty((25, 16, 8, 128), dtype=dtype, device="cuda")
    cuda_kernels.gather_blocks(pool, table, out)
    ref = pool.view(torch.uint8).view(40, -1).index_select(0, table)
    assert torch.equal(out.view(torch.uint8).view(25, -1), ref)
    back = torch.zeros_like(pool)
    cuda_kernels.scatter_blocks(out, table, back)
    assert torch.equal(back.view(torch.uint8).view(40, -1).index_select(0, table), ref)
