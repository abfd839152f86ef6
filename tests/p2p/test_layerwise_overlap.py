"""Layerwise that overlaps (issue 40 item 6), proven on `cpu-async`.

cpu-async applies queued work on a worker thread only once an event or a synchronize orders
it, as a CUDA stream applies it later; its copy stream (Device.copy_after) is a second worker
that waits on the compute worker up to the readiness event. What this proves: the host
queues layer l's send (its staging copy, ordered after layer l's compute by the event) before
layer l+1's compute is even queued, without one host wait; MPI is handed a message only once
its copy is done, in order; the bytes it gets are the computed ones. What it does not prove:
that a GPU runs the two streams at once (scripts/gpu-check's layerwise step shows that).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvbench.p2p.compute import LayerWork
from kvbench.p2p.devices import AsyncCPUDevice, AsyncEvent
from kvbench.p2p.transports import mpi
from kvbench.p2p.transports.base import HeldPosts, Request, wait_all

L, CHUNKS, N = 4, 3, 256


class _Done(Request):
    def test(self) -> bool:
        return True


class _Comm:
    """What MPI was handed: each message's bytes as they were at the Isend."""

    def __init__(self):
        self.sent: list[bytes] = []

    def Isend(self, buf, dest, tag):
        self.sent.append(bytes(buf))


def _chunk(kv, layer: int, k: int):
    def fn():  # the layer's compute writes its KV (the first chunk), then more work
        if k == 0:
            kv[layer].fill_(layer + 1)
        else:
            torch.mm(torch.ones(32, 32), torch.ones(32, 32))
    fn.tag = ("compute", layer, k)
    return fn


def _run(monkeypatch, wait: bool, plant_no_order: bool = False):
    monkeypatch.setattr(mpi, "_MPIRequest", lambda reqs, on_done=None: _Done())
    dev = AsyncCPUDevice()
    dev.log = log = []
    kv = [torch.zeros(N, dtype=torch.uint8) for _ in range(L)]
    comm = _Comm()
    t = SimpleNamespace(comm=comm, direct=False, ctx=SimpleNamespace(dev=dev),
                        held_for=lambda peer: HeldPosts())
    ch = mpi.MPIChannel(t, 1, kv, True)  # host-staged: cpu-async memory is not host-visible
    works = [LayerWork([_chunk(kv, layer, k) for k in range(CHUNKS)], "cpu", {})
             for layer in range(L)]
    reqs, seen = [], []
    try:
        ch.begin_handoff()
        for layer in range(L):  # what Engine.run does on the sender: hook, readiness, post
            works[layer].run(None, dev, wait=wait)
            seen.append((dev.host_waits, dev.pending, len(comm.sent)))
            ready = AsyncEvent(dev, 0) if plant_no_order else dev.record()
            reqs += ch.post_many([layer], ready)
        wait_all(reqs, time.perf_counter() + 30)
        ch.end_handoff()
        return log, comm.sent, seen, dev
    finally:
        dev.close()


def test_layer_l_send_is_queued_before_layer_l_plus_1_computes(monkeypatch):
    log, sent, seen, dev = _run(monkeypatch, wait=False)
    # the host never waited, and each layer's compute was still queued when its send was
    assert all(waits == 0 and pending > 0 and handed == 0 for waits, pending, handed in seen), seen
    assert dev.host_waits == 0 and dev._copy.host_waits == 0
    copies = [i for i, (what, tag) in enumerate(log) if what == "queued" and tag[0] == "copy"]
    applied = {tag: i for i, (what, tag) in enumerate(log) if what == "applied"}
    assert len(copies) == L
    for layer in range(L - 1):
        assert copies[layer] < applied[("compute", layer + 1, CHUNKS - 1)], log
    # MPI got every layer, in order, with its computed bytes (the copy waited on the event)
    assert sent == [bytes([layer + 1]) * N for layer in range(L)]


def test_the_old_host_wait_per_layer_is_seen(monkeypatch):
    """The checker can fail: a hook that waits on each layer's compute (the code before issue
    40; it polls the layer's event until done) has each layer's compute applied before its
    send is queued."""
    _, sent, seen, _ = _run(monkeypatch, wait=True)
    assert all(pending == 0 for _, pending, _ in seen), seen
    assert sent == [bytes([layer + 1]) * N for layer in range(L)]


def test_a_copy_not_ordered_after_the_compute_sends_stale_bytes(monkeypatch):
    """Plant: a readiness event from before the compute. The copy stream then copies KV the
    compute has not written, and MPI is handed zeros: the event is what orders the copy."""
    _, sent, _, _ = _run(monkeypatch, wait=False, plant_no_order=True)
    assert sent != [bytes([layer + 1]) * N for layer in range(L)]
    assert bytes(N) in sent


@pytest.mark.parametrize("wait", [True, False])
def test_layer_work_queues_without_waiting_when_asked(wait):
    dev = AsyncCPUDevice()
    try:
        x = torch.zeros(4)
        LayerWork([lambda: x.add_(1)] * 3, "cpu", {}).run(None, dev, wait=wait)
        assert (dev.pending == 0) == wait
        dev.synchronize()
        assert float(x[0]) == 3
    finally:
        dev.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_cuda_copy_stream_is_apart_and_ordered_by_the_event():
    """On a GPU: the staging copy goes on a second stream, after the compute's event, with no
    host wait before it is queued; its bytes are the computed ones; its span is timed."""
    from kvbench.p2p.devices import CUDADevice, pinned_host

    dev = CUDADevice()
    kv = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # compute the copy must wait for
        a = a @ a.t() / 2048
    kv.fill_(7)
    ready = dev.record()
    host = pinned_host(kv.numel())
    done, span = dev.copy_after(ready, [(host, kv)])
    assert dev.host_waits == 0
    assert dev._copy_stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    done.wait()
    assert bool((host == 7).all()) and dev.span_ms(*span) >= 0
