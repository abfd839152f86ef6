"""mpi4py buffer sends of the tensors' bytes.

Host buffers go straight to MPI. Device buffers go straight too when the MPI library is
CUDA-aware; otherwise they are staged through pinned host memory and the staging time is
reported as its own component. Messages above 1 GiB are split, because MPI counts are
32-bit on many builds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.transports import register
from kvbench.transports.base import Channel, Request, Transport
from kvbench.transports.staging import HostStaging, chunks

_MAX_MSG = 1 << 30
_DATA_TAG = 11


def cuda_aware() -> bool:
    """Whether this MPI can take device pointers (Open MPI / MPICH extensions)."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query else False
    except Exception:  # noqa: BLE001 - unknown means no
        return False


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
    def __init__(self, transport: MPITransport, peer: int, buffers: Sequence, is_sender: bool):
        super().__init__(transport, peer, buffers, is_sender)
        device_direct = transport.device_direct
        self.staging = HostStaging([] if device_direct else self.buffers)
        self.comm = transport.comm

    def post(self, i: int) -> Request:
        if self.is_sender:
            host = self.staging.to_host(i) if self.staging.active else self.buffers[i]
            reqs = [self.comm.Isend(_buf(c), dest=self.peer, tag=_DATA_TAG)
                    for c in chunks(host, _MAX_MSG)]
            return _MPIRequest(reqs)
        host = self.staging.host[i] if self.staging.active else self.buffers[i]
        reqs = [self.comm.Irecv(_buf(c), source=self.peer, tag=_DATA_TAG)
                for c in chunks(host, _MAX_MSG)]
        return _MPIRequest(reqs, (lambda: self.staging.to_device(i)) if self.staging.active else None)

    def begin_handoff(self) -> None:
        self.staging.begin()

    def end_handoff(self) -> None:
        self.staging.end()

    def breakdown(self) -> dict[str, list[float]]:
        return self.staging.breakdown()


@register
class MPITransport(Transport):
    name = "mpi"
    description = "mpi4py Isend/Irecv of the tensors' bytes (CUDA-aware or host-staged on GPU)"

    def open(self) -> None:
        # A private communicator keeps data traffic apart from the harness's own messages.
        self.comm = self.ctx.comm.Dup()
        self.device_direct = self.ctx.device == "cuda" and cuda_aware()

    def channel(self, peer: int, buffers: Sequence, is_sender: bool) -> Channel:
        return MPIChannel(self, peer, buffers, is_sender)

    def info(self) -> dict:
        from mpi4py import MPI

        return {"mpi_library": MPI.Get_library_version().strip().splitlines()[0],
                "cuda_aware": cuda_aware(),
                "path": ("device-direct" if getattr(self, "device_direct", False)
                         else "host-staged" if self.ctx.device == "cuda" else "host")}

    def close(self) -> None:
        self.comm.Free()
