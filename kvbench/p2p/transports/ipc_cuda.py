"""The parts of one CUDA IPC handoff, timed on the copying rank's stream (--transport ipc).

The sample (max(t1) - min(t0) on the host) says how long a handoff took; these say where the
time went, on the GPU's own clock, so a fitted setup splits into named parts instead of one
number (issue 40 item 4). Three timing events per handoff on the copying rank's stream
(the consumer when reading, the producer when writing):

    e0  recorded before the stream waits on the producer's IPC event (read mode only)
    e1  recorded once that wait is satisfied: the first step's bytes are produced
    e2  recorded after the last copy of the handoff

    ipc_wait_ms   e0 -> e1: the copying stream stalled on the producer's first step (what a
                  decode engine's stream also waits: the producer's work, not kvbench's)
    ipc_copy_ms   e1 -> e2: the copies themselves (a layer-by-layer handoff also includes the
                  waits between its steps: the producer's later layers)
    ipc_queue_ms  host time this rank spent queueing the waits and copies (the Python and
                  CUDA API calls inside the sample)

Events are read in `end_handoff`, after the engine's completion: reading them costs nothing
inside the sample. The three records themselves cost a few microseconds inside it.
"""

from __future__ import annotations

import time


class HandoffParts:
    """Timing events around one handoff's wait and copies on the current stream, and the
    per-handoff lists of each part in ms (Channel.breakdown)."""

    def __init__(self, waits: bool):
        import torch

        self.torch = torch
        self.waits = waits  # read mode: the stream waits on the producer's IPC event
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self.per: dict[str, list[float]] = {"ipc_copy_ms": [], "ipc_queue_ms": []}
        if waits:
            self.per["ipc_wait_ms"] = []
        self.started = self.copied = False
        self.queue_s = 0.0

    def begin(self) -> None:
        self.started = self.copied = False
        self.queue_s = 0.0

    def step(self, event, copy) -> None:
        """Queue one step on the current stream: wait on the producer's `event` (None: no
        wait), then `copy()`; the first step's wait and the last copy are bracketed."""
        t0 = time.perf_counter()
        stream = self.torch.cuda.current_stream()
        first = not self.started
        if first and event is not None:
            self.ev[0].record(stream)
        if event is not None:
            stream.wait_event(event)
        if first:
            self.ev[1].record(stream)
            self.started = True
        copy()
        self.ev[2].record(stream)
        self.copied = True
        self.queue_s += time.perf_counter() - t0

    def end(self) -> None:
        """After the handoff completed on the device: each part's ms appended (a handoff
        that copied nothing adds nothing)."""
        if not self.copied:
            return
        self.ev[2].synchronize()  # already complete (the engine synchronised): no real wait
        if self.waits:
            self.per["ipc_wait_ms"].append(self.ev[0].elapsed_time(self.ev[1]))
        self.per["ipc_copy_ms"].append(self.ev[1].elapsed_time(self.ev[2]))
        self.per["ipc_queue_ms"].append(self.queue_s * 1e3)
        self.started = self.copied = False
