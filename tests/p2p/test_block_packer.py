"""One launch per handoff (issue 40 item 5): the CUDA kernel copy_blocks copies every packed
block of a message through device tables of addresses. On a CPU: the tables
(cuda_kernels.block_pointers, from the plan's own steps) and the kernel's semantics
(copy_blocks_reference) pack exactly what torch's pack does and unpack back to the seeded KV,
for split and joint pages, whole and per layer, and FP8. On a GPU: the kernel itself through
a message plan, one launch per message, against torch (and tests/p2p/test_gpu_kernels.py's
round trips, which now go through it)."""

from __future__ import annotations

import pytest
import torch

from kvbench.model import DTYPES, PRESETS
from kvbench.p2p import cuda_kernels
from kvbench.p2p.cuda_kernels import block_pointers, copy_blocks_reference
from kvbench.p2p.layout import KVCache, KVSpec
from kvbench.p2p.messages import plan_messages


def _spec(dtype: str, pages: str) -> KVSpec:
    return KVSpec(PRESETS["llama-3.1-8b"], DTYPES[dtype], 70, layout="paged", block_size=16,
                  pages=pages)


def _reference_pack(plan, message=None):
    steps = [(p, ids, v) for m, p, ids, v in plan.block_steps() if message in (None, m)]
    return block_pointers(steps)


@pytest.mark.parametrize("gran", ["whole", "layer"])
@pytest.mark.parametrize("pages", ["split", "joint"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_the_address_tables_pack_what_torch_packs(dtype, pages, gran):
    spec = _spec(dtype, pages)
    kv = KVCache(spec, "cpu", table_seed=1)
    kv.fill()
    plan = plan_messages(kv, gran)
    plan.pack()
    want = [b.clone() for b in plan.buffers]
    plan.clear_staging()
    src, dst, bb = _reference_pack(plan)
    assert bb == kv.tensors[0][0].numel() * kv.tensors[0].element_size()
    assert len(src) == sum(spec.layer_blocks(layer) for layer in range(spec.model.layers)) * \
        spec.parts
    copy_blocks_reference(src, dst, bb)  # one "launch" over every layer and part
    assert all(torch.equal(a, b) for a, b in zip(plan.buffers, want, strict=True))
    # unpack: the same tables swapped, into a cache with its own block table
    back = KVCache(spec, "cpu", table_seed=2)
    back.clear()
    bplan = plan_messages(back, gran)
    for b, w in zip(bplan.buffers, want, strict=True):
        b.copy_(w)
    s2, d2, _ = _reference_pack(bplan)
    copy_blocks_reference(d2, s2, bb)
    assert back.count_wrong() == 0


def test_a_wrong_table_is_caught():
    """The check can fail: tables built with one block off pack other bytes."""
    kv = KVCache(_spec("bf16", "split"), "cpu", table_seed=1)
    kv.fill()
    plan = plan_messages(kv, "whole")
    plan.pack()
    want = plan.buffers[0].clone()
    plan.clear_staging()
    src, dst, bb = _reference_pack(plan)
    src[3] += bb  # the neighbouring block
    copy_blocks_reference(src, dst, bb)
    assert not torch.equal(plan.buffers[0], want)


def test_tables_refuse_mixed_or_scattered_blocks():
    a = torch.zeros(4, 8, dtype=torch.uint8)
    b = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="in one table"):
        block_pointers([(a, [0], torch.zeros(1, 8, dtype=torch.uint8)),
                        (b, [0], torch.zeros(1, 16, dtype=torch.uint8))])
    with pytest.raises(ValueError, match="contiguous"):
        block_pointers([(a.t(), [0], torch.zeros(1, 4, dtype=torch.uint8))])


def test_message_ranges_cover_each_message_once():
    """A layer plan's messages are slices of the one table, in order (no GPU needed to see it:
    the ranges come from the steps)."""
    kv = KVCache(_spec("bf16", "split"), "cpu", table_seed=1)
    plan = plan_messages(kv, "layer")
    steps = plan.block_steps()
    assert [m for m, *_ in steps] == list(range(plan.n))
    total = sum(len(ids) for _, _, ids, _ in steps)
    src, _, _ = block_pointers([(p, ids, v) for _, p, ids, v in steps])
    assert len(src) == total


@pytest.mark.gpu
@pytest.mark.skipif(cuda_kernels.unavailable_reason() is not None,
                    reason=str(cuda_kernels.unavailable_reason()))
@pytest.mark.parametrize("gran", ["whole", "layer"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_one_launch_packs_a_message_on_gpu(dtype, gran, monkeypatch):
    spec = _spec(dtype, "split")
    kv = KVCache(spec, "cuda", table_seed=1, pack_kernel="cuda")
    kv.fill()
    ref = KVCache(spec, "cuda", table_seed=1)
    ref.backing.copy_(kv.backing)
    plan, rplan = plan_messages(kv, gran), plan_messages(ref, gran)
    launches = []
    real = cuda_kernels.BlockPacker._run
    monkeypatch.setattr(cuda_kernels.BlockPacker, "_run",
                        lambda self, *a: (launches.append(a[-1]), real(self, *a)))
    plan.pack()
    rplan.pack()
    torch.cuda.synchronize()
    assert len(launches) == 1  # every layer and part of the plan in one launch
    assert all(torch.equal(a, b) for a, b in zip(plan.buffers, rplan.buffers, strict=True))
    back = KVCache(spec, "cuda", table_seed=2, pack_kernel="cuda")
    back.clear()
    bplan = plan_messages(back, gran)
    for b, w in zip(bplan.buffers, rplan.buffers, strict=True):
        b.copy_(w)
    bplan.unpack()
    torch.cuda.synchronize()
    assert back.count_wrong() == 0
