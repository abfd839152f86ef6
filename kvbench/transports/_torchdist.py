"""torch.distributed point-to-point, shared by the gloo and nccl transports.

The process group is created from the MPI world: rank 0 picks a free TCP port and the
address is sent to every rank over MPI, so no launcher variables are needed. On one
host the rendezvous stays on 127.0.0.1.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence

import torch

from kvbench.transports.base import Channel, Request, Transport, TransportError


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rendezvous_address(comm, hosts: list[str]) -> str:
    """tcp://addr:port agreed over MPI (MASTER_ADDR overrides the address)."""
    if comm.Get_rank() == 0:
        addr = os.environ.get("MASTER_ADDR")
        if not addr:
            addr = "127.0.0.1" if len(set(hosts)) <= 1 else socket.gethostbyname(socket.gethostname())
        port = int(os.environ.get("MASTER_PORT") or _free_port("" if addr != "127.0.0.1" else addr))
        url = f"tcp://{addr}:{port}"
    else:
        url = None
    return comm.bcast(url, root=0)


class _Waiter:
    """Completes torch.distributed works in the background, in posting order.

    Gloo's `Work.is_completed()` does not turn true until someone calls `wait()`, so
    polling it would spin forever; a thread that waits (releasing the GIL) gives the
    harness a non-blocking `test()` with the same meaning for every backend."""

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvbench-waiter")
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            works, flag = item
            try:
                for w in works:
                    w.wait()
            except BaseException as exc:  # noqa: BLE001 - surfaced by test()
                self.error = exc
            flag.set()

    def submit(self, works) -> threading.Event:
        flag = threading.Event()
        self.q.put((works, flag))
        return flag

    def stop(self) -> None:
        # Join: a daemon thread still unwinding at interpreter exit drops its last Work
        # objects there, their destructors retake the GIL during finalisation, and the
        # process dies with 'terminate called without an active exception' (seen with
        # more ranks than cores, where the thread is often not scheduled in time).
        self.q.put(None)
        self.thread.join(timeout=10)


class _WorkRequest(Request):
    def __init__(self, waiter: _Waiter, works, on_done=None):
        self.waiter = waiter
        self.flag = waiter.submit(works)
        self.on_done = on_done
        self.done = False

    def test(self) -> bool:
        if not self.done and not self.flag.is_set():
            # Hand the GIL to the waiter thread now; otherwise a busy-polling caller keeps
            # it for the interpreter's 5 ms switch interval and that lands in every sample.
            time.sleep(0)
        if not self.done and self.flag.is_set():
            if self.waiter.error is not None:
                raise TransportError(f"torch.distributed transfer failed: {self.waiter.error}")
            self.done = True
            if self.on_done:
                self.on_done()
        return self.done


class _PolledRequest(Request):
    """For NCCL: `is_completed()` queries the CUDA event of the operation, non-blocking and
    exact. (Its `wait()` only makes the caller's stream wait, so a waiter thread would say
    'done' before the bytes land.)"""

    def __init__(self, works, on_done=None):
        self.works, self.on_done, self.done = works, on_done, False

    def test(self) -> bool:
        if not self.done and all(w.is_completed() for w in self.works):
            self.done = True
            if self.on_done:
                self.on_done()
        return self.done


class TorchDistChannel(Channel):
    def post(self, i: int) -> Request:
        import torch.distributed as dist

        buf = self.transport.prepare(self, i)
        op = dist.isend if self.is_sender else dist.irecv
        works = [op(c, self.peer) for c in self.transport.split(buf)]
        done = None if self.is_sender else (lambda: self.transport.finish_recv(self, i))
        if self.transport.poll_completion:
            return _PolledRequest(works, done)
        return _WorkRequest(self.transport.waiter, works, done)

    def begin_handoff(self) -> None:
        self.transport.begin(self)

    def end_handoff(self) -> None:
        self.transport.end(self)

    def breakdown(self) -> dict[str, list[float]]:
        return self.transport.channel_breakdown(self)


class TorchDistTransport(Transport):
    """Base for torch.distributed backends; subclasses set `backend`."""

    backend = "gloo"
    max_message = 1 << 30
    poll_completion = False  # True: Work.is_completed() is exact and non-blocking (NCCL)

    def open(self) -> None:
        import torch.distributed as dist

        url = rendezvous_address(self.ctx.comm, self.ctx.hosts)
        t0 = time.perf_counter()
        kwargs = {}
        if self.backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(self.backend, init_method=url, rank=self.ctx.rank,
                                world_size=self.ctx.comm.Get_size(),
                                timeout=datetime.timedelta(seconds=max(30, self.ctx.timeout_s)),
                                **kwargs)
        self.init_ms = (time.perf_counter() - t0) * 1e3
        self.url = url
        self.waiter = _Waiter()

    def channel(self, peer: int, buffers: Sequence, is_sender: bool) -> Channel:
        return TorchDistChannel(self, peer, buffers, is_sender)

    # hooks for host staging (gloo on GPU); identity by default
    def prepare(self, ch: Channel, i: int):
        return ch.buffers[i]

    def finish_recv(self, ch: Channel, i: int) -> None:
        pass

    def begin(self, ch: Channel) -> None:
        pass

    def end(self, ch: Channel) -> None:
        pass

    def channel_breakdown(self, ch: Channel) -> dict[str, list[float]]:
        return {}

    def split(self, buf):
        n = buf.numel()
        return [buf[a:min(a + self.max_message, n)] for a in range(0, n, self.max_message)] or [buf]

    def info(self) -> dict:
        return {"backend": self.backend, "rendezvous": getattr(self, "url", None),
                "init_process_group_ms": getattr(self, "init_ms", None)}

    def close(self) -> None:
        import torch.distributed as dist

        if hasattr(self, "waiter"):
            self.waiter.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
