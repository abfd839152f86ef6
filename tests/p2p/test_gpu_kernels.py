"""On a GPU, in one process: pack/unpack against torch's own indexing, fill/check, every dtype.

For bf16, fp16, fp32, fp8_e4m3, fp8_e5m2 and int8, contiguous and paged KV, on the default
stream and on a side stream: the CUDA kernels (cuda/kv_pack.cu, paged) pack exactly the bytes
torch's index_select picks; a round trip through a message plan into a cache with its own
block table checks clean; three planted wrong elements are counted as three.

Skipped without a GPU. Under scripts/gpu-check (KVBENCH_GPU_CHECK=1) a GPU without working
kernels (no CuPy, a CuPy that cannot compile) fails instead of skipping: the check exists to
run them.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvbench.model import DTYPES, PRESETS
from kvbench.p2p import cuda_kernels
from kvbench.p2p.layout import KVCache, KVSpec
from kvbench.p2p.messages import plan_messages

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

DTYPE_NAMES = ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"]


def _kernels_or_skip() -> None:
    reason = cuda_kernels.unavailable_reason()
    if reason is None:
        return
    if os.environ.get("KVBENCH_GPU_CHECK") == "1":
        pytest.fail(f"the GPU check needs the CUDA kernels: {reason}")
    pytest.skip(reason)


def _spec(dtype: str, layout: str) -> KVSpec:
    return KVSpec(PRESETS["llama-3.1-8b"], DTYPES[dtype], 70, layout=layout, block_size=16)


@pytest.fixture(params=["default", "side"])
def stream(request):
    s = torch.cuda.current_stream() if request.param == "default" else torch.cuda.Stream()
    with torch.cuda.stream(s):
        yield s
    s.synchronize()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_cuda_pack_matches_torch_indexing(dtype, stream):
    _kernels_or_skip()
    spec = _spec(dtype, "paged")
    kv = KVCache(spec, "cuda", table_seed=1, pack_kernel="cuda")
    kv.fill()
    ref = KVCache(spec, "cuda", table_seed=1, pack_kernel="torch")
    ref.backing.copy_(kv.backing)
    for layer in range(spec.model.layers):
        for part in range(spec.parts):
            got = kv.gather(layer, part).view(torch.uint8)
            want = ref.gather(layer, part).view(torch.uint8)
            assert torch.equal(got, want), (dtype, layer, part)
    back = KVCache(spec, "cuda", table_seed=1, pack_kernel="cuda")
    back.clear()
    for layer in range(spec.model.layers):
        for part in range(spec.parts):
            back.scatter(layer, part, ref.gather(layer, part))
    stream.synchronize()
    assert back.count_wrong() == 0


@pytest.mark.parametrize("layout,gran", [("contiguous", "whole"), ("contiguous", "layer"),
                                         ("paged", "whole"), ("paged", "layer"), ("paged", "block")])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_round_trip_checks_clean_and_a_planted_error_is_counted(dtype, layout, gran, stream):
    kernel = "cuda" if layout == "paged" else "torch"
    if kernel == "cuda":
        _kernels_or_skip()
    spec = _spec(dtype, layout)
    src = KVCache(spec, "cuda", table_seed=0, pack_kernel=kernel)
    dst = KVCache(spec, "cuda", table_seed=7, pack_kernel=kernel)  # its own block table
    src.fill()
    dst.clear()
    a, b = plan_messages(src, gran), plan_messages(dst, gran)
    a.pack()
    for x, y in zip(a.buffers, b.buffers, strict=True):
        y.copy_(x, non_blocking=True)
    b.unpack()
    stream.synchronize()
    assert dst.count_wrong() == 0
    flat = dst.backing.view(-1).view(torch.uint8)
    if layout == "paged":  # plant inside the request's first block, not in the pool's slack
        first = dst.block_ids[0][0] * dst.tensors[0][0].numel() * dst.backing.element_size()
        flat = flat[first:]
    flat[: 3 * dst.backing.element_size()] += 1
    assert dst.count_wrong() == 3
