"""NIXL with its UCX backend: the KV-transfer path of current disaggregated serving stacks.

One NIXL agent per rank. A channel registers the memory behind its messages (the KV's
backing allocations, as an engine registers its cache tensors), exchanges agent metadata
and serialized descriptor lists with its peer over MPI (no etcd, no listener thread), and
prepares one descriptor per message: per layer tensor, per paged block, or one for the
whole KV, following the message plan.

    --nixl-op write  prefill (initiator) WRITEs into decode's registered buffers; decode
                     learns completion from the notification NIXL sends after the data.
    --nixl-op read   prefill announces each ready message with a notification; decode
                     (initiator) READs it; prefill learns completion from the READ's
                     notification, decode from its own transfer state.

Modes: reuse everything (default: registrations, prepared lists and transfer requests made
once per channel, reposted every handoff), --nixl-recreate (a new transfer request per
handoff), --nixl-reregister (register, exchange metadata, prepare and create per handoff,
deregister after it). The per-handoff costs of the last two sit inside the timed handoff.

Set-up and per-handoff costs come out of `breakdown()` (see docs/nixl.md). `info()` records
the UCX variables in force and the protocols UCX itself reports it selected (UCX_PROTO_INFO,
read from a private log file unless the user set UCX_PROTO_INFO or UCX_LOG_FILE).

`nixl` is imported lazily, so the registry works without the package.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import time
from collections import deque
from collections.abc import Sequence

from kvbench.cli import arg_float, arg_int
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import (
    Channel,
    Request,
    TransferTimeout,
    Transport,
    TransportError,
    seen_by_both,
)
from kvbench.p2p.transports.nixl_import import (  # noqa: F401
    INSTALL_HINT,
    MAX_NIXL_THREADS,
    MAX_PROGRESS_DELAY_US,
    _version,
    agent_with_progress_delay,
    import_nixl,
)
from kvbench.p2p.transports.ucx_info import (  # noqa: F401  (parse_ucx_proto_info for users)
    _flush_c_stdio,
    _ucx_probe,
    _ucx_version,
    parse_ucx_proto_info,
    path_category,
    peer_rows,
    read_complete_lines,
    summarize_path,
)

# MPI tags on the transport's private communicator, per channel id (see _tag)
_TAG_BASE, _TAG_SPAN = 1000, 4000
_SETUP, _SYNC, _MD = 0, 1, 2
_ANNOUNCE = 3  # the engine shape's request announcement (--nixl-announce mpi)

# unit states on the initiator
_IDLE, _PROC, _DONE = 0, 1, 2


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
        for r in self.sends:
            try:
                if not r.Test():
                    r.Cancel()
            except Exception:  # noqa: BLE001 - best effort on the abort path
                pass
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
        ch.pump(from_test=True)
        if ch.initiator and ch.state[self.u] == _PROC:
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


class NIXLChannel(Channel):
    """One prefill/decode pair over a fixed set of message buffers (see the module doc)."""

    def __init__(self, transport: NIXLTransport, peer: int, buffers: Sequence, is_sender: bool,
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
        self.state = [_IDLE] * U
        self.posted = [0] * U
        self.queue: deque[int] = deque()  # initiator: units to issue; read target: to announce
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

    def _add(self, name: str, ms: float) -> None:
        """Add to the current figure: this handoff's, or the channel set-up's (one-off)."""
        self.cur[name] = self.cur.get(name, 0.0) + ms

    def _flush(self) -> None:
        """One entry per figure: per handoff, or a one-element list for the set-up."""
        for k, v in self.cur.items():
            self.per.setdefault(k, []).append(v)
        self.cur = {}

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
        self.done, self.state, self.posted = [False] * U, [_IDLE] * U, [0] * U
        self.queue = deque()
        self.n_done, self.t_first = 0, None
        self.hs_ready = self.mode != "reregister"
        early = sorted(k for k in self.got if k[1] == self.h)  # notifications that came early
        self.got = {k for k in self.got if k[1] > self.h}
        for kind, h, u in early:
            self.notify(kind, h, u)

    def idle_before(self) -> None:
        """Idle as an engine between requests (--nixl-gap-ms; both sides, the start barrier
        follows): sleep the gap."""
        gap = self.t.gaps.next_s()
        if gap:
            time.sleep(gap)

    def post(self, i: int, ready=None) -> Request:
        u = self.unit_of[i]
        if self.is_sender:
            self.posted[u] += 1
            if self.posted[u] == len(self.units[u]):
                # The NIC reads the bytes as soon as the unit goes out: wait for the producer
                # first. One event covers every message of a step, so this blocks at most once
                # per step (handoff or layer), never once per post, and never on the stream.
                if ready is not None:
                    ready.wait()
                if self.inject != "stall":
                    self.queue.append(u)  # write: issue the WRITE; read: announce 'ready'
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
        self.state[u] = _PROC
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

    def breakdown(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self.per.items()}

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
        in_flight = sum(1 for s in self.state if s == _PROC) if aborted else 0
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


# channel class per --nixl-shape; the engine shape's module registers itself (the transport
# registry imports every module of this package before a transport is used)
CHANNELS: dict[str, type] = {"link": NIXLChannel}


@register
class NIXLTransport(Transport):
    name = "nixl"
    description = "NIXL agents, UCX backend: one-sided WRITE/READ + notifications (metadata over MPI)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("nixl transport (--transport nixl)")
        g.add_argument("--nixl-op", choices=("write", "read"), default=None,
                       help="write: prefill pushes into decode's registered buffers; read: decode "
                            "pulls from prefill's (default write; read with --nixl-shape engine)")
        g.add_argument("--nixl-recreate", action="store_true",
                       help="create a new transfer request every handoff (timed) instead of reposting")
        g.add_argument("--nixl-reregister", action="store_true",
                       help="register, exchange metadata, prepare and create per handoff (timed), "
                            "deregister after it")
        g.add_argument("--nixl-prep", choices=("prepped", "initialize"), default="prepped",
                       help="prep_xfer_dlist + make_prepped_xfer (default), or initialize_xfer")
        g.add_argument("--nixl-batch", choices=("message", "layer", "handoff"), default=None,
                       help="one transfer request per message, per layer, or one for the whole "
                            "handoff over every message's descriptor (posted with the last "
                            "message). Default: message for --granularity whole/layer; for "
                            "block, handoff (layer when a layerwise pattern is in the run)")
        g.add_argument("--nixl-progress-thread", action=argparse.BooleanOptionalAction, default=True,
                       help="NIXL's own progress thread (NIXL's default, on); without it progress "
                            "comes only from polling, which is faster when cores are scarce")
        e = parser.add_argument_group(
            "nixl engine-shaped handoff (--nixl-shape engine; docs/nixl.md)")
        e.add_argument("--nixl-shape", choices=("link", "engine"), default="link",
                       help="link (default): the message plan moved as fast as NIXL allows, "
                            "busy-polled; engine: vLLM 0.32's pull connector: per-layer regions, "
                            "one descriptor per block, region-major ids, a prepped READ per request "
                            "with the notification on it, completion polled per engine step, "
                            "NIXL telemetry per handoff (needs --layout paged --granularity block)")
        e.add_argument("--nixl-per-request", action=argparse.BooleanOptionalAction, default=True,
                       help="engine shape: make_prepped_xfer + post + release per handoff (default "
                            "on); off: one handle made once and reposted")
        e.add_argument("--nixl-poll", default=None, metavar="WHEN",
                       help="completion polling: busy, fixed:MS (an idle engine steps about every "
                            "1 ms) or draw:FILE (step times drawn from a JSON list in ms or a "
                            "cumulative histogram {le_ms, count}); default busy, fixed:1 with "
                            "--nixl-shape engine")
        e.add_argument("--nixl-waits", choices=("sleep", "yield", "spin", "engine"), default=None,
                       help="engine shape: how its threads wait between looks at NIXL and in "
                            "the harness's own waits: sleep (default), yield (sched_yield "
                            "spinning), spin (the link harness's busy loop), or engine (what "
                            "vLLM 0.32's worker does: yield-spin for --nixl-spin-window-ms "
                            "after its last work, sleep after that; the gap before a handoff "
                            "is waited the same way; docs/nixl.md)")
        e.add_argument("--nixl-announce", choices=("mpi", "nixl"), default=None,
                       help="engine shape: how prefill tells decode a request is ready: mpi "
                            "(default: outside NIXL, as vLLM's proxy and engine core do) or a "
                            "NIXL notification (the link shape's way; its arrival is handled by "
                            "NIXL's progress thread right before the post)")
        e.add_argument("--nixl-spin-window-ms", type=arg_float(0, 60_000), default=None,
                       metavar="MS",
                       help="--nixl-waits engine: how long a thread yield-spins after its last "
                            "work before it sleeps (default 1000, vLLM 0.32's busy_loop_s)")
        e.add_argument("--nixl-threads", type=arg_int(0, MAX_NIXL_THREADS), default=None, metavar="N",
                       help="UCX worker threads of the agent (nixl_agent_config num_threads; "
                            f"0..{MAX_NIXL_THREADS}; default 0, 4 with --nixl-shape engine as vLLM sets)")
        e.add_argument("--nixl-telemetry", action=argparse.BooleanOptionalAction, default=None,
                       help="NIXL's per-transfer telemetry (capture_telemetry; default off, on "
                            "with --nixl-shape engine, which records postDuration/xferDuration)")
        e.add_argument("--nixl-progress-delay-us", type=arg_int(0, MAX_PROGRESS_DELAY_US), default=0,
                       metavar="US",
                       help="the progress thread's delay between polls (NIXL's Python agent fixes "
                            "0: it spins; the lab's vLLM runs with 1000, kvbench.lab.venv.connector; "
                            f"at most {MAX_PROGRESS_DELAY_US:,})")
        e.add_argument("--nixl-gap-ms", type=arg_float(0, 60_000), default=0.0, metavar="MS",
                       help="idle time before each handoff, outside the timed window (an engine "
                            "at R requests/s moves a request's KV about every 1000/R ms, and "
                            "its progress thread idles in between; default 0: back to back; "
                            "not counted in --seconds-per-point)")
        e.add_argument("--nixl-gaps", choices=("fixed", "exp"), default="fixed",
                       help="engine shape: every gap --nixl-gap-ms long (fixed, default), or "
                            "drawn exponentially with that mean (exp: the gaps of Poisson "
                            "arrivals, as the lab's `vllm bench serve` sends requests), seeded "
                            "by --nixl-gap-seed; the drawn gaps are in the record")
        e.add_argument("--nixl-busy-ms", type=arg_float(0, 60_000), default=0.0, metavar="MS",
                       help="engine shape with --nixl-gap-ms: decode works this long after each "
                            "handoff (decoding the request: its core busy, no yield), inside the "
                            "gap; a shorter gap makes the next post follow that work (default 0)")
        e.add_argument("--nixl-gap-seed", type=arg_int(0, 2**31 - 1), default=0, metavar="N",
                       help="--nixl-gaps exp: the generator's seed (default 0; every rank draws "
                            "the same gaps)")
        e.add_argument("--debug-region-order", choices=("natural", "reversed"), default="natural",
                       help=argparse.SUPPRESS)
        g.add_argument("--nixl-inject", choices=("none", "stall", "error"), default="none",
                       help="test hook: stall (prefill never posts/announces) or error (the "
                            "initiator drops the peer's metadata before its first post)")

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        _mod, why = import_nixl()
        return why

    def open(self) -> None:
        mod, why = import_nixl()
        if mod is None:
            raise TransportError(why)
        self.nixl = mod
        if not os.environ.get("NIXL_LOG_LEVEL"):  # its INFO lines would land in our stdout table
            logging.getLogger("nixl").setLevel(logging.WARNING)
        o = self.ctx.options
        self.shape = getattr(o, "nixl_shape", "link")
        engine = self.shape == "engine"
        self.op = o.nixl_op or ("read" if engine else "write")
        self.mode = "reregister" if o.nixl_reregister else "recreate" if o.nixl_recreate else "reuse"
        self.prep, self.inject = o.nixl_prep, o.nixl_inject
        self.batch = "handoff" if engine else (
            o.nixl_batch or default_batch(getattr(o, "granularity", "whole"),
                                          getattr(o, "pattern", "")))
        self.progress_thread = o.nixl_progress_thread
        self.threads = o.nixl_threads if o.nixl_threads is not None else (4 if engine else 0)
        self.telemetry = o.nixl_telemetry if o.nixl_telemetry is not None else engine
        self.poll_text = o.nixl_poll or ("fixed:1" if engine else "busy")
        from kvbench.p2p.engine_shape import ENGINE_SPIN_WINDOW_MS, Gaps, Waits

        window = getattr(o, "nixl_spin_window_ms", None)
        self.waits = Waits(getattr(o, "nixl_waits", None) or ("sleep" if engine else "spin"),
                           ENGINE_SPIN_WINDOW_MS if window is None else window)
        if self.waits.mode != "spin":  # the harness's own waits (barrier, notice) wait the same way
            self.between_tests = self.waits.pause
        self.per_request, self.region_order = o.nixl_per_request, o.debug_region_order
        self.uses_regions = engine
        self.announce = getattr(o, "nixl_announce", None) or ("mpi" if engine else "nixl")
        self.progress_delay_us = o.nixl_progress_delay_us
        self.gaps = Gaps(getattr(o, "nixl_gap_ms", 0.0), getattr(o, "nixl_gaps", "fixed"),
                         getattr(o, "nixl_gap_seed", 0))
        self.busy_s = getattr(o, "nixl_busy_ms", 0.0) / 1e3
        if engine:  # vLLM sets this one UCX variable, if unset, before NIXL starts
            os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
        # On GPU the harness has already bound this rank to its local GPU (kvbench.p2p.gpu_select).
        self.comm = self.ctx.comm.Dup()
        self.ucx_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
        self.errors = self.stale = 0
        self.backend_used: str | None = None
        self._remotes: dict[int, list] = {}  # peer rank -> [agent name, channels using it]
        self._channels: dict[tuple[str, int], NIXLChannel] = {}
        self._orphans: list[tuple[str, bytes]] = []
        self._seq: dict[int, int] = {}
        # Ask UCX which protocols it selects, into a private log we parse (if the user has not
        # asked for UCX logging themselves). UCX reads these when the backend is created.
        self.ucx_log = _ucx_probe()
        self.ucx_log_offset = 0
        self._noted_at: int | None = None  # note_peer's place in the UCX log
        self._peer_rows: dict[int, list[dict]] = {}
        probe = {}
        if self.ucx_log is not None:
            _flush_c_stdio()
            self.ucx_log_offset = self.ucx_log.stat().st_size if self.ucx_log.exists() else 0
            probe = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(self.ucx_log)}
        saved = {k: os.environ.get(k) for k in probe}
        os.environ.update(probe)
        self.agent_name = f"kvbench-{socket.gethostname()}-{os.getpid()}-r{self.ctx.rank}-{id(self):x}"
        t0 = now()
        try:
            cfg = mod.nixl_agent_config(enable_prog_thread=self.progress_thread, backends=["UCX"],
                                        num_threads=self.threads,
                                        capture_telemetry=self.telemetry)
            self.agent = agent_with_progress_delay(mod, self.agent_name, cfg, self.progress_delay_us)
        except Exception as exc:  # noqa: BLE001
            raise TransportError(f"nixl: could not create the NIXL agent: {exc}") from None
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.agent_ms = (now() - t0) * 1e3
        if "UCX" not in self.agent.backends:
            raise TransportError("nixl: the UCX backend plugin is missing from this NIXL install "
                                 f"(plugins: {', '.join(self.agent.get_plugin_list()) or 'none'})")

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None,
                regions=None, blocks=None) -> Channel:
        if self.shape == "engine":  # kvbench.p2p.transports.nixl_engine adds itself here
            return CHANNELS["engine"](self, peer, buffers, is_sender, layer_of, regions, blocks)
        return NIXLChannel(self, peer, buffers, is_sender, layer_of)

    def record_fields(self) -> dict:
        out = {"nixl_op": self.op, "nixl_mode": self.mode, "nixl_prep": self.prep,
               "nixl_batch": self.batch, "nixl_progress_thread": self.progress_thread}
        if self.threads or self.telemetry or self.poll_text != "busy":
            out.update(nixl_threads=self.threads, nixl_telemetry=self.telemetry,
                       nixl_poll=self._poll_label())
        if self.progress_delay_us:
            out["nixl_progress_delay_us"] = self.progress_delay_us
        out.update(self.gaps.label())
        if self.busy_s:
            out["nixl_busy_ms"] = round(self.busy_s * 1e3, 6)
        if self.shape == "engine":  # (K/V pages and block ids are the cut's: kvbench.p2p.cut)
            out.update(nixl_shape="engine",
                       nixl_per_request=self.per_request,
                       nixl_mode="per-request" if self.per_request else "reuse",
                       nixl_announce=self.announce, **self.waits.label())
            if self.region_order != "natural":
                out["nixl_region_order"] = self.region_order
        return out

    def _poll_label(self) -> str:
        from kvbench.p2p.engine_shape import PollSchedule

        return PollSchedule(self.poll_text).label()

    def spec_options(self) -> dict:
        """Link runs keep the keys they always had (their spec ids stay); the engine shape and
        the agent's non-default threads, telemetry or polling add theirs."""
        return {k.removeprefix("nixl_"): v for k, v in self.record_fields().items()}

    # -- per-peer remote agents and notification dispatch ---------------------

    def next_channel_id(self, peer: int) -> int:
        self._seq[peer] = self._seq.get(peer, 0) + 1
        return self._seq[peer]

    def load_remote(self, peer: int, md: bytes) -> str:
        """Load (or refresh, with new registrations) the peer's agent; counted per channel."""
        name = self.agent.add_remote_agent(md)
        name = name.decode() if isinstance(name, bytes) else str(name)
        entry = self._remotes.setdefault(peer, [name, 0])
        entry[0] = name
        entry[1] += 1
        return name

    def forget_remote(self, peer: int) -> None:
        self._remotes.pop(peer, None)

    def release_remote(self, peer: int) -> None:
        entry = self._remotes.get(peer)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._remotes[peer]
            try:
                self.agent.remove_remote_agent(entry[0])
            except Exception:  # noqa: BLE001 - already gone
                pass

    def attach(self, ch: NIXLChannel) -> None:
        self._channels[(ch.remote, ch.cid)] = ch
        orphans, self._orphans = self._orphans, []
        for agent_name, msg in orphans:
            self._dispatch(agent_name, msg)

    def detach(self, ch: NIXLChannel) -> None:
        if self._channels.get((ch.remote, ch.cid)) is ch:
            del self._channels[(ch.remote, ch.cid)]

    def poll_notifs(self) -> None:
        for agent_name, msgs in self.agent.get_new_notifs().items():
            for msg in msgs:
                self._dispatch(agent_name, msg)

    def _dispatch(self, agent_name, msg: bytes) -> None:
        agent_name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
        m = _NOTIF.match(bytes(msg))
        if not m:
            self.stale += 1
            return
        cid, kind, h, u = int(m[1]), m[2].decode(), int(m[3]), int(m[4])
        ch = self._channels.get((agent_name, cid))
        if ch is None:
            self._orphans.append((agent_name, msg))
            return
        ch.notify(kind, h, u)

    # -- what carried the data ----------------------------------------------------

    def _local_protocols(self) -> list[dict]:
        """This rank's UCX protocol rows for the peer endpoints, since this transport opened."""
        if not self.ucx_log or not self.ucx_log.exists():
            return []
        _flush_c_stdio()
        with open(self.ucx_log, "rb") as f:
            f.seek(self.ucx_log_offset)
            text = f.read().decode(errors="replace")
        return [r for r in parse_ucx_proto_info(text) if path_category(r)]

    def note_peer(self, peer: int) -> None:
        """The UCX tables printed since the last note are this rank's endpoint to `peer`."""
        if not self.ucx_log:
            return
        if self._noted_at is None:
            self._noted_at = self.ucx_log_offset
        text, self._noted_at = read_complete_lines(self.ucx_log, self._noted_at)
        rows = [r for r in parse_ucx_proto_info(text) if path_category(r)]
        self._peer_rows.setdefault(peer, []).extend(rows)

    def info_by_pair(self, info: dict, pairs) -> dict:
        """Per pair, the protocols of the initiator's endpoint to the other rank (the sender's
        with --nixl-op write, the receiver's with read), as noted by `note_peer`. Collective."""
        every = self.comm.allgather((self._peer_rows, self._local_protocols()))
        out = {}
        for src, dst in pairs:
            me, peer = (src, dst) if self.op == "write" else (dst, src)
            noted, all_rows = every[me]
            rows, how = peer_rows(noted.get(peer, []), all_rows, self.op)
            path = summarize_path(rows, self.op) or f"unknown ({how})"
            out[(src, dst)] = {**info, "path": f"UCX {path}", "path_source":
                               f"rank {me}'s endpoint to rank {peer}: {how}",
                               "ucx_protocols": [dict(r, rank=me) for r in rows]}
        return out

    def info(self) -> dict:
        """Collective over the world (p2p calls it on every rank): gathers every rank's UCX
        protocol selection, since in read mode the decode rank is the one moving the data."""
        mine = (self._local_protocols(), self.backend_used, self.errors, self.stale)
        every = self.comm.allgather(mine)
        flat = [dict(r, rank=rank) for rank, got in enumerate(every) for r in got[0]]
        path = summarize_path(flat, self.op)
        if path is None:
            path = ("unknown (UCX_PROTO_INFO / UCX_LOG_FILE set by the user: see the job log)"
                    if not self.ucx_log else "unknown (UCX reported no protocol selection)")
        return {
            "backend": "UCX",
            "backend_used": next((got[1] for got in every if got[1]), None),
            "nixl_module": self.nixl.__kvbench_name__,
            "nixl_version": _version(self.nixl.__kvbench_name__),
            "ucx_version": _ucx_version(self.nixl),
            "ucx_env": self.ucx_env,
            "path": f"UCX {path}",
            "ucx_protocols": flat,
            "agent_create_ms": self.agent_ms,
            **self.record_fields(),
            "failed_transfers": sum(got[2] for got in every),
            "stale_notifications": sum(got[3] for got in every),
        }

    def close(self) -> None:
        for peer in list(self._remotes):
            self._remotes[peer][1] = 0
            self.release_remote(peer)
        self._channels.clear()
        self.agent = None  # the agent's destructor tears down UCX
        self.comm.Free()
