"""One NIXL prefill/decode pair over a fixed set of message buffers (kvbench.p2p.transports.nixl):
the memory behind the messages registered, agent metadata and descriptor lists swapped with
the peer over MPI, transfer requests prepared and posted, completion from notifications and
transfer states, and everything released on the way out, aborted or not."""

from __future__ import annotations

import re
import sys
import time
from collections import deque
from collections.abc import Sequence
from functools import partial

from kvbench.p2p.transports.base import (
    Channel,
    HeldPosts,
    Request,
    TimedParts,
    TransferTimeout,
    Transport,
    TransportError,
    cancel_pending,
    seen_by_both,
)

# MPI tags on the transport's private communicator, per channel id (see _tag)
_TAG_BASE, _TAG_SPAN = 1000, 4000
_SETUP, _SYNC, _MD = 0, 1, 2
_ANNOUNCE = 3  # the engine shape's request announcement (the profile key announce=mpi)

# unit states on the initiator
IDLE, PROC, _DONE = 0, 1, 2


def now() -> float:
    return time.perf_counter()


def _notif(cid: int, kind: str, h: int, u: int) -> bytes:
    return b"kvb%d:%s:%d:%d" % (cid, kind.encode(), h, u)


_NOTIF = re.compile(rb"^kvb(\d+):([a-z]):(\d+):(\d+)$")


def _dev(t) -> int:
    return t.device.index if t.is_cuda else 0


def _regions(buffers) -> list[tuple[int, int, int]]:
    """The allocations behind the messages (each storage once): what gets registered."""
    seen: dict[int, tuple[int, int, int]] = {}
    for b in buffers:
        st = b.untyped_storage()
        seen.setdefault(st.data_ptr(), (st.data_ptr(), st.nbytes(), _dev(b)))
    return sorted(seen.values())


class _Exchange:
    """Point-to-point object exchange with the peer over MPI, polled, never blocking forever."""

    def __init__(self, comm, peer: int, timeout_s: float):
        self.comm, self.peer, self.timeout_s = comm, peer, timeout_s
        self.sends: list = []

    def send(self, obj, tag: int) -> None:
        self.sends.append(self.comm.isend(obj, dest=self.peer, tag=tag))

    def try_recv(self, tag: int):
        """(True, obj) when the peer's message is there, else (False, None)."""
        if self.comm.iprobe(source=self.peer, tag=tag):
            return True, self.comm.recv(source=self.peer, tag=tag)
        return False, None

    def recv(self, tag: int, what: str):
        deadline = now() + self.timeout_s
        while True:
            ok, obj = self.try_recv(tag)
            if ok:
                return obj
            if now() > deadline:
                raise TransferTimeout(f"nixl: no {what} from rank {self.peer} before the --timeout")

    def swap(self, obj, tag: int, what: str):
        self.send(obj, tag)
        return self.recv(tag, what)

    def finish_sends(self) -> None:
        """Every object sent has left (polled: a stopped peer cannot hold this forever)."""
        from mpi4py import MPI

        deadline = now() + self.timeout_s
        while self.sends and not MPI.Request.Testall(self.sends):
            if now() > deadline:
                raise TransferTimeout(f"nixl: rank {self.peer} did not take this rank's "
                                      "set-up messages before the --timeout")
        self.sends.clear()
        self.sends = []

    def cancel_sends(self) -> None:
        cancel_pending(self.sends)
        self.sends = []


class _Req(Request):
    __slots__ = ("ch", "u", "h")

    def __init__(self, ch: NIXLChannel, u: int):
        self.ch, self.u, self.h = ch, u, ch.h

    def test(self) -> bool:
        ch = self.ch
        if self.h != ch.h:  # its handoff ended, and a handoff only ends once all is done
            return True
        if ch.done[self.u]:
            return True
        ch.held.release()
        ch.pump(from_test=True)
        if ch.initiator and ch.state[self.u] == PROC:
            ch.check(self.u)
        if not ch.done[self.u]:
            ch.idle(self.u)
        return ch.done[self.u]


def transfer_units(layer_of: Sequence[int], batch: str) -> list[list[int]]:
    """Messages grouped into transfer requests: one per message, one per layer (in layer
    order), or one for the whole handoff."""
    n = len(layer_of)
    if batch == "message":
        return [[i] for i in range(n)]
    if batch == "handoff":
        return [list(range(n))]
    by_layer: dict[int, list[int]] = {}
    for i, layer in enumerate(layer_of):
        by_layer.setdefault(layer, []).append(i)
    return [by_layer[k] for k in sorted(by_layer)]


def default_batch(granularity: str, patterns: str) -> str:
    """--nixl-batch when not given: per message for whole/layer messages; for per-block
    messages one request per handoff (what an engine posts for a finished request), or one
    per layer when a layerwise handoff is in the run (so a layer can leave once computed)."""
    if granularity != "block":
        return "message"
    return "layer" if "layerwise" in (patterns or "") else "handoff"


class NIXLChannel(TimedParts, Channel):
    """One prefill/decode pair over a fixed set of message buffers (see the module doc)."""

    def __init__(self, transport: Transport, peer: int, buffers: Sequence, is_sender: bool,
                 layer_of: Sequence[int] | None = None):
        super().__init__(transport, peer, buffers, is_sender, layer_of)
        t = transport
        self.t, self.agent = t, t.agent
        self.op, self.mode, self.prep, self.inject = t.op, t.mode, t.prep, t.inject
        self.OP = self.op.upper()
        self.initiator = is_sender == (self.op == "write")
        self.role = "prefill" if is_sender else "decode"
        self.mem = "VRAM" if any(b.is_cuda for b in self.buffers) else "DRAM"
        self.descs = [(b.data_ptr(), b.numel() * b.element_size(), _dev(b)) for b in self.buffers]
        self.regions = _regions(self.buffers)
        self.units = transfer_units(self.layer_of, t.batch)
        n = len(self.buffers)
        self.unit_of = [0] * n
        for u, idx in enumerate(self.units):
            for i in idx:
                self.unit_of[i] = u
        U = len(self.units)
        self.cid = t.next_channel_id(peer)
        self.xc = _Exchange(t.comm, peer, t.ctx.timeout_s)
        # resources (released by close on every path)
        self.reg = None
        self.local_dl = self.remote_dl = None
        self.xfers: list = [None] * U
        self.list_len = [0] * U  # entries of each request's transfer list (its descriptors)
        self.remote: str | None = None
        self.remote_descs = None
        self.closed = False
        # per-handoff state
        self.h = 0
        self.in_handoff = False
        self.done = [False] * U
        self.state = [IDLE] * U
        self.posted = [0] * U
        self.queue: deque[int] = deque()  # initiator: units to issue; read target: to announce
        self.held = HeldPosts()  # the sender's units whose bytes are not final yet
        self.got: set[tuple[str, int, int]] = set()
        self.hs_ready = True
        self.md_wait_t0: float | None = None
        self.n_done = 0
        self.t_first: float | None = None
        self.errors = 0
        self.cur: dict[str, float] = {}
        self.per: dict[str, list[float]] = {}
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- timing ------------------------------------------------------------

    def _tag(self, kind: int) -> int:
        return _TAG_BASE + (self.cid % _TAG_SPAN) * 4 + kind

    # -- set-up --------------------------------------------------------------

    def _setup(self) -> None:
        agent, t = self.agent, self.t
        if self.mode != "reregister":
            self._register()
        self.xc.swap(None, self._tag(_SYNC), "set-up sync")  # both registered: time md alone
        t0 = now()
        mine = {"cid": self.cid, "op": self.op, "role": self.role, "mem": self.mem,
                "sizes": [d[1] for d in self.descs], "md": agent.get_agent_metadata(),
                "descs": (None if self.initiator else
                          agent.get_serialized_descs(agent.get_xfer_descs(self.descs, self.mem)))}
        theirs = self.xc.swap(mine, self._tag(_SETUP), "NIXL metadata")
        problem = None
        if theirs["cid"] != self.cid or theirs["op"] != self.op or theirs["role"] == self.role:
            problem = (f"channel mismatch (here {self.role} channel {self.cid} {self.op}, peer "
                       f"{theirs['role']} channel {theirs['cid']} {theirs['op']})")
        elif theirs["sizes"] != mine["sizes"]:
            problem = f"message sizes differ ({len(mine['sizes'])} here, {len(theirs['sizes'])} there)"
        elif theirs["mem"] != self.mem:
            problem = f"memory types differ ({self.mem} here, {theirs['mem']} there)"
        if problem:
            raise seen_by_both(t.ctx.rank, self.peer, f"nixl: rank {self.peer}: {problem}")
        self.remote = t.load_remote(self.peer, theirs["md"])
        t.attach(self)
        if self.initiator:  # with --nixl-reregister only connection info: memory comes per handoff
            self._add("nixl_metadata_ms" if self.mode != "reregister" else "nixl_metadata_setup_ms",
                      (now() - t0) * 1e3)
            self.remote_descs = agent.deserialize_descs(theirs["descs"])
            if self.mode != "reregister":
                self._prep_dlists()
                if self.mode == "reuse":
                    for u in range(len(self.units)):
                        self._make(u)
        self._flush()

    def _register(self) -> None:
        t0 = now()
        self.reg = self.agent.register_memory([(a, n, d, "") for a, n, d in self.regions], self.mem)
        self._add(f"nixl_register_{self.role}_ms", (now() - t0) * 1e3)

    def _prep_dlists(self) -> None:
        if self.prep != "prepped":
            return
        t0 = now()
        self.local_dl = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.descs, self.mem)
        self.remote_dl = self.agent.prep_xfer_dlist(self.remote, self.remote_descs, self.mem)
        self._add("nixl_prep_dlist_ms", (now() - t0) * 1e3)

    def _make(self, u: int) -> None:
        agent, idx = self.agent, self.units[u]
        t0 = now()
        if self.prep == "prepped":
            h = agent.make_prepped_xfer(self.OP, self.local_dl, idx, self.remote_dl, idx, b"")
        else:
            local = agent.get_xfer_descs([self.descs[i] for i in idx], self.mem)
            remote = agent.get_xfer_descs([self.remote_descs[i] for i in idx], self.mem)
            h = agent.initialize_xfer(self.OP, local, remote, self.remote, b"")
        self.list_len[u] = len(idx)  # the request's transfer list: one entry per index
        self.xfers[u] = h
        self._add("nixl_make_xfer_ms", (now() - t0) * 1e3)
        if self.t.backend_used is None:
            try:
                self.t.backend_used = agent.query_xfer_backend(h)
            except Exception:  # noqa: BLE001 - unknown is an answer
                self.t.backend_used = "unknown"

    def _setup_step(self) -> bool:
        """Per-handoff set-up (--nixl-reregister); True once this side may transfer."""
        if self.reg is None:
            self._register()
            if not self.initiator:  # announce the new registration to the initiator
                self.xc.send((self.h, self.agent.get_partial_agent_metadata(self.reg, False)),
                             self._tag(_MD))
                self.hs_ready = True
                return True
            self.md_wait_t0 = now()
        ok, msg = self.xc.try_recv(self._tag(_MD))
        if not ok:
            return False
        h, md = msg
        if h != self.h:
            raise TransportError(f"nixl: metadata for handoff {h} arrived in handoff {self.h}")
        self.agent.add_remote_agent(md)
        self._add("nixl_metadata_ms", (now() - self.md_wait_t0) * 1e3)
        self._prep_dlists()
        self.hs_ready = True
        return True

    # -- the handoff -----------------------------------------------------------

    def begin_handoff(self) -> None:
        self.idle_before()
        self.h += 1
        self.in_handoff = True
        self.cur = {}
        U = len(self.units)
        self.done, self.state, self.posted = [False] * U, [IDLE] * U, [0] * U
        self.queue = deque()
        self.held.clear()
        self.n_done, self.t_first = 0, None
        self.hs_ready = self.mode != "reregister"
        early = sorted(k for k in self.got if k[1] == self.h)  # notifications that came early
        self.got = {k for k in self.got if k[1] > self.h}
        for kind, h, u in early:
            self.notify(kind, h, u)

    def idle_before(self) -> None:
        """Idle as an engine between requests (the profile key gap_ms; both sides, the start barrier
        follows): sleep the gap."""
        gap = self.t.gaps.next_s()
        if gap:
            time.sleep(gap)

    def post(self, i: int, ready=None) -> Request:
        u = self.unit_of[i]
        if self.is_sender:
            self.posted[u] += 1
            if self.posted[u] == len(self.units[u]) and self.inject != "stall":
                # The NIC reads the bytes as soon as the unit goes out (write: the WRITE is
                # issued; read: decode is told it may read), so it goes out once the producer's
                # event is done: polled here and in test(), never waited on, so the host goes
                # on queueing the next layer's compute meanwhile (HeldPosts).
                self.held.hold(ready, partial(self.queue.append, u))
            self.held.release()
            self.pump(from_test=False)
        return _Req(self, u)

    def pump(self, from_test: bool) -> None:
        """Drive this side's state machine; never blocks. The receiver does its per-handoff
        set-up only from test(), i.e. after the handoff's start barrier."""
        if not self.hs_ready and not (self.is_sender or from_test):
            return
        if not self.hs_ready and not self._setup_step():
            return
        if self.initiator:
            if self.op == "read":
                self.t.poll_notifs()
            while self.queue:
                self._issue(self.queue.popleft())
        elif self.op == "read":  # prefill announces what decode may read
            while self.queue:
                u = self.queue.popleft()
                self.agent.send_notif(self.remote, _notif(self.cid, "r", self.h, u))
            self.t.poll_notifs()
        else:
            self.t.poll_notifs()

    def idle(self, u: int) -> None:
        """Between two tests of an unfinished unit: nothing here (busy polling, as MPI's
        progress engines do); the engine-shaped channel waits as an engine does."""

    def _issue(self, u: int) -> None:
        agent = self.agent
        if self.mode != "reuse":
            self._make(u)
        if self.inject == "error" and self.h == 1:
            agent.remove_remote_agent(self.remote)  # the peer's metadata is gone: NIXL refuses
            self.t.forget_remote(self.peer)
        kind = "w" if self.op == "write" else "d"
        t0 = now()
        try:
            st = agent.transfer(self.xfers[u], _notif(self.cid, kind, self.h, u))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error classes
            self._failed(u, f"post failed: {type(exc).__name__}: {exc}")
        t1 = now()
        self.count_posted(self.list_len[u])
        self._add("nixl_post_ms", (t1 - t0) * 1e3)
        if self.t_first is None:
            self.t_first = t0
        self.state[u] = PROC
        if st == "DONE":
            self._unit_done(u, t1)
        elif st != "PROC":
            self._failed(u, f"post returned {st}")

    def check(self, u: int) -> None:
        try:
            st = self.agent.check_xfer_state(self.xfers[u])
        except Exception as exc:  # noqa: BLE001
            self._failed(u, f"{type(exc).__name__}: {exc}")
        if st == "DONE":
            self._unit_done(u, now())
        elif st != "PROC":
            self._failed(u, f"ended in {st}")

    def _failed(self, u: int, why: str):
        self.errors += 1
        self.t.errors += 1
        what = (f"message {self.units[u][0]}" if len(self.units[u]) == 1
                else f"messages {self.units[u][0]}..{self.units[u][-1]}")
        raise TransportError(f"nixl: {self.OP} of {what} (handoff {self.h}) {why}; "
                             f"{self.errors} failed transfer(s) on this channel, "
                             f"{self.n_done} of {len(self.units)} done")

    def _unit_done(self, u: int, t: float) -> None:
        self.state[u] = _DONE
        self.done[u] = True
        self.n_done += 1
        if self.n_done == len(self.units):
            self._add("nixl_transfer_ms", (t - self.t_first) * 1e3)

    def notify(self, kind: str, h: int, u: int) -> None:
        """A notification for this channel (from the transport's dispatcher)."""
        if h < self.h or not 0 <= u < len(self.units):
            self.t.stale += 1
            return
        if h > self.h or not self.in_handoff:
            self.got.add((kind, h, u))
            return
        if kind == "r" and self.initiator:
            self.queue.append(u)
        elif kind == ("w" if self.op == "write" else "d") and not self.initiator:
            self.done[u] = True

    def end_handoff(self) -> None:
        if self.mode != "reuse":
            t0 = now()
            self._release_xfers()
            self._add("nixl_release_ms", (now() - t0) * 1e3)
        if self.mode == "reregister":
            self._release_dlists()
            t0 = now()
            self.agent.deregister_memory(self.reg)
            self.reg = None
            self._add(f"nixl_deregister_{self.role}_ms", (now() - t0) * 1e3)
        self.xc.finish_sends()
        self._flush()
        self.in_handoff = False

    # -- tear-down -------------------------------------------------------------

    def _release_xfers(self) -> int:
        failed = 0
        for u, h in enumerate(self.xfers):
            if h is None:
                continue
            try:
                h.release()
            except Exception:  # noqa: BLE001 - NIXL could not cancel it; agent teardown will
                failed += 1
            self.xfers[u] = None
        return failed

    def _release_dlists(self) -> None:
        for dl in (self.local_dl, self.remote_dl):
            if dl is not None:
                try:
                    dl.release()
                except Exception:  # noqa: BLE001
                    pass
        self.local_dl = self.remote_dl = None

    def close(self) -> None:
        """Release transfer requests, prepared lists, registrations and the remote agent.
        Local calls only (no MPI): safe on every path, including after a timeout."""
        if self.closed:
            return
        self.closed = True
        aborted = self.in_handoff
        in_flight = sum(1 for s in self.state if s == PROC) if aborted else 0
        handles = sum(1 for h in self.xfers if h is not None)
        failed = self._release_xfers()
        self._release_dlists()
        regs = 0
        if self.reg is not None:
            try:
                self.agent.deregister_memory(self.reg)
                regs = len(self.regions)
            except Exception:  # noqa: BLE001
                failed += 1
            self.reg = None
        self.xc.cancel_sends()
        self.t.detach(self)
        if self.remote is not None:
            self.t.release_remote(self.peer)
        if aborted:
            print(f"kvbench nixl: rank {self.t.ctx.rank}: handoff {self.h} aborted; released "
                  f"{handles - failed} of {handles} transfer request(s) ({in_flight} in flight), "
                  f"{regs} registration(s), remote agent {self.remote}", file=sys.stderr, flush=True)


# channel class per shape (link; engine with --nixl-engine-profile); the engine shape's
# module adds itself (importing the kvbench.p2p.transports.nixl package imports it)
CHANNELS: dict[str, type] = {"link": NIXLChannel}
