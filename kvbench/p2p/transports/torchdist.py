"""torch.distributed point-to-point, shared by the gloo and nccl transports.

The process group is created from the MPI world: rank 0 picks an address every rank can
reach and a free TCP port, and sends them to every rank over MPI (rendezvous.py), so no
launcher variables are needed. On one host the rendezvous stays on 127.0.0.1.

Every step's operations go out through `batch_isend_irecv`, even a single one: in torch's
NCCL backend a lone `isend`/`irecv` runs on a lazily created two-rank communicator of its own,
which the pre-connect (a batched exchange, on the world communicator) never made, so the first
timed post would block its host thread until the peer posts (a hang when the peer waits in an
MPI barrier). A rank's operations to several peers are interleaved before they are cut into
groups of GROUP_MAX, so every group moves every peer's data at once.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Sequence

from kvbench.p2p.registry import LazyModule
from kvbench.p2p.transports.base import (
    Channel,
    PeerReported,
    Reported,
    Request,
    Transport,
    TransportError,
)
from kvbench.p2p.transports.rendezvous import rendezvous_address

# imported on first use: the registry imports this module without torch (kvbench.p2p.registry)
torch = LazyModule("torch")
dist = LazyModule("torch.distributed")

GROUP_MAX = 1024  # P2P operations per batch_isend_irecv group


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


class _Member(Request):
    """One item of a grouped post: complete when the group is (the receiver's per-message
    completion hook still runs once per item)."""

    def __init__(self, group: Request, on_done=None):
        self.group, self.on_done, self.done = group, on_done, False

    def test(self) -> bool:
        if not self.done and self.group.test():
            self.done = True
            if self.on_done:
                self.on_done()
        return self.done


class _PolledRequest(Request):
    """For NCCL: `is_completed()` queries the CUDA event of the operation, non-blocking and
    exact. (Its `wait()` only makes the caller's stream wait, so a waiter thread would say
    'done' before the bytes land.) But `is_completed()` is true for a *failed* work too (an
    aborted communicator, a peer gone): once it says done, `wait()` is called on each work,
    which raises on failure and otherwise costs a stream wait on a finished event."""

    def __init__(self, works, on_done=None):
        self.works, self.on_done, self.done = works, on_done, False

    def test(self) -> bool:
        if not self.done and all(w.is_completed() for w in self.works):
            try:
                for w in self.works:
                    w.wait()
            except Exception as exc:  # noqa: BLE001 - any backend error is a failed transfer
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise TransportError(f"torch.distributed transfer failed: {first[:300]}") from None
            self.done = True
            if self.on_done:
                self.on_done()
        return self.done


class TorchDistChannel(Channel):
    def post(self, i: int, ready=None) -> Request:
        return self.transport.post_many([(self, i)], ready)[0]

    def begin_handoff(self) -> None:
        self.transport.begin(self)

    def end_handoff(self) -> None:
        self.transport.end(self)

    def breakdown(self) -> dict[str, list[float]]:
        return self.transport.channel_breakdown(self)


def interleave_by_peer(ops: list[tuple]) -> list[tuple]:
    """(fn, tensor, peer) operations round-robin across peers, each peer's own order kept: cut
    into groups afterwards, every group then carries every peer's share (in link order a rank
    with two peers would finish one peer's blocks before the other's start)."""
    by_peer: dict[int, list[tuple]] = {}
    for op in ops:
        by_peer.setdefault(op[2], []).append(op)
    if len(by_peer) < 2:
        return list(ops)
    out: list[tuple] = []
    queues = list(by_peer.values())
    for k in range(max(len(q) for q in queues)):
        out += [q[k] for q in queues if k < len(q)]
    return out


def preconnect_order(pairs) -> list[tuple[int, int]]:
    """Every unordered pair once, sorted. Each rank connects its pairs in this one global
    order, so no rank can wait forever: the smallest pair not yet connected always has both
    of its ranks at it (each has finished every smaller pair of its own)."""
    return sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})


def preconnect(backend, rank: int, pairs, make_tensor) -> list[int]:
    """Connect this rank to each peer it will exchange data with: per pair, in
    `preconnect_order`, one grouped send+receive of a tiny tensor (both sides post both, so
    neither blocks on the other's lazy connection). Returns the peers in the order used."""
    peers = []
    for a, b in preconnect_order(pairs):
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        out, back = make_tensor(rank), make_tensor(-1)
        works = backend.batch_isend_irecv([backend.P2POp(backend.isend, out, peer),
                                           backend.P2POp(backend.irecv, back, peer)])
        for w in works or ():
            w.wait()
        peers.append((peer, back))
    return peers


class TorchDistTransport(Transport):
    """Base for torch.distributed backends; subclasses set `backend`."""

    backend = "gloo"
    max_message = 1 << 30
    poll_completion = False  # True: Work.is_completed() is exact and non-blocking (NCCL)
    batch_posts = False  # True: a step's posts go out as one group (batch_isend_irecv)
    lazy_connect = False  # True: connect every data pair in open() (NCCL)

    def open(self) -> None:
        url, error = rendezvous_address(self.ctx.comm, self.ctx.hosts)
        if error:  # every rank has it (agreed over MPI): rank 0 says it, once
            if self.ctx.rank == 0:
                raise Reported(f"{self.name}: {error}", everyone=True)
            raise PeerReported(f"{self.name}: {error}")
        t0 = time.perf_counter()
        kwargs = {}
        if self.backend == "nccl" and self.ctx.dev.name == "cuda":  # eager communicator
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        try:
            dist.init_process_group(self.backend, init_method=url, rank=self.ctx.rank,
                                    world_size=self.ctx.comm.Get_size(),
                                    timeout=datetime.timedelta(seconds=max(30, self.ctx.timeout_s)),
                                    **kwargs)
        except RuntimeError as exc:  # DistStoreError and friends: one line, not a traceback
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise TransportError(f"{self.name}: torch.distributed set-up at {url} failed: "
                                 f"{first[:300]} (set MASTER_ADDR to an address of rank 0's "
                                 "host that every rank can reach)") from None
        self.init_ms = (time.perf_counter() - t0) * 1e3
        self.url = url
        self.waiter = _Waiter()
        self.preconnect_ms = None
        if self.lazy_connect:
            self.connect_pairs()

    def connect_pairs(self) -> None:
        """Wire up every (src, dst) pair of the run before anything is timed (see preconnect)."""
        dev = self.ctx.dev
        t0 = time.perf_counter()
        got = preconnect(dist, self.ctx.rank, self.ctx.pairs,
                         lambda v: torch.full((1,), v, dtype=torch.int32, device=dev.torch_device))
        dev.synchronize()
        self.preconnect_ms = (time.perf_counter() - t0) * 1e3
        wrong = [peer for peer, back in got if int(back.item()) != peer]
        if wrong:
            raise TransportError(f"{self.name}: pre-connect exchange with rank(s) {wrong} "
                                 "returned the wrong value")

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None) -> Channel:
        return TorchDistChannel(self, peer, buffers, is_sender, layer_of)

    def post_many(self, items, ready=None) -> list[Request]:
        """Each item's buffer(s) posted with isend/irecv; with `batch_posts`, every item of
        the call in one batch_isend_irecv group (NCCL runs a group's sends and receives to
        several peers concurrently; separate calls would queue on one stream)."""
        return self.post_buffers(items, self.prepare_many(items, ready))

    def post_buffers(self, items, buffers) -> list[Request]:
        """post_many with each item's buffer already prepared (its bytes final)."""
        ops, owners = [], []
        for k, ((ch, _i), buf) in enumerate(zip(items, buffers, strict=True)):
            fn = dist.isend if ch.is_sender else dist.irecv
            pieces = self.split(buf)
            if ch.is_sender:
                ch.count_posted(len(pieces))
            for c in pieces:
                ops.append((fn, c, ch.peer))
                owners.append(k)
        if self.batch_posts:  # even one op: a lone isend would make a lazy pair communicator
            ops = interleave_by_peer(ops)
            works = []
            for a in range(0, len(ops), GROUP_MAX):  # bounded groups: a paged handoff has 10^5
                works += dist.batch_isend_irecv([dist.P2POp(fn, c, peer)
                                                 for fn, c, peer in ops[a:a + GROUP_MAX]]) or []
            group = self._request(works)
            return [_Member(group, self._on_done(ch, i)) for ch, i in items]
        per_item: list[list] = [[] for _ in items]
        for (fn, c, peer), k in zip(ops, owners, strict=True):
            per_item[k].append(fn(c, peer))
        return [self._request(works, self._on_done(ch, i))
                for works, (ch, i) in zip(per_item, items, strict=True)]

    def _on_done(self, ch, i):
        return None if ch.is_sender else (lambda: self.finish_recv(ch, i))

    def _request(self, works, on_done=None) -> Request:
        if self.poll_completion:
            return _PolledRequest(works, on_done)
        return _WorkRequest(self.waiter, works, on_done)

    # hooks for host staging (gloo on GPU); identity by default
    def prepare_many(self, items, ready=None) -> list:
        """The buffers to post for (channel, message) items. Stream-ordered backends (NCCL)
        need no host wait on `ready`: torch makes the communicator's stream wait for the
        current stream at every post."""
        if ready is not None and not self.stream_ordered:
            ready.wait()
        return [ch.buffers[i] for ch, i in items]

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
                "init_process_group_ms": getattr(self, "init_ms", None),
                "preconnect_ms": getattr(self, "preconnect_ms", None)}

    def close(self) -> None:
        if hasattr(self, "waiter"):
            self.waiter.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
