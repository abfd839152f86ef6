"""Host staging for device buffers, for backends that can only move host memory.

The copy is real work on the handoff's critical path, so it is timed as its own
component (`stage_d2h_ms` on the sender, `stage_h2d_ms` on the receiver) and included
in the handoff time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


class HostStaging:
    """Pinned host mirrors of device message buffers (a no-op for host buffers)."""

    def __init__(self, buffers: Sequence[torch.Tensor]):
        self.device_buffers = list(buffers)
        self.active = any(b.is_cuda for b in self.device_buffers)
        if self.active:
            self.host = [torch.empty(b.numel(), dtype=torch.uint8, pin_memory=True)
                         for b in self.device_buffers]
        else:
            self.host = self.device_buffers
        self._cur = {"stage_d2h_ms": 0.0, "stage_h2d_ms": 0.0}
        self.per_handoff: dict[str, list[float]] = {"stage_d2h_ms": [], "stage_h2d_ms": []}

    def begin(self) -> None:
        self._cur = dict.fromkeys(self._cur, 0.0)

    def end(self) -> None:
        for k, v in self._cur.items():
            if v:
                self.per_handoff[k].append(v)

    def to_host(self, i: int) -> torch.Tensor:
        if self.active:
            t0 = time.perf_counter()
            self.host[i].copy_(self.device_buffers[i])  # synchronous: bytes are in host memory
            self._cur["stage_d2h_ms"] += (time.perf_counter() - t0) * 1e3
        return self.host[i]

    def to_device(self, i: int) -> None:
        if self.active:
            t0 = time.perf_counter()
            self.device_buffers[i].copy_(self.host[i])
            torch.cuda.current_stream().synchronize()
            self._cur["stage_h2d_ms"] += (time.perf_counter() - t0) * 1e3

    def breakdown(self) -> dict[str, list[float]]:
        """Per-handoff staging time, one entry per handoff that staged anything."""
        return {k: v for k, v in self.per_handoff.items() if v}


def chunks(t: torch.Tensor, max_bytes: int) -> list[torch.Tensor]:
    """Split a flat byte tensor into pieces no larger than max_bytes (count limits)."""
    n = t.numel()
    return [t[a:min(a + max_bytes, n)] for a in range(0, n, max_bytes)] or [t]
