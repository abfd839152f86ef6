"""toy: a transport that tests/p2p/test_planted_transport.py plants, as this one file, into a
copy of kvbench/p2p/transports/ (it is not part of kvbench).

Host memory only. The messages of a handoff that lie adjacent in memory on both sides (a
layer's contiguous blocks) go as one mpi4py message per run, straight from the sender's
KV into the receiver's (no copy); each run is one descriptor. Everything the rest of
kvbench needs to know of it is declared here and nowhere else: its flag and that flag's
check, the field it adds to records, its descriptor count (runs of adjacent pieces:
`joins_adjacent`) and its link (`host`: two processes of one host, through MPI's own
shared memory). Like every transport module it imports neither torch nor mpi4py at module
level: the fit and the plan read the declaration without them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from kvbench.errors import UsageError
from kvbench.links.linkpath import LinkPath, PairFacts
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import Channel, Request, Transport, TransportError

_SETUP, _DATA = 31, 32  # tags on the transport's own communicator


def _follows(bufs: Sequence) -> list[bool]:
    """follows[i]: message i starts where message i-1 ends, in one storage."""
    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    return [False] + [
        bufs[i].untyped_storage().data_ptr() == bufs[i - 1].untyped_storage().data_ptr()
        and bufs[i].data_ptr() == bufs[i - 1].data_ptr() + nbytes(bufs[i - 1])
        for i in range(1, len(bufs))]


def _view(bufs: Sequence, a: int, b: int) -> np.ndarray:
    """One byte array over messages a..b-1 (adjacent: _follows)."""
    start = bufs[a].data_ptr()
    n = bufs[b - 1].data_ptr() + bufs[b - 1].numel() * bufs[b - 1].element_size() - start
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(start)) if n else \
        np.empty(0, np.uint8)


class _Run(Request):
    """A run's one MPI request (None until the run's last message is posted)."""

    def __init__(self):
        self.req = None
        self.done = False

    def test(self) -> bool:
        if not self.done and self.req is not None:
            self.done = bool(self.req.Test())
        return self.done


class ToyChannel(Channel):
    def __init__(self, transport: ToyTransport, peer: int, buffers: Sequence, is_sender: bool,
                 layer_of=None):
        super().__init__(transport, peer, buffers, is_sender, layer_of)
        self.comm = transport.comm
        mine = _follows(self.buffers)
        theirs = self.comm.sendrecv(mine, dest=peer, sendtag=_SETUP, source=peer, recvtag=_SETUP)
        if len(theirs) != len(mine):
            raise TransportError(f"toy: {len(mine)} messages here, {len(theirs)} on rank {peer}")
        joins = [a and b for a, b in zip(mine, theirs, strict=True)]
        starts = [i for i, j in enumerate(joins) if not j]
        self.runs = list(zip(starts, starts[1:] + [len(joins)], strict=True))
        self.run_of = [r for r, (a, b) in enumerate(self.runs) for _ in range(a, b)]
        self.views = [_view(self.buffers, a, b) for a, b in self.runs]
        self.begin_handoff()

    def begin_handoff(self) -> None:
        self.left = [b - a for a, b in self.runs]
        self.reqs = [_Run() for _ in self.runs]

    def post(self, i: int, ready=None) -> Request:
        return self.post_many([i], ready)[0]

    def post_many(self, idx: list[int], ready=None) -> list[Request]:
        if ready is not None:
            ready.wait()  # not stream-ordered: the producer's bytes are final first
        out = []
        for i in idx:
            r = self.run_of[i]
            self.left[r] -= 1
            if self.left[r] == 0:  # the run's last message: the run goes as one
                if self.is_sender:
                    self.reqs[r].req = self.comm.Isend(self.views[r], dest=self.peer, tag=_DATA)
                    self.count_posted()
                else:
                    self.reqs[r].req = self.comm.Irecv(self.views[r], source=self.peer, tag=_DATA)
            out.append(self.reqs[r])
        return out


@register
class ToyTransport(Transport):
    name = "toy"
    description = "planted test transport: one mpi4py message per run of adjacent pieces"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("toy transport (--transport toy)")
        g.add_argument("--toy-join", choices=("adjacent",), default="adjacent",
                       help="how pieces are joined into messages (one way only)")

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return None if device == "cpu" else "the toy transport moves host memory: --device cpu"

    def open(self) -> None:
        self.comm = self.ctx.comm.Dup()

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None) -> Channel:
        return ToyChannel(self, peer, buffers, is_sender, layer_of)

    def post_many(self, items, ready=None) -> list[Request]:
        return self.post_by_channel_runs(items, ready)

    def info(self) -> dict:
        return {"path": "toy: MPI messages between two processes of one host"}

    def record_fields(self) -> dict:
        return {"toy_join": self.ctx.options.toy_join}

    def close(self) -> None:
        self.comm.Free()

    # -- the declaration -------------------------------------------------------------------

    record_field_names = ("toy_join",)
    joins_adjacent = True

    @classmethod
    def check_arguments(cls, args, world_size: int) -> None:
        if args.transport == "toy" and args.layout == "paged" and args.granularity != "block":
            raise UsageError("--transport toy moves a paged KV block by block: add "
                             "--granularity block")

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        path = str(info.get("path") or "")
        if path.startswith("toy:"):
            return LinkPath(frozenset({"host"}), path)
        return LinkPath(frozenset({"unknown"}), path or "no path recorded")
