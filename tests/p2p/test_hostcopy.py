"""The host's own copy (issue 40 item 8): kvbench copies host bytes with memcpy, and the
--baseline floor is the fastest single-thread copy, named, with kvbench's ratio to each."""

from __future__ import annotations

import pytest
import torch

from kvbench.p2p.baseline import host_copy_gbps
from kvbench.p2p.hostcopy import CANDIDATES, METHOD, memcpy
from kvbench.p2p.ratios import add_baseline


def test_memcpy_copies_the_bytes_and_refuses_what_would_overrun():
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    memcpy(dst, src)
    assert torch.equal(dst, src)
    memcpy(dst[:0], src[:0])  # nothing to copy: no call, no error
    with pytest.raises(ValueError, match="bytes into a"):
        memcpy(dst[:10], src)
    with pytest.raises(ValueError, match="contiguous host"):
        memcpy(dst.view(64, 256).t(), src.view(64, 256))


def test_every_candidate_copies_and_is_timed():
    src = torch.full((1 << 16,), 7, dtype=torch.uint8)
    for name, make in CANDIDATES.items():
        dst = torch.zeros_like(src)
        make(dst, src)()
        assert torch.equal(dst, src), name
    threads = torch.get_num_threads()
    got = host_copy_gbps(1 << 20, iters=3, warmup=1)
    assert set(got) == set(CANDIDATES) and all(g > 0 for g in got.values())
    assert METHOD in got and "numpy.copyto" in got and "torch copy_" in got
    assert torch.get_num_threads() == threads  # torch copy_ ran on one thread, then restored


def test_the_floor_is_the_fastest_candidate_by_name_with_a_ratio_to_each():
    rec = {"gbps": 9.5}
    by = {"numpy.copyto": 10.0, METHOD: 9.0, "torch copy_": 5.0}
    line = add_baseline(rec, {"host_copy": 10.0, "bare_mpi": 5.0}, None,
                        {"host_copy_method": "numpy.copyto", "host_copy_by_method_gbps": by})
    assert rec["baseline_host_copy_method"] == "numpy.copyto"
    assert rec["baseline_host_copy_by_method_gbps"] == by
    assert rec["vs_host_copy_by_method"] == pytest.approx(
        {"numpy.copyto": 0.95, METHOD: 9.5 / 9.0, "torch copy_": 1.9})
    assert "(numpy.copyto, the fastest) 10.00 GB/s" in line
    assert "kvbench/numpy.copyto = 0.950" in line
    assert "kvbench/torch copy_ = 1.900" in line
