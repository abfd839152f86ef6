"""Same-host handoff in one copy: the peer's buffers mapped into this process (--transport ipc).

At channel set-up one side exports its message buffers (kvbench/p2p/transports/ipc_mem.py:
anonymous shared memory (memfd) on the host, CUDA IPC memory handles on a GPU) and the other maps them
once, the handles going over MPI. Each handoff is then one copy by the mapping side plus
small readiness messages over MPI, on the one handoff engine like every other transport:

    read (default)  the producer's KV (or its packed staging) is exported; a post waits for
                    the step's readiness (host: the event; CUDA: an IPC event recorded on the
                    producer's stream) and sends one message per step naming the messages
                    released; the consumer copies each released message from the mapping
                    into its own KV (CUDA: on its stream, after waiting on the IPC event)
    write           the consumer's KV is exported; the producer copies into it after the
                    readiness, then names the messages written (CUDA: its IPC event orders
                    the consumer's stream after the copy)

The engine's completion notice then tells the producer the consumer holds every byte.

Only ranks on one host can map each other's memory: a run whose pairs span hosts is refused
before anything is set up (one line, exit status 2). A producer that dies leaves the
consumer's mapping valid (the memory lives until the last mapping goes) and the consumer
waits for a readiness message against --timeout like every other receive. No segment name
ever exists (an anonymous memfd, see ipc_mem), so nothing can be left in /dev/shm. A set-up
failure is printed by the rank that hit it; its peer ends without a line of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from kvbench.links import linkcauses
from kvbench.links.linkpath import LinkPath, PairFacts
from kvbench.p2p.hostcopy import METHOD as HOST_COPY
from kvbench.p2p.hostcopy import memcpy
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import (
    Channel,
    PeerReported,
    Reported,
    Request,
    Transport,
    TransportError,
)
from kvbench.p2p.transports.ipc_cuda import HandoffParts
from kvbench.p2p.transports.ipc_mem import (
    CudaMapping,
    HostMapping,
    can_move_in_place,
    export_cuda,
    export_host,
    shmem_huge_pages,
)
from kvbench.p2p.watchdog import WATCHDOG

_TAG0 = 23000  # channel k between two ranks: set-up on _TAG0 + 2k, readiness on _TAG0 + 2k + 1


def cross_host_refusal(hosts: Sequence[str], pairs: Sequence[tuple[int, int]]) -> str | None:
    """Why ipc cannot run on this world (a pair of ranks on two hosts), or None."""
    for a, b in pairs:
        if hosts[a] != hosts[b]:
            return (f"--transport ipc maps memory between processes of one host, but ranks {a} "
                    f"({hosts[a]}) and {b} ({hosts[b]}) are on different hosts: use mpi, nixl or "
                    "nccl between hosts")
    return None


def runs(idx: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive message indices, in order."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def adjacent(a: Sequence, b: Sequence) -> list[bool]:
    """joins[i]: message i starts where message i-1 ends in both buffer lists (same storage),
    so the two can go as one copy."""
    def follows(v, i) -> bool:
        return (v[i].untyped_storage().data_ptr() == v[i - 1].untyped_storage().data_ptr()
                and v[i].data_ptr() == v[i - 1].data_ptr() + v[i - 1].numel())
    return [False] + [follows(a, i) and follows(b, i) for i in range(1, len(a))]


def span(views: Sequence, a: int, b: int):
    """One byte view over messages a..b-1, adjacent in one storage."""
    if b == a + 1:
        return views[a]
    v = views[a]
    n = views[b - 1].data_ptr() + views[b - 1].numel() - v.data_ptr()
    return v.new_empty(0).set_(v.untyped_storage(), v.storage_offset(), (n,), (1,))


class _Sent(Request):
    """The producer's side of a step: its readiness messages on their way."""

    def __init__(self, reqs, keep):
        self.reqs, self.keep, self.done = reqs, keep, not reqs

    def test(self) -> bool:
        if not self.done:
            from mpi4py import MPI

            self.done = MPI.Request.Testall(self.reqs)
        return self.done


class _Arrival(Request):
    """The consumer's side of one message: released (read: then copied) or written."""

    def __init__(self, ch: IPCChannel, i: int):
        self.ch, self.i, self.done = ch, i, False

    def test(self) -> bool:
        if self.done:
            return True
        ch = self.ch
        if not ch.flags[self.i]:
            ch.drain()
            if not ch.flags[self.i]:
                return False
        self.done = True
        return True


class IPCChannel(Channel):
    """One direction between two ranks of one host; `remote` are the peer's buffers, mapped
    (on the exporting side: None)."""

    def __init__(self, t: IPCTransport, peer: int, buffers: Sequence, is_sender: bool, layer_of,
                 k: int):
        super().__init__(t, peer, buffers, is_sender, layer_of)
        self.t, self.comm = t, t.comm
        self.tag_setup, self.tag = _TAG0 + 2 * k, _TAG0 + 2 * k + 1
        self.reading = t.mode == "read"
        self.cuda = t.on_cuda
        self.flags = np.zeros(len(self.buffers), dtype=bool)
        self.sig = np.zeros(2, dtype=np.int64)
        self.mapping = None
        self.remote: list | None = None
        self.joins: list[bool] = []  # the copying side: message i continues i-1 on both sides
        self.event = None  # CUDA: the IPC event the sender records and the receiver waits on
        self.parts = None  # CUDA, the copying side: its handoff's parts timed (ipc_cuda)
        with WATCHDOG.bounded(f"the ipc handle exchange with rank {peer}"):
            self._exchange(exporter=is_sender == self.reading)

    def _exchange(self, exporter: bool) -> None:
        """Exporter sends its handles; the importer maps them and answers with None or the
        reason it could not. On CUDA the sender then sends its IPC event's handle."""
        comm, peer, tag = self.comm, self.peer, self.tag_setup
        if exporter:
            self.t.dev.synchronize()  # the bytes are final before they move into shared memory
            try:
                handle = export_cuda(self.buffers) if self.cuda else export_host(self.buffers)
            except (TransportError, OSError, RuntimeError) as exc:  # the peer must not wait
                comm.send({"error": str(exc)}, dest=peer, tag=tag)
                raise Reported(str(exc)) from None
            comm.send(handle, dest=peer, tag=tag)
            reply = comm.recv(source=peer, tag=tag)
            problem = reply if isinstance(reply, str) else None
            if isinstance(reply, dict):  # where the peer opened the handles
                self.t.opened_on = reply.get("opened_on")
        else:
            handle = comm.recv(source=peer, tag=tag)
            problem = handle.get("error")
            if problem is None:
                try:
                    self.mapping = CudaMapping(handle) if self.cuda else HostMapping(handle)
                    self.t.opened_on = getattr(self.mapping, "opened_on", None)
                    self.remote = self.mapping.views
                    self.joins = adjacent(self.remote, self.buffers)
                except (TransportError, OSError, RuntimeError) as exc:
                    comm.send(str(exc), dest=peer, tag=tag)
                    raise Reported(str(exc)) from None
                comm.send({"opened_on": self.t.opened_on}, dest=peer, tag=tag)
        if problem:  # the peer's own failure: it prints the line and ends the job
            raise PeerReported(f"rank {peer}: {problem}")
        if self.cuda:
            self._share_event()
            if self.is_sender != self.reading:  # this rank copies
                self.parts = HandoffParts(waits=self.reading)

    def _share_event(self) -> None:
        """The sender's IPC event (recorded after each step's production, and copy when
        writing), opened by the receiver, whose stream waits on it before touching the bytes."""
        import torch

        if self.is_sender:
            self.event = torch.cuda.Event(interprocess=True)
            self.comm.send(self.event.ipc_handle(), dest=self.peer, tag=self.tag_setup)
        else:
            handle = self.comm.recv(source=self.peer, tag=self.tag_setup)
            self.event = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)

    # -- one handoff --------------------------------------------------------------------------

    def copy_range(self, lo: int, hi: int) -> None:
        """Messages lo..hi-1 copied (read: mapping -> own buffers; write: own -> mapping), one
        copy per run of messages adjacent on both sides (contiguous blocks of a layer; the
        blocks of paged tables are mostly apart and go one by one). Host: the C library's
        memcpy (hostcopy.memcpy; torch's copy_ runs at half its speed on some hosts). CUDA:
        queued on this rank's stream, completed by the engine's device synchronisation before
        the notice."""
        src, dst = (self.remote, self.buffers) if self.reading else (self.buffers, self.remote)
        a = lo
        for b in range(lo + 1, hi + 1):
            if b == hi or not self.joins[b]:
                if self.cuda:
                    span(dst, a, b).copy_(span(src, a, b), non_blocking=True)
                else:
                    memcpy(span(dst, a, b), span(src, a, b))
                self.count_posted()
                a = b

    def drain(self) -> None:
        """Take in every readiness message that has arrived (one per step and run)."""
        comm, peer, tag = self.comm, self.peer, self.tag
        while comm.Iprobe(source=peer, tag=tag):
            comm.Recv(self.sig, source=peer, tag=tag)
            lo, hi = int(self.sig[0]), int(self.sig[1])
            if self.cuda:  # this rank's stream runs after the sender's production (and copy)
                if self.reading:
                    self.parts.step(self.event, partial(self.copy_range, lo, hi))
                else:
                    import torch

                    torch.cuda.current_stream().wait_event(self.event)
            elif self.reading:
                self.copy_range(lo, hi)
            self.flags[lo:hi] = True

    def post(self, i: int, ready=None) -> Request:
        return self.post_many([i], ready)[0]

    def post_many(self, idx: list[int], ready=None) -> list[Request]:
        if not self.is_sender:
            return [_Arrival(self, i) for i in idx]
        if self.cuda:  # stream-ordered: the copy and the event follow the producer's work
            import torch

            if not self.reading:
                self.parts.step(None, lambda: [self.copy_range(lo, hi) for lo, hi in runs(idx)])
            self.event.record(torch.cuda.current_stream())
        else:
            if ready is not None:
                ready.wait()  # the step's bytes are produced before the peer may read them
            if not self.reading:
                for lo, hi in runs(idx):
                    self.copy_range(lo, hi)
        reqs, keep = [], []
        for lo, hi in runs(idx):
            sig = np.array([lo, hi], dtype=np.int64)
            keep.append(sig)
            reqs.append(self.comm.Isend(sig, dest=self.peer, tag=self.tag))
        return [_Sent(reqs, keep)] + [_Sent([], None) for _ in idx[1:]]

    def begin_handoff(self) -> None:
        self.flags[:] = False
        if self.parts is not None:
            self.parts.begin()

    def end_handoff(self) -> None:
        if self.parts is not None:
            self.parts.end()

    def breakdown(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self.parts.per.items()} if self.parts is not None else {}

    def close(self) -> None:
        if self.mapping is not None:
            self.remote = None
            self.mapping.close()
            self.mapping = None


@register
class IPCTransport(Transport):
    name = "ipc"
    description = ("same host, one copy: the peer's KV mapped (anonymous shared memory on CPU, CUDA "
                   "IPC handles on GPU), readiness over MPI")

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("ipc transport (--transport ipc)")
        g.add_argument("--ipc-mode", choices=("read", "write"), default="read",
                       help="read (default): the decode rank maps the prefill rank's KV and copies "
                            "it into its own; write: the prefill rank maps the decode rank's KV "
                            "and copies into it")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.mode = getattr(ctx.options, "ipc_mode", "read")
        self.dev = ctx.dev
        self.on_cuda = ctx.dev.name == "cuda"
        self.comm = None
        self.opened_on: str | None = None  # CUDA: where the copying rank opened the handles
        self._channels: dict[tuple[int, int], int] = {}

    def refusal(self) -> str | None:
        if not self.on_cuda and can_move_in_place():
            return can_move_in_place()
        return cross_host_refusal(self.ctx.hosts, self.ctx.pairs) if self.ctx.hosts else None

    def open(self) -> None:
        self.comm = self.ctx.comm.Dup()  # readiness messages apart from the harness's own

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None) -> Channel:
        key = tuple(sorted((self.ctx.rank, peer)))
        k = self._channels.get(key, 0)
        self._channels[key] = k + 1
        return IPCChannel(self, peer, buffers, is_sender, layer_of, k)

    def post_many(self, items, ready=None) -> list[Request]:
        """Consecutive items of one channel go together (one readiness message per run)."""
        return self.post_by_channel_runs(items, ready)

    @property
    def path(self) -> str:
        return "cuda_ipc" if self.on_cuda else "shm"

    def spec_options(self) -> dict:
        return {"path": self.path, "mode": self.mode}

    def info(self) -> dict:
        how = ("CUDA IPC memory handles, device-to-device copy on the copying rank's stream"
               if self.on_cuda else
               "anonymous shared memory (memfd, no name; mapped through /proc/PID/fd)")
        info = {"path": self.path, "mode": self.mode, "mapping": how}
        if not self.on_cuda:
            info["copy"] = HOST_COPY
            info["shmem_huge_pages"] = shmem_huge_pages()
        elif self.opened_on:
            info["opened_on"] = self.opened_on
        return info

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    # -- the declaration (kvbench.p2p.transports.base) ---------------------------------------

    joins_adjacent = True  # one copy per run of messages adjacent on both sides

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        """shm on host memory; cuda_ipc: one GPU shared by both ranks (the record's UUIDs, or
        weaker evidence said as such), else NVLink or PCIe (the record names no topology)."""
        path = str(info.get("path") or "")
        if path == "shm":
            return LinkPath(frozenset({"shm"}), "ipc: shared memory between processes of one host")
        if path == "cuda_ipc":
            if pair.same_gpu:
                ev = linkcauses.Evidence("ipc", "cuda", frozenset({"same-device"}),
                                         same_gpu=pair.same_gpu)
                return LinkPath(frozenset({"same-device"}), f"ipc: cuda_ipc, both ranks on one "
                                f"GPU: {pair.same_gpu}", causes=linkcauses.diagnose(ev))
            return LinkPath(frozenset({"nvlink", "pcie"}), "ipc: cuda_ipc between two GPUs (the "
                            "record names no topology: NVLink or PCIe)")
        return LinkPath(frozenset({"unknown"}), f"ipc: {path or 'no path recorded'}")
