"""GPU code paths checked on CPU stand-ins (issue 20, defects 10 and 11).

Each stands in for the one CUDA fact the code depends on (a visible GPU, a CuPy that cannot
compile, a CUDA table whose elements would each cost a device sync, a rank bound to GPU 1) and
fails without its fix. What only a GPU shows is in scripts/gpu-check."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvbench.model import DTYPES, PRESETS
from kvbench.p2p import cuda_kernels
from kvbench.p2p.layout import KVCache, KVSpec
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.table import peak_memory_line
from kvbench.records.write import environment


def _fake_cupy(monkeypatch, compile_error: str | None):
    class RawModule:
        def __init__(self, code, options=()):
            self.code = code

        def get_function(self, name):
            if compile_error:
                raise RuntimeError(compile_error)
            return object()

    fake = types.SimpleNamespace(__version__="13.9.9", RawModule=RawModule)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda_kernels._module.cache_clear()


def test_a_cupy_that_cannot_compile_is_refused_up_front(monkeypatch):
    """A CuPy built for another CUDA than torch's imports fine and fails at NVRTC time: the
    reason compiles once, so the run is refused before anything is measured."""
    _fake_cupy(monkeypatch, "nvrtc: error: invalid value for --gpu-architecture (-arch)\nmore")
    try:
        reason = cuda_kernels.unavailable_reason()
    finally:
        cuda_kernels._module.cache_clear()
    assert reason is not None and "\n" not in reason
    assert "could not compile kv_pack.cu" in reason and "CuPy 13.9.9" in reason
    assert "invalid value for --gpu-architecture" in reason


def test_a_cupy_that_compiles_is_accepted(monkeypatch):
    _fake_cupy(monkeypatch, None)
    try:
        assert cuda_kernels.unavailable_reason() is None
    finally:
        cuda_kernels._module.cache_clear()


class _NoDeviceReads(torch.Tensor):
    """A block table whose elements must not be read one by one (each is a device sync on
    CUDA): iterating it or converting an element to int fails."""

    def __iter__(self):
        raise AssertionError("block table read element by element")


def test_block_plans_read_the_host_copy_of_the_block_table():
    spec = KVSpec(PRESETS["llama-3.1-8b"], DTYPES["bf16"], 70, layout="paged", block_size=16)
    kv = KVCache(spec, table_seed=3)
    expected = [[int(b) for b in t] for t in kv.block_tables]
    assert kv.block_ids == expected
    kv.block_tables = [t.as_subclass(_NoDeviceReads) for t in kv.block_tables]
    plan = plan_messages(kv, "block")  # would fail if block_views iterated the tables
    pool = kv.tensors[0]
    first = plan.buffers[0]
    assert first.data_ptr() == pool[expected[0][0]].data_ptr()
    assert plan.n == spec.model.layers * spec.parts * len(expected[0])


def test_the_environment_names_this_ranks_gpu(monkeypatch):
    """A rank bound to GPU 1 records GPU 1's name, not GPU 0's."""
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i])
    env = environment()
    assert (env["gpu"], env["gpu_index"]) == ("NVIDIA H200", 1)


@pytest.mark.parametrize("records,want", [
    ([{"bytes": 2**30, "peak_rss_bytes": [2**30, 3 * 2**30], "peak_device_bytes": [5 * 2**30, None]}],
     "peak memory per rank: GPU (torch peak allocated) 5.00 GiB = 5.00x; host RSS 3.00 GiB = "
     "3.00x the largest payload (1.00 GiB)"),
    ([{"bytes": 2**30, "peak_rss_bytes": [2**29], "peak_device_bytes": None}],
     "peak memory per rank: host RSS 0.50 GiB = 0.50x the largest payload (1.00 GiB)"),
    ([{"bytes": 2**30}], None),
])
def test_peak_memory_reports_the_device_too(records, want):
    assert peak_memory_line(records) == want


def test_peak_device_bytes_is_none_without_cuda():
    from kvbench.p2p.patterns.base import peak_device_bytes, per_rank_or_none

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert peak_device_bytes() is None
    assert per_rank_or_none([None, None]) is None and per_rank_or_none([1, None]) == [1, None]


def test_the_frame_carries_the_device_peak():
    """kvbench fit/report read records through frames: the GPU peak is a column (max over
    ranks), null on CPU records."""
    import json

    from kvbench.records.frames.p2p import record_row
    from kvbench.records.schema.p2p import P2PRecord
    from tests.conftest import ROOT

    line = next((ROOT / "tests" / "data" / "p2p").glob("kvbench-p2p-*.jsonl")).read_text()
    rec = json.loads(line.splitlines()[0])
    assert record_row(P2PRecord.model_validate(rec), "f", 1)["peak_device_bytes"] is None
    rec["peak_device_bytes"] = [5 * 2**30, None, 7 * 2**30]
    assert record_row(P2PRecord.model_validate(rec), "f", 1)["peak_device_bytes"] == 7 * 2**30
