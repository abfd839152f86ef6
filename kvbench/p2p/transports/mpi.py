"""mpi4py buffer sends of the tensors' bytes.

Host buffers go straight to MPI. Device buffers go straight too when the MPI library is
CUDA-aware (`--mpi-device-direct auto|yes|no`); otherwise they are staged through pinned
host memory and the staging time is reported as its own component. Messages above 1 GiB
are split, because MPI counts are 32-bit on many builds.

MPI is not stream-ordered: on an asynchronous device (CUDA) a send is handed to MPI only once
the producer's readiness event (device-direct), or the staging copies queued after it on the
device's copy stream (host-staged), say done: polled, never waited on (HeldPosts). On host
memory the event is already done and the send goes at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvbench.links.linkpath import LinkPath, PairFacts, by_path
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import Channel, Request, Transport, TransportError
from kvbench.p2p.transports.mpi_cuda import cuda_support
from kvbench.p2p.transports.staging import HostStaging, chunks

_MAX_MSG = 1 << 30
_DATA_TAG = 11


def cuda_aware() -> bool:
    """Whether this MPI can take device pointers (asked of the loaded libmpi: mpi_cuda)."""
    return cuda_support().aware


def _buf(t):
    """mpi4py wants the buffer protocol (host) or __cuda_array_interface__ (device)."""
    return t if t.is_cuda else t.numpy()


class _MPIRequest(Request):
    def __init__(self, reqs, on_done=None):
        self.reqs = reqs
        self.on_done = on_done
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        from mpi4py import MPI

        if MPI.Request.Testall(self.reqs):
            self.done = True
            if self.on_done:
                self.on_done()
        return self.done


class MPIChannel(Channel):
    def __init__(self, transport: MPITransport, peer: int, buffers: Sequence, is_sender: bool,
                 layer_of=None):
        super().__init__(transport, peer, buffers, is_sender)
        self.staging = HostStaging(self.buffers, transport.ctx.dev, not transport.direct)
        self.comm = transport.comm
        # what MPI is handed per message, made once (the buffers never move)
        self.mpi_bufs = [[_buf(c) for c in chunks(h, _MAX_MSG)] for h in self.staging.host]
        # sends waiting for their bytes: one queue per peer, shared by every channel to it
        # (MPI matches a peer's sends on one communicator and tag in the order posted)
        self.held = transport.held_for(peer)

    def post(self, i: int, ready=None) -> Request:
        return self.post_many([i], ready)[0]

    def post_many(self, idx: list[int], ready=None) -> list[Request]:
        """Several messages of one step, posted together. On an asynchronous device (CUDA)
        they are handed to MPI once their bytes are final (the readiness event, or host-staged
        the staging copies' event), polled, never waited on; on host memory at once."""
        comm, peer = self.comm, self.peer
        if not self.is_sender:
            done = self.staging.to_device if self.staging.active else None
            return [_MPIRequest([comm.Irecv(b, source=peer, tag=_DATA_TAG)
                                 for b in self.mpi_bufs[i]], done and partial(done, i))
                    for i in idx]
        if self.staging.dev.asynchronous:
            # until the gate is done the host goes on queueing compute; sends reach MPI in
            # posting order (the receives of one tag match them in that order)
            gate = self.staging.to_host_later(idx, ready)  # unstaged: `ready` itself
            return self.held.hold_requests(gate, lambda: [self.isend(i) for i in idx], len(idx))
        if ready is not None or self.staging.active:
            self.staging.to_host_many(idx, ready)
        return [self.isend(i) for i in idx]

    def isend(self, i: int) -> Request:
        """Message i handed to MPI now (its host bytes are final)."""
        sends = [self.comm.Isend(b, dest=self.peer, tag=_DATA_TAG) for b in self.mpi_bufs[i]]
        self.count_posted(len(sends))
        return _MPIRequest(sends)

    def begin_handoff(self) -> None:
        # nothing of an earlier (abandoned) handoff may go out in this one (the queue is the
        # peer's: every link of a handoff begins before anything is posted)
        self.held.clear()
        self.staging.begin()

    def end_handoff(self) -> None:
        self.staging.end()

    def breakdown(self) -> dict[str, list[float]]:
        return self.staging.breakdown()


@register
class MPITransport(Transport):
    name = "mpi"
    description = "mpi4py Isend/Irecv of the tensors' bytes (CUDA-aware or host-staged on GPU)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("mpi transport (--transport mpi)")
        g.add_argument("--mpi-device-direct", choices=("auto", "yes", "no"), default="auto",
                       help="device buffers: hand them to MPI directly (yes: needs a CUDA-aware "
                            "MPI on GPU) or stage through host memory (no); auto: directly when "
                            "the loaded libmpi's MPIX_Query_cuda_support() says so (the pip "
                            "Open MPI wheel is built without CUDA)")

    def open(self) -> None:
        # A private communicator keeps data traffic apart from the harness's own messages.
        self.comm = self.ctx.comm.Dup()
        dev = self.ctx.dev
        choice = getattr(self.ctx.options, "mpi_device_direct", "auto")
        if dev.host_visible:
            self.direct = True
        elif choice == "auto":
            self.direct = dev.name == "cuda" and cuda_aware()
        else:
            self.direct = choice == "yes"
        if self.direct and dev.name == "cuda" and not cuda_aware():
            raise TransportError("--mpi-device-direct yes, but this MPI is not CUDA-aware "
                                 f"({cuda_support().how}): use no or auto, or a CUDA-aware MPI")

    @property
    def path(self) -> str:
        if self.ctx.dev.host_visible:
            return "host"
        return "device-direct" if self.direct else "host-staged"

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None) -> Channel:
        return MPIChannel(self, peer, buffers, is_sender)

    def post_many(self, items, ready=None) -> list[Request]:
        """Consecutive items of one channel go out together (one staging step)."""
        return self.post_by_channel_runs(items, ready)

    def spec_options(self) -> dict:
        return {"path": self.path}

    def info(self) -> dict:
        from mpi4py import MPI

        return {"mpi_library": MPI.Get_library_version().strip().splitlines()[0],
                "cuda_aware": cuda_aware(), "cuda_aware_query": cuda_support().how,
                "path": self.path}

    def close(self) -> None:
        self.comm.Free()

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        """On host memory (or staged through it) the MPI library picks shared memory or the
        network itself and does not say which: 'host'. Device-direct: the library's choice,
        unknown."""
        path = str(info.get("path") or "")
        if path in ("host", "host-staged"):
            return LinkPath(frozenset({"host"}), f"MPI {path}")
        if path.startswith(("UCX", "TCP")):
            return by_path(info, pair)
        return LinkPath(frozenset({"unknown"}), f"MPI {path or 'path not recorded'}")
