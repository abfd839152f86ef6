"""Host staging for device buffers, for backends that can only move host memory.

The copies are real work on the handoff's critical path, so they are timed as their own
component (`stage_d2h_ms` on the sender, `stage_h2d_ms` on the receiver) and included in
the handoff time. Ordering goes through the Device: the device-to-host copies of a step are
queued behind their producer, on an asynchronous device on its copy stream after the step's
readiness event (`to_host_later`: the transport hands the host bytes over once the copies'
event is done, polled), elsewhere on the stream with one host wait on the copies' own event
per step (`to_host_many`; never a whole-stream sync); the host-to-device copy is queued on
the stream, ahead of the unpack and of the receiver's completion sync.

The copies are non-blocking (`Device.copy`): a blocking copy would stall the host for every
message, and on the receiver inside a request's `test()`, starving the other receives. The
host memory is one slab per channel (`Device.host_buffer`: pinned, exactly its size, on CUDA),
sliced per message at `SLAB_ALIGN`: one pinned allocation per message would be rounded up to
a power of two each, and a paged block plan would make tens of thousands of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the registry imports this module without torch
    import torch

SLAB_ALIGN = 256  # bytes: every message's slice of the slab starts at a multiple of this


def slab_offsets(sizes: Sequence[int], align: int = SLAB_ALIGN) -> tuple[list[int], int]:
    """(offset of each message in the slab, slab bytes): messages back to back, each aligned."""
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


class HostStaging:
    """Host mirrors of device message buffers; inactive (the buffers themselves) when the
    transport may use the device's memory directly."""

    def __init__(self, buffers: Sequence[torch.Tensor], device, active: bool):
        self.dev = device
        self.device_buffers = list(buffers)
        self.active = active and bool(self.device_buffers)
        if self.active:
            sizes = [b.numel() * b.element_size() for b in self.device_buffers]
            offsets, total = slab_offsets(sizes)
            self.slab = device.host_buffer(total)
            self.host = [self.slab[o:o + n] for o, n in zip(offsets, sizes, strict=True)]
        else:
            self.host = self.device_buffers
        self._cur = {"stage_d2h_ms": 0.0, "stage_h2d_ms": 0.0}
        self._spans: list = []  # (begin, end) stream marks of this handoff's host-to-device copies
        self._d2h_spans: list = []  # the same for the sender's copies on the copy stream
        self.per_handoff: dict[str, list[float]] = {"stage_d2h_ms": [], "stage_h2d_ms": []}

    def begin(self) -> None:
        self._cur = dict.fromkeys(self._cur, 0.0)
        self._spans = []
        self._d2h_spans: list = []

    def end(self) -> None:
        """After the handoff (the receiver synchronised, the sender's sends done): the
        copies' stream time is known."""
        for key, spans in (("stage_h2d_ms", self._spans), ("stage_d2h_ms", self._d2h_spans)):
            for a, b in spans:
                self._cur[key] += self.dev.span_ms(a, b)
        self._spans, self._d2h_spans = [], []
        for k, v in self._cur.items():
            if v:
                self.per_handoff[k].append(v)

    def to_host(self, i: int, ready=None) -> torch.Tensor:
        """Sender: the buffer to hand to the transport, its bytes final (after `ready`)."""
        return self.to_host_many([i], ready)[0]

    def to_host_many(self, idx: Sequence[int], ready=None) -> list[torch.Tensor]:
        """Sender: several messages staged with one host wait (a step's messages share it).
        The copies are queued on the device stream behind the producer, so waiting for the
        copies' own event also covers `ready`; unstaged buffers wait on `ready` itself."""
        if not self.active:
            if ready is not None:
                ready.wait()
            return [self.host[i] for i in idx]
        t0 = time.perf_counter()
        for i in idx:
            self.dev.copy(self.host[i], self.device_buffers[i])
        self.dev.record().wait()  # the host mirrors are read by the transport next
        self._cur["stage_d2h_ms"] += (time.perf_counter() - t0) * 1e3
        return [self.host[i] for i in idx]

    def to_host_later(self, idx: Sequence[int], ready=None):
        """Sender, never blocking the host: the step's device-to-host copies queued on the
        device's copy stream after `ready` (Device.copy_after). Returns the event after the
        copies; the transport hands the host buffers over once it is done (query), so the
        next layer's compute is queued while this layer's copy runs. Their stream time, where
        the device has a stream clock, is `stage_d2h_ms`."""
        if not self.active:
            return ready
        ev, span = self.dev.copy_after(ready, [(self.host[i], self.device_buffers[i])
                                               for i in idx])
        if span is not None:
            self._d2h_spans.append(span)
        return ev

    def to_device(self, i: int) -> None:
        """Receiver, once message i is in host memory: queue the copy back to the device. The
        copy does not block the host, so its time is read off the stream at `end()` where the
        device has a stream clock (CUDA events), else taken on the host around the call."""
        if self.active:
            t0 = time.perf_counter()
            mark = self.dev.span_begin()
            self.dev.copy(self.device_buffers[i], self.host[i])
            if mark is None:
                self._cur["stage_h2d_ms"] += (time.perf_counter() - t0) * 1e3
            else:
                self._spans.append((mark, self.dev.span_begin()))

    def breakdown(self) -> dict[str, list[float]]:
        """Per-handoff staging time, one entry per handoff that staged anything."""
        return {k: v for k, v in self.per_handoff.items() if v}


def chunks(t: torch.Tensor, max_bytes: int) -> list[torch.Tensor]:
    """Split a flat byte tensor into pieces no larger than max_bytes (count limits)."""
    n = t.numel()
    if n <= max_bytes:
        return [t]
    return [t[a:min(a + max_bytes, n)] for a in range(0, n, max_bytes)]
