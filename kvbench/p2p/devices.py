"""Where the KV lives, behind one small interface: cpu, cuda, and an asynchronous CPU device.

The handoff engine never calls torch.cuda directly. Every operation that produces or wipes
data (fill, clear, pack, unpack, compute, staging copies) goes through `Device.run`, and
every ordering the protocol needs is explicit:

    run(fn)        queue fn on the device's stream (cpu: run it now)
    record()       an Event marking everything queued so far
    Event.query()  done yet? never blocks (the device keeps working on its own)
    Event.wait()   block the host until the event is done
    synchronize()  block the host until everything queued is done

Contract for transports that are not stream-ordered (mpi, nixl, gloo, mooncake): the bytes
of a message may be read only once the readiness event the engine hands to `post` (recorded
right after the message was produced) is done, never after a whole-stream wait. On an
asynchronous device mpi, gloo and nixl hold the post until the event (or the staging copies'
event) says done, polled (transports.base.HeldPosts), so the host goes on queueing work;
mooncake and ipc on host memory wait on it. A stream-ordered transport (NCCL) enqueues its
operation after the producer on the device instead.

`cpu-async` exists for tests on machines without a GPU: its run() only queues the work to a
worker thread, which applies it in order *only once an event or synchronize orders it*,
as a CUDA stream would apply it some time later. A missing readiness wait, a clear that is
not ordered before the first post, or a receiver that sends its notice before its unpack
completed then shows up as wrong elements in the data check (or as a device wait count).
It proves the protocol's ordering logic; it proves nothing about CUDA itself, its timing is
meaningless, and it is no substitute for a GPU run (scripts/gpu-check).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

DEVICES = ("cpu", "cuda", "cpu-async")


class Event(ABC):
    @abstractmethod
    def query(self) -> bool:
        """True once every operation queued before record() has been applied. Never blocks."""

    @abstractmethod
    def wait(self) -> None:
        """Block the host until query() would be True."""


class _Done(Event):
    def query(self) -> bool:
        return True

    def wait(self) -> None:
        pass


DONE = _Done()


class Device(ABC):
    """One rank's device: its torch device, its stream, and how the host orders against it."""

    name: str
    torch_device: str  # what torch calls it: "cpu" or "cuda"
    host_visible: bool  # a transport that moves host memory may use its tensors directly
    asynchronous: bool  # run() may return before the work is applied

    def __init__(self):
        # host round trips to the device: every synchronize(), and every Event.wait() on an
        # event not already seen complete (what the protocol pays in syncs; tests count them)
        self.host_waits = 0

    @abstractmethod
    def run(self, fn: Callable[[], object]) -> None:
        """Queue fn (torch work on this device's tensors) on the stream."""

    @abstractmethod
    def record(self) -> Event:
        """An event after everything queued so far."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until everything queued so far is applied."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory for staging this device's buffers (flat uint8): one slab per channel,
        sliced per message (transports/staging.py)."""
        from kvbench.p2p.layout import empty

        return empty(nbytes, torch.uint8, "cpu")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue a copy between host and device memory on the stream. Non-blocking: with
        pinned host memory the host does not wait for it; order it with record()/wait()."""
        self.run(partial(dst.copy_, src, non_blocking=True))

    def copy_after(self, ready: Event | None, pairs) -> tuple[Event, tuple | None]:
        """Queue the (dst, src) copies between host and device memory on the device's *copy
        stream*, apart from the stream compute runs on, ordered after `ready` (an event of the
        compute stream; None: after everything queued so far) by a wait on the device, never
        on the host. Returns the event after the copies: a transport polls it (query) and
        reads the host bytes once it is done, while the next layer computes; and the
        copies' (begin, end) marks on the copy stream for `span_ms` (None: no stream clock).
        This device has no second stream: queued behind the work on its own."""
        for dst, src in pairs:
            self.copy(dst, src)
        return self.record(), None

    def span_begin(self):
        """Start timing queued work on the stream (None: this device has no stream clock, time
        it on the host)."""
        return None

    def span_ms(self, begin, end) -> float:
        """Stream time between two marks from span_begin(), once both are complete."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class CPUDevice(Device):
    name, torch_device, host_visible, asynchronous = "cpu", "cpu", True, False

    def run(self, fn) -> None:
        fn()

    def record(self) -> Event:
        return DONE

    def synchronize(self) -> None:
        pass


class _CUDAEvent(Event):
    def __init__(self, device: CUDADevice):
        self.device, self.done = device, False
        self.ev = torch.cuda.Event()
        self.ev.record()

    def query(self) -> bool:
        self.done = self.done or self.ev.query()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.device.host_waits += 1
            self.ev.synchronize()
            self.done = True


class CUDADevice(Device):
    """The rank's current CUDA device and stream (p2p binds one GPU per rank first)."""

    name, torch_device, host_visible, asynchronous = "cuda", "cuda", False, True

    def run(self, fn) -> None:
        fn()  # torch queues the kernels on the current stream

    def record(self) -> Event:
        return _CUDAEvent(self)

    def copy_after(self, ready: Event | None, pairs) -> tuple[Event, tuple | None]:
        """On a second CUDA stream made once: it waits on `ready`'s event (cudaStreamWaitEvent),
        or on the compute stream as it stands, then copies between two timing events; the
        completion event is recorded on it."""
        main = torch.cuda.current_stream()
        if getattr(self, "_copy_stream", None) is None:
            self._copy_stream = torch.cuda.Stream()
        side = self._copy_stream
        if isinstance(ready, _CUDAEvent):
            side.wait_event(ready.ev)
        else:
            side.wait_stream(main)
        with torch.cuda.stream(side):  # every record below goes on the copy stream
            begin = self.span_begin()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end = self.span_begin()
            return _CUDAEvent(self), (begin, end)

    def synchronize(self) -> None:
        self.host_waits += 1
        torch.cuda.current_stream().synchronize()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return pinned_host(nbytes)

    def span_begin(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def span_ms(self, begin, end) -> float:
        return begin.elapsed_time(end)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned_host(nbytes: int) -> torch.Tensor:
    """Exactly `nbytes` of page-locked host memory (flat uint8). Plain host memory registered
    with cudaHostRegister, because torch's pinned allocator rounds every allocation up to a
    power of two (a 2.68 GB slab would pin 4 GiB). Unregistered when the memory is freed (the
    numpy array owning it goes last, after every view). Falls back to torch's allocator when
    registration is refused."""
    import weakref

    import numpy as np

    raw = np.empty(max(nbytes, 1), dtype=np.uint8)
    ptr = raw.ctypes.data
    if int(torch.cuda.cudart().cudaHostRegister(ptr, raw.nbytes, 0)) != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(raw, _unregister, ptr).atexit = False
    return torch.from_numpy(raw)[:nbytes]


class AsyncEvent(Event):
    def __init__(self, device: AsyncCPUDevice, seq: int):
        self.device, self.seq, self.done = device, seq, False

    def query(self) -> bool:
        self.device._release(self.seq)  # a real stream progresses without being waited on
        self.done = self.done or self.device._applied >= self.seq
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.device.host_waits += 1
            self.device._release(self.seq)
            self.device._wait_for(self.seq)
            self.done = True


class AsyncCPUDevice(Device):
    """CPU tensors with a CUDA-stream-like queue (see the module docstring): work is applied
    on a worker thread, in order, and only up to the last event someone queried or waited on
    (or everything, on synchronize)."""

    name, torch_device, host_visible, asynchronous = "cpu-async", "cpu", False, True

    def __init__(self):
        super().__init__()
        self._queue: deque[tuple[int, Callable]] = deque()
        self._queued = 0  # sequence number of the last queued op
        self._released = 0  # ops up to here may be applied
        self._applied = 0  # ops up to here have been applied
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._work, daemon=True, name="kvbench-async-dev")
        self._thread.start()
        self._copy: AsyncCPUDevice | None = None  # the copy stream, made on first use
        self.log: list[tuple[str, object]] | None = None  # tests: ("queued"/"applied", tag)

    def copy_after(self, ready: Event | None, pairs) -> tuple[Event, tuple | None]:
        """On a second worker (the copy stream): each copy first waits until this device has
        applied everything up to `ready` (releasing it that far, as a CUDA stream waiting on
        an event lets the other stream run on), then copies. Nothing blocks the host."""
        if self._copy is None:
            self._copy = AsyncCPUDevice()
            self._copy.log = self.log  # one log: the order across both streams
        with self._cv:
            dep = ready.seq if isinstance(ready, AsyncEvent) else self._queued

        def copies():
            self._release(dep)
            self._wait_for(dep)
            for dst, src in pairs:
                dst.copy_(src)
        copies.tag = ("copy", dep)
        self._copy.run(copies)
        return self._copy.record(), None

    def run(self, fn) -> None:
        with self._cv:
            self._queued += 1
            self._queue.append((self._queued, fn))
            if self.log is not None:
                self.log.append(("queued", getattr(fn, "tag", None)))

    def record(self) -> Event:
        with self._cv:
            return AsyncEvent(self, self._queued)

    def synchronize(self) -> None:
        with self._cv:
            target = self._queued
        self.host_waits += 1
        self._release(target)
        self._wait_for(target)

    @property
    def pending(self) -> int:
        """Operations queued but not applied yet."""
        return self._queued - self._applied

    def _release(self, seq: int) -> None:
        with self._cv:
            if seq > self._released:
                self._released = seq
                self._cv.notify_all()

    def _wait_for(self, seq: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._applied >= seq or self._error is not None)
            if self._error is not None:
                raise RuntimeError(f"cpu-async device: queued work failed: {self._error!r}")

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or (self._queue and
                                                         self._queue[0][0] <= self._released))
                if self._stop:
                    return
                seq, fn = self._queue.popleft()
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced on the next wait
                with self._cv:
                    self._error = exc
                    self._cv.notify_all()
                return
            with self._cv:
                self._applied = seq
                if self.log is not None:
                    self.log.append(("applied", getattr(fn, "tag", None)))
                self._cv.notify_all()

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)


def make_device(name: str) -> Device:
    if name == "cpu":
        return CPUDevice()
    if name == "cuda":
        return CUDADevice()
    if name == "cpu-async":
        return AsyncCPUDevice()
    raise ValueError(f"unknown device {name!r}; choose from {', '.join(DEVICES)}")


def mem_available_bytes() -> int | None:
    """The host's MemAvailable (bytes), None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
