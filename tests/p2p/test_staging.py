"""Host staging of device buffers (issue 20, defects 5 and 6), proven on CPU stand-ins.

- One host slab per channel, sliced per message: torch's pinned allocator rounds every
  allocation up to a power of two, and a paged block plan has tens of thousands of messages.
  Pinning needs CUDA: a stand-in device counts the allocations, a stand-in cudart records the
  registration (exactly the slab's bytes, unregistered when the memory goes).
- Non-blocking copies with the ordering kept: on `cpu-async` (work applied only once an event
  or a synchronize orders it, as a CUDA stream would) the sender's host bytes are final when
  handed to the transport, and the receiver's copy back is queued, not done on the host.
What a GPU alone shows (the copies overlapping, the pinned bandwidth) is in scripts/gpu-check.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvbench.p2p import devices
from kvbench.p2p.devices import AsyncCPUDevice, CPUDevice, CUDADevice
from kvbench.p2p.transports.staging import SLAB_ALIGN, HostStaging, slab_offsets


class CountingDevice(CPUDevice):
    """A CPU device that counts its host allocations (what pinning would cost on CUDA)."""

    def __init__(self):
        super().__init__()
        self.allocations: list[int] = []

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.allocations.append(nbytes)
        return super().host_buffer(nbytes)


def test_slab_offsets_are_aligned_and_back_to_back():
    assert slab_offsets([3, 256, 1, 0, 5]) == ([0, 256, 512, 768, 768], 773)
    assert slab_offsets([]) == ([], 0)
    offsets, total = slab_offsets([1000] * 7)
    assert all(o % SLAB_ALIGN == 0 for o in offsets) and total == offsets[-1] + 1000


def test_one_slab_per_channel_sliced_per_message():
    """A paged block plan: 2,000 messages of 32 KiB -> one host allocation of their sum."""
    dev = CountingDevice()
    bufs = [torch.full((32 * 1024,), i % 251, dtype=torch.uint8) for i in range(2000)]
    st = HostStaging(bufs, dev, active=True)
    assert dev.allocations == [2000 * 32 * 1024]  # one, exactly the bytes (no power of two)
    base = st.slab.data_ptr()
    spans = sorted((h.data_ptr() - base, h.numel()) for h in st.host)
    assert [n for _, n in spans] == [32 * 1024] * 2000
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))  # disjoint
    assert spans[-1][0] + spans[-1][1] <= st.slab.numel()
    st.to_host_many(range(2000))
    assert all(torch.equal(h, b) for h, b in zip(st.host, bufs, strict=True))


def test_inactive_staging_allocates_nothing():
    dev = CountingDevice()
    st = HostStaging([torch.zeros(8, dtype=torch.uint8)], dev, active=False)
    assert dev.allocations == [] and st.host[0] is st.device_buffers[0]


class FakeCudart:
    def __init__(self, answer: int = 0):
        self.answer, self.registered, self.unregistered = answer, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return self.answer

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_cuda_pins_exactly_the_slab_and_unpins_it_when_freed(monkeypatch):
    """2.68 GB would pin 4 GiB through torch's allocator; registration pins the bytes asked."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    nbytes = 3 * 1024 * 1024 + 17  # not a power of two
    t = CUDADevice().host_buffer(nbytes)
    assert t.numel() == nbytes and t.dtype == torch.uint8
    ((ptr, size, _flags),) = fake.registered
    assert size == nbytes and ptr == t.data_ptr()
    view = t[100:200]
    del t
    gc.collect()
    assert fake.unregistered == []  # a view still uses it
    del view
    gc.collect()
    assert fake.unregistered == [ptr]


@pytest.fixture
def copy_calls(monkeypatch):
    """Every Tensor.copy_ call's non_blocking flag."""
    calls: list[bool] = []
    real = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        calls.append(non_blocking)
        return real(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    return calls


def test_staging_copies_are_non_blocking_and_ordered(copy_calls):
    dev = AsyncCPUDevice()
    try:
        src = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
        sender = HostStaging(src, dev, active=True)
        for i, b in enumerate(src):  # the producer: queued, applied only once ordered
            dev.run(lambda b=b, i=i: b.fill_(i + 1))
        ready = dev.record()
        host = sender.to_host_many([0, 1, 2], ready)
        assert [int(h[0]) for h in host] == [1, 2, 3] and all(bool((h == h[0]).all()) for h in host)

        dst = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
        receiver = HostStaging(dst, dev, active=True)
        receiver.begin()
        for i, h in enumerate(receiver.host):
            h.fill_(10 + i)  # what the transport wrote into host memory
            receiver.to_device(i)
        assert dev.pending == 3 and int(dst[0][0]) == 0  # queued, not done on the host
        dev.synchronize()
        receiver.end()
        assert [int(d[0]) for d in dst] == [10, 11, 12]
        assert copy_calls and all(copy_calls), copy_calls
        assert receiver.breakdown()["stage_h2d_ms"][0] >= 0
    finally:
        dev.close()


def test_the_device_copy_is_non_blocking(copy_calls):
    """CUDA's copy (run on CPU tensors here: the call, not the hardware) passes the flag."""
    a, b = torch.ones(8), torch.zeros(8)
    CUDADevice().copy(b, a)
    assert copy_calls == [True] and torch.equal(a, b)
    assert devices.Device.copy is CUDADevice.copy  # one implementation for every device
