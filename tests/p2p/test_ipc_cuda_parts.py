"""CUDA IPC's lean handoff (issue 40 item 4), its logic on a CPU with stand-ins for torch.cuda.

What the stand-ins prove: the handles are opened on the copying rank's own GPU first, on the
producer's only when that fails (no peer access) and the producer's GPU is visible, and one
line otherwise; each handoff's parts come from the right pair of events (the wait only when
reading), once per handoff, nothing when nothing was copied. What they do not prove: that
CUDA opens, waits or times as torch says; tests/p2p/test_ipc.py's GPU test and scripts/gpu-check's
p2p-ipc step run the real thing.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.p2p.transports import ipc_cuda, ipc_mem
from kvbench.p2p.transports.base import TransportError


@pytest.fixture
def opened(monkeypatch):
    """Where _open_regions was asked to open; `fail_on`: devices whose open raises."""
    calls: list[int] = []
    state = {"fail_on": set(), "producer": 1}

    def fake_open(regions, device):
        calls.append(device)
        if device in state["fail_on"]:
            raise RuntimeError("CUDA error: peer access is not supported between these two devices")
        return [torch.zeros(64, dtype=torch.uint8)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ipc_mem, "local_gpu", lambda uuid: state["producer"])
    monkeypatch.setattr(ipc_mem, "_open_regions", fake_open)
    return calls, state


HANDLE = {"uuid": "GPU-p", "regions": [("r",)], "pieces": [ipc_mem.Piece(0, 8, 16)]}


def test_handles_open_on_the_copying_ranks_own_gpu(opened):
    calls, _ = opened
    m = ipc_mem.CudaMapping(HANDLE)
    assert calls == [0] and m.opened_on == ipc_mem.OWN_GPU and m.device == torch.device("cuda", 0)
    assert [v.numel() for v in m.views] == [16]


def test_without_peer_access_they_open_on_the_producers_gpu(opened):
    calls, state = opened
    state["fail_on"] = {0}
    m = ipc_mem.CudaMapping(HANDLE)
    assert calls == [0, 1] and m.opened_on == ipc_mem.PRODUCER_GPU


@pytest.mark.parametrize("producer", [None, 0])
def test_no_fallback_is_one_line(opened, producer):
    """The producer's GPU invisible here (or the same GPU, which already failed)."""
    _, state = opened
    state["fail_on"], state["producer"] = {0, 1}, producer
    with pytest.raises(TransportError, match="cannot open the producer's CUDA IPC handles on GPU 0") as e:
        ipc_mem.CudaMapping(HANDLE)
    assert "\n" not in str(e.value)


class _Event:
    t = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        _Event.t += 1.0
        self.at = _Event.t

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, ev):
        self.waited.append(ev)
        _Event.t += 10.0  # the stall on the producer's event


@pytest.fixture
def fake_cuda(monkeypatch):
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    return stream


def _copy(ms: float):
    def fn():
        _Event.t += ms
    return fn


def test_read_mode_times_the_wait_and_the_copies(fake_cuda):
    parts = ipc_cuda.HandoffParts(waits=True)
    for _ in range(2):  # two handoffs, the second with two steps (layer by layer)
        parts.begin()
        parts.step("ipc-event", _copy(3.0))
        parts.end()
    parts.begin()
    parts.step("ipc-event", _copy(3.0))
    parts.step("ipc-event", _copy(5.0))
    parts.end()
    assert fake_cuda.waited == ["ipc-event"] * 4
    assert parts.per["ipc_wait_ms"] == [11.0, 11.0, 11.0]  # record + the stall, first step only
    # the copies, the later steps' waits and the event records between the brackets
    assert parts.per["ipc_copy_ms"] == [4.0, 4.0, 4.0 + 10.0 + 5.0 + 1.0]
    assert len(parts.per["ipc_queue_ms"]) == 3 and min(parts.per["ipc_queue_ms"]) >= 0


def test_write_mode_has_no_wait_and_an_idle_handoff_adds_nothing(fake_cuda):
    parts = ipc_cuda.HandoffParts(waits=False)
    parts.begin()
    parts.end()  # nothing copied: no entry
    parts.begin()
    parts.step(None, _copy(2.0))
    parts.end()
    assert "ipc_wait_ms" not in parts.per and fake_cuda.waited == []
    assert parts.per["ipc_copy_ms"] == [3.0]
