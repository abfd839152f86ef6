"""`--transport mooncake`: the handoff on Mooncake's Transfer Engine (kvbench.p2p.transports.mooncake).

One TransferEngine per rank, started with the P2P handshake (no etcd: each engine listens on
its own RPC port and peers exchange segment descriptors on first contact). A channel
registers the memory behind its messages once, swaps (session, addresses) with its peer over
MPI, and per handoff hands the engine one batch of (source, target, length) entries per
transfer unit (the whole handoff by default for per-block messages: what SGLang's Mooncake
backend submits for a request's pages). Completion comes from the engine's own batch
completion (`get_batch_transfer_status`); the side that did not initiate learns it from a
done notice sent over MPI after the batch completed, and with READ the initiator (decode)
learns that prefill's bytes are ready from a readiness notice over MPI, as SGLang's
bootstrap does over ZMQ.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Sequence

from kvbench.cli import arg_int
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import (
    Channel,
    PeerReported,
    Reported,
    Request,
    TimedParts,
    TransferTimeout,
    Transport,
    TransportError,
    cancel_pending,
    seen_by_both,
)
from kvbench.p2p.transports.mooncake import libs

_TAG_BASE = 7000
_SETUP, _READY, _DONE = 0, 1, 2


DEFAULT_SEGMENT = "1G"  # --store-segment when not given: what each rank mounts into the store


def rdma_devices(topology) -> set[str] | None:
    """The RDMA devices in the engine's topology (JSON: location -> [preferred, available]
    device lists); None where it cannot be read (then nothing is concluded from it)."""
    import json

    try:
        doc = json.loads(topology) if isinstance(topology, str) else topology
        return {str(d) for lists in doc.values() for devs in lists for d in devs}
    except (TypeError, ValueError, AttributeError):
        return None


def now() -> float:
    return time.perf_counter()


def transfer_units(layer_of: Sequence[int], batch: str) -> list[list[int]]:
    """Messages grouped into batches: one per message, one per layer (in layer order), or
    one for the whole handoff."""
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
    """Per message for whole/layer messages; per-block messages: one batch per handoff, or
    per layer where a layerwise handoff is in the run (a layer leaves once computed)."""
    if granularity != "block":
        return "message"
    return "layer" if "layerwise" in (patterns or "") else "handoff"


def _regions(buffers) -> list[tuple[int, int]]:
    """(address, bytes) of each allocation behind the messages, once: what gets registered."""
    seen: dict[int, int] = {}
    for b in buffers:
        st = b.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    return sorted(seen.items())


class _Req(Request):
    __slots__ = ("ch", "u", "h")

    def __init__(self, ch: MooncakeChannel, u: int):
        self.ch, self.u, self.h = ch, u, ch.h

    def test(self) -> bool:
        ch = self.ch
        if self.h != ch.h or ch.done[self.u]:
            return True
        ch.pump(wait=True)
        return ch.done[self.u]


class MooncakeChannel(TimedParts, Channel):
    """One prefill/decode pair over a fixed set of message buffers (see the module doc)."""

    def __init__(self, transport: MooncakeTransport, peer: int, buffers: Sequence,
                 is_sender: bool, layer_of: Sequence[int] | None = None):
        super().__init__(transport, peer, buffers, is_sender, layer_of)
        t = self.t = transport
        self.op = t.op
        self.initiator = is_sender == (self.op == "write")
        self.role = "prefill" if is_sender else "decode"
        self.addrs = [b.data_ptr() for b in self.buffers]
        self.lens = [b.numel() * b.element_size() for b in self.buffers]
        self.regions = _regions(self.buffers)
        self.units = transfer_units(self.layer_of, t.batch)
        self.unit_of = [0] * len(self.buffers)
        for u, idx in enumerate(self.units):
            for i in idx:
                self.unit_of[i] = u
        self.cid = t.next_channel_id(peer)
        self.registered: list[int] = []
        self.remote_session = ""
        self.remote_addrs: list[int] = []
        self.sends: list = []
        self.closed = False
        self.h, self.in_handoff = 0, False
        self.done: list[bool] = []
        self.cur: dict[str, float] = {}
        self.per: dict[str, list[float]] = {}
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- timing ---------------------------------------------------------------

    def _tag(self, kind: int) -> int:
        return _TAG_BASE + (self.cid % 1000) * 4 + kind

    # -- set-up ---------------------------------------------------------------

    def _setup(self) -> None:
        t = self.t
        t0 = now()
        for addr, n in self.regions:
            rc = t.engine.register_memory(addr, n)
            if rc != 0:
                raise TransportError(f"mooncake: register_memory of {n:,} bytes returned {rc}")
            self.registered.append(addr)
        self._add(f"mooncake_register_{self.role}_ms", (now() - t0) * 1e3)
        mine = {"cid": self.cid, "op": self.op, "role": self.role, "session": t.session,
                "lens": self.lens, "addrs": self.addrs}
        t0 = now()
        theirs = self._swap(mine, "set-up")
        problem = None
        if theirs["cid"] != self.cid or theirs["op"] != self.op or theirs["role"] == self.role:
            problem = (f"channel mismatch (here {self.role} channel {self.cid} {self.op}, peer "
                       f"{theirs['role']} channel {theirs['cid']} {theirs['op']})")
        elif theirs["lens"] != self.lens:
            problem = f"message sizes differ ({len(self.lens)} here, {len(theirs['lens'])} there)"
        if problem:
            raise seen_by_both(t.ctx.rank, self.peer, f"mooncake: rank {self.peer}: {problem}")
        self.remote_session, self.remote_addrs = theirs["session"], theirs["addrs"]
        self._add("mooncake_exchange_ms", (now() - t0) * 1e3)
        self._flush()

    def _swap(self, obj, what: str):
        comm = self.t.comm
        self.sends.append(comm.isend(obj, dest=self.peer, tag=self._tag(_SETUP)))
        deadline = now() + self.t.ctx.timeout_s
        while not comm.iprobe(source=self.peer, tag=self._tag(_SETUP)):
            if now() > deadline:
                raise TransferTimeout(f"mooncake: no {what} message from rank {self.peer} "
                                      "before the --timeout")
        return comm.recv(source=self.peer, tag=self._tag(_SETUP))

    # -- the handoff ------------------------------------------------------------

    def begin_handoff(self) -> None:
        self.h += 1
        self.in_handoff = True
        self.cur = {}
        U = len(self.units)
        self.done, self.posted = [False] * U, [0] * U
        self.left = [0] * U  # chunks of each unit not yet complete
        self.chunks: deque[tuple[int, int, int]] = deque()  # (unit, lo, hi) to submit
        self.fly: list[tuple[int, int, int]] = []  # (unit, batch id, entries) submitted
        self.fly_entries = 0
        self.n_done, self.t_first = 0, None

    def post(self, i: int, ready=None) -> Request:
        u = self.unit_of[i]
        if self.is_sender:
            self.posted[u] += 1
            if self.posted[u] == len(self.units[u]) and self.t.inject != "stall":
                if ready is not None:
                    ready.wait()  # the engine reads the bytes as soon as the batch goes out
                if self.initiator:
                    self._enqueue(u)
                else:  # READ: tell decode this unit's bytes are final
                    self._notice(_READY, u)
        self.pump()
        return _Req(self, u)

    def _enqueue(self, u: int) -> None:
        """The unit's entries, in chunks of at most --mooncake-max-batch, to submit."""
        n, step = len(self.units[u]), self.t.max_batch
        for lo in range(0, n, step):
            self.chunks.append((u, lo, min(n, lo + step)))
            self.left[u] += 1
        self.count_posted(n)  # the (source, target, length) entries handed to the engine

    def _notice(self, kind: int, u: int) -> None:
        self.sends.append(self.t.comm.isend((self.h, u), dest=self.peer, tag=self._tag(kind)))

    def _take_notices(self, kind: int) -> None:
        comm, tag = self.t.comm, self._tag(kind)
        while comm.iprobe(source=self.peer, tag=tag):
            h, u = comm.recv(source=self.peer, tag=tag)
            if h != self.h:
                raise TransportError(f"mooncake: rank {self.peer}'s notice for handoff {h} "
                                     f"arrived in handoff {self.h}")
            if kind == _READY:
                self._enqueue(u)
            else:
                self.done[u] = True

    def pump(self, wait: bool = False) -> None:
        """Drive this side. The initiator keeps at most --mooncake-inflight entries submitted
        and not complete (the TCP transport fails, rather than queues, a transfer past its
        per-peer queue of 1,024); with `wait` (from test(), never from post) it waits for
        what is in flight through the engine's batch completion."""
        if not self.initiator:
            self._take_notices(_DONE)
            return
        if self.op == "read":
            self._take_notices(_READY)
        cap = self.t.inflight
        while self.chunks and (not self.fly or self.fly_entries + self._size(0) <= cap):
            self._submit(*self.chunks.popleft())
        if wait and self.fly:
            self._complete()

    def _size(self, k: int) -> int:
        _, lo, hi = self.chunks[k]
        return hi - lo

    def _submit(self, u: int, lo: int, hi: int) -> None:
        t, idx = self.t, self.units[u][lo:hi]
        local = [self.addrs[i] for i in idx]
        remote = [self.remote_addrs[i] for i in idx]
        lens = [self.lens[i] for i in idx]
        t0 = now()
        if self.t_first is None:
            self.t_first = t0
        bid = t.engine.batch_transfer_async(self.remote_session, local, remote, lens, t.opcode)
        self._add("mooncake_submit_ms", (now() - t0) * 1e3)
        if not isinstance(bid, int) or bid <= 0:
            self._failed(u, f"batch_transfer_async returned {bid}")
        self.fly.append((u, bid, hi - lo))
        self.fly_entries += hi - lo

    def _complete(self) -> None:
        """Wait for every submitted batch with `get_batch_transfer_status` (the engine's
        completion over all entries, bounded by MC_TRANSFER_TIMEOUT, set from --timeout).
        Not `transfer_check_status`: in this binding it reports a batch's first entry only,
        so a multi-entry batch reads as done while its other entries are still moving."""
        ids = [bid for _, bid, _ in self.fly]
        rc = self.t.engine.get_batch_transfer_status(ids)
        if rc != 0:
            raise TransferTimeout(
                f"mooncake: {self.op.upper()} to rank {self.peer} ({self.remote_session}) did "
                f"not complete: the engine's batch completion returned {rc} within "
                f"MC_TRANSFER_TIMEOUT={os.environ.get('MC_TRANSFER_TIMEOUT')} s (--timeout)")
        for u, _, n in self.fly:
            self.fly_entries -= n
            self.left[u] -= 1
            if self.left[u] == 0:
                self.done[u] = True
                self.n_done += 1
                self._notice(_DONE, u)
                if self.n_done == len(self.units):
                    self._add("mooncake_transfer_ms", (now() - self.t_first) * 1e3)
        self.fly = []

    def _failed(self, u: int, why: str):
        self.t.errors += 1
        idx = self.units[u]
        what = f"message {idx[0]}" if len(idx) == 1 else f"messages {idx[0]}..{idx[-1]}"
        raise TransportError(f"mooncake: {self.op.upper()} of {what} (handoff {self.h}) to "
                             f"{self.remote_session} {why}")

    def end_handoff(self) -> None:
        from mpi4py import MPI

        deadline = now() + self.t.ctx.timeout_s
        while self.sends and not MPI.Request.Testall(self.sends):
            if now() > deadline:
                raise TransferTimeout(f"mooncake: rank {self.peer} did not take this rank's "
                                      "notices before the --timeout")
        self.sends = []
        if self.h == 1 and "mooncake_transfer_ms" in self.cur:  # includes the engine handshake
            self.cur["mooncake_first_transfer_ms"] = self.cur.pop("mooncake_transfer_ms")
        self._flush()
        self.in_handoff = False

    def close(self) -> None:
        """Unregister; local calls only (safe after a timeout)."""
        if self.closed:
            return
        self.closed = True
        cancel_pending(self.sends)
        n = len(self.registered)
        for addr in self.registered:
            self.t.engine.unregister_memory(addr)
        self.registered = []
        if self.in_handoff:
            print(f"kvbench mooncake: rank {self.t.ctx.rank}: handoff {self.h} aborted; "
                  f"unregistered {n} region(s)", file=sys.stderr, flush=True)


@register
class MooncakeTransport(Transport):
    name = "mooncake"
    description = ("Mooncake Transfer Engine: one-sided batch WRITE/READ, P2P handshake "
                   "(readiness and done notices over MPI)")

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("mooncake transport (--transport mooncake; docs/mooncake.md)")
        g.add_argument("--mooncake-protocol", default="tcp", choices=("tcp", "rdma"),
                       help="the engine's transport (default tcp; rdma needs RDMA devices)")
        g.add_argument("--mooncake-devices", default="", metavar="NAMES",
                       help="rdma: comma-separated device names (default: the engine's discovery)")
        g.add_argument("--mooncake-op", choices=("write", "read"), default="write",
                       help="write: prefill pushes into decode's registered buffers (default); "
                            "read: decode pulls from prefill's once told they are ready")
        g.add_argument("--mooncake-batch", choices=("message", "layer", "handoff"), default=None,
                       help="one batch per message, per layer, or per handoff (default: as "
                            "--nixl-batch: handoff for per-block messages, else message)")
        g.add_argument("--mooncake-max-batch", type=arg_int(1, 1 << 20), default=256,
                       metavar="N",
                       help="at most N entries per batch_transfer_async call: a larger unit is "
                            "submitted as several batches at once (default 256; the TCP "
                            "transport's lane queue rejects a batch of thousands of entries)")
        g.add_argument("--mooncake-inflight", type=arg_int(1, 1 << 24), default=1024,
                       metavar="N",
                       help="at most N entries submitted and not complete per channel (default "
                            "1024: the TCP transport's per-peer queue, MC_TCP_MAX_QUEUED_"
                            "TRANSFERS_PER_PEER; past it the engine fails a transfer instead "
                            "of queueing it)")
        g.add_argument("--mooncake-bench-seconds", type=arg_int(1, 3600), default=3, metavar="S",
                       help="--baseline: how long transfer_engine_bench runs per point (its "
                            "--duration; default 3)")
        st = parser.add_argument_group("Mooncake Store (--pattern store, store-layerwise; docs/mooncake.md)")
        st.add_argument("--store-master", default=None, metavar="HOST:PORT",
                        help="a running mooncake_master (default: rank 0 starts one for the job "
                             "on free ports of 127.0.0.1 and stops it at the end)")
        st.add_argument("--store-segment", default=None, metavar="SIZE",
                        help="bytes each rank mounts into the store (its global_segment_size; "
                             "e.g. 512M, 2G; default 1G): the store holds the ranks' sum")
        g.add_argument("--mooncake-inject", choices=("none", "stall"), default="none",
                       help="test hook: stall (prefill never submits or announces)")

    def refusal(self) -> str | None:
        """A flag that would do nothing in this run is refused, not ignored."""
        o = self.ctx.options
        if o.mooncake_devices and o.mooncake_protocol != "rdma":
            return ("--mooncake-devices names RDMA devices: give it with --mooncake-protocol rdma "
                    f"(the protocol is {o.mooncake_protocol})")
        stores = {"store", "store-layerwise"} & {p.strip() for p in
                                                 str(getattr(o, "pattern", "")).split(",")}
        given = [f for f, v in (("--store-master", o.store_master), ("--store-segment", o.store_segment))
                 if v is not None]
        if given and not stores:
            return (f"{', '.join(given)}: only with --pattern store or store-layerwise "
                    "(Mooncake Store)")
        return self._segment_refusal() if stores else None

    def _segment_refusal(self) -> str | None:
        """A --store-segment the store client cannot mount: setup answers -600
        (INVALID_PARAMS) below 16 MiB ("Total size must be at least 16777216")."""
        from kvbench.p2p.transports.mooncake import store

        try:
            size = store.parse_size(self.ctx.options.store_segment or DEFAULT_SEGMENT)
        except ValueError as exc:
            return f"--store-segment: {exc}"
        if size < store.MIN_SEGMENT:
            return (f"--store-segment {self.ctx.options.store_segment}: a store client mounts at "
                    f"least 16M (Mooncake's setup answers -600, invalid parameters, below it)")
        return None

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if device != "cpu":
            return "the mooncake transport runs on --device cpu here (the non-CUDA wheel)"
        return libs.import_module()[1]

    store_mode = False  # --pattern store (or store-layerwise) sets it (kvbench.p2p.patterns.store) before open()

    def open(self) -> None:
        mod, why = libs.import_module()
        if mod is None:
            raise TransportError(why)
        o = self.ctx.options
        self.protocol, self.devices = o.mooncake_protocol, o.mooncake_devices
        self.op, self.inject = o.mooncake_op, o.mooncake_inject
        self.batch = o.mooncake_batch or default_batch(getattr(o, "granularity", "whole"),
                                                       getattr(o, "pattern", ""))
        self.opcode = mod.TransferOpcode.Write if self.op == "write" else mod.TransferOpcode.Read
        self.max_batch, self.inflight = o.mooncake_max_batch, o.mooncake_inflight
        self.errors, self._seq = 0, {}
        self.comm = self.ctx.comm.Dup()
        host = self.host = "127.0.0.1" if len(set(self.ctx.hosts or ["x"])) <= 1 else _my_address()
        # the engine's own bound on a batch's completion (seconds): kvbench's --timeout, so
        # a stopped peer is named within it (a user's own setting wins)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, int(self.ctx.timeout_s))))
        t0 = now()
        self.engine = mod.TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, self.devices)
        self.engine_start_ms = (now() - t0) * 1e3
        if rc != 0:
            raise TransportError(f"mooncake: TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', "
                                 f"{self.protocol!r}, {self.devices!r}) returned {rc}")
        if self.protocol == "rdma":
            self._refuse_rdma_without_devices()
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.master = self.store = None
        if self.store_mode:
            self._open_store(host)

    def _refuse_rdma_without_devices(self) -> None:
        """The engine takes protocol rdma where it finds no RDMA device and moves the bytes some
        other way: a record would say rdma. Agreed over MPI, told once (rank 0's line)."""
        none = rdma_devices(self.engine.get_local_topology()) == set()
        if not self.comm.allreduce(int(none)):
            return
        error = ("--mooncake-protocol rdma: the engine found no RDMA device on a rank (its "
                 "topology lists none; --mooncake-devices names only devices it finds): use "
                 "--mooncake-protocol tcp there")
        if self.ctx.rank == 0:
            raise Reported(error, everyone=True)
        raise PeerReported(error)

    def _open_store(self, host: str) -> None:
        """The job's master (rank 0 starts it unless --store-master names one), then every
        rank's store client with its mounted segment."""
        from kvbench.p2p.transports.mooncake import store

        o, rank = self.ctx.options, self.ctx.rank
        self.misses = self.rejected = 0
        self.get_codes: dict[int, int] = {}
        try:
            self.segment = store.parse_size(o.store_segment or DEFAULT_SEGMENT)
        except ValueError as exc:
            raise TransportError(f"mooncake store: --store-segment: {exc}") from None
        got = (o.store_master, None, None)
        if rank == 0 and not o.store_master:
            try:
                self.master = store.Master(self.ctx.timeout_s)
                got = (self.master.address, self.master.metrics, None)
            except TransportError as exc:
                got = (None, None, str(exc))
        self.master_addr, self.metrics_port, err = self.comm.bcast(got, root=0)
        if err:
            raise TransportError(err)
        self.key_prefix = self.comm.bcast(f"kvb{os.getpid()}-{int(time.time())}", root=0)
        smod, _ = libs.import_module("mooncake.store")
        self.store = smod.MooncakeDistributedStore()
        rc = self.store.setup(host, "P2PHANDSHAKE", self.segment, 64 << 20, self.protocol,
                              self.devices, self.master_addr)
        if rc != 0:
            raise TransportError(f"mooncake store: setup against the master at "
                                 f"{self.master_addr} returned {rc}")

    def next_channel_id(self, peer: int) -> int:
        self._seq[peer] = self._seq.get(peer, 0) + 1
        return self._seq[peer]

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None) -> Channel:
        if self.store_mode:
            from kvbench.p2p.transports.mooncake.store import StoreChannel

            return StoreChannel(self, peer, buffers, is_sender, layer_of)
        return MooncakeChannel(self, peer, buffers, is_sender, layer_of)

    def yardsticks(self, fields: dict | None) -> dict[str, float | None]:
        """Mooncake's own transfer_engine_bench between ranks 0 and 1 on the point's bytes
        and entries (kvbench.p2p.transports.mooncake.bench)."""
        from kvbench.p2p.transports.mooncake import bench

        got = None if fields is None else (fields["bytes"], fields.get("descriptors"))
        nbytes, entries = self.comm.bcast(got, root=0)
        gbps, why = bench.bench_gbps(self.comm, self.host, self.op, self.protocol, self.devices,
                                     nbytes, entries, self.inflight,
                                     self.ctx.options.mooncake_bench_seconds, self.ctx.timeout_s)
        if self.ctx.rank != 0:
            return {}
        if why:
            print(f"kvbench mooncake: no {bench.KIND} figure: {why}", file=sys.stderr, flush=True)
        return {bench.KIND: gbps}

    record_field_names = ("mooncake_op", "mooncake_protocol", "mooncake_batch",
                          "mooncake_max_batch", "mooncake_inflight")

    def record_fields(self) -> dict:
        return {"mooncake_op": self.op, "mooncake_protocol": self.protocol,
                "mooncake_batch": self.batch, "mooncake_max_batch": self.max_batch,
                "mooncake_inflight": self.inflight}

    def spec_options(self) -> dict:
        return {k.removeprefix("mooncake_"): v for k, v in self.record_fields().items()}

    def info(self) -> dict:
        """Collective: the path in the engine's own words (its protocol, devices, topology)."""
        errors = self.comm.allreduce(self.errors)
        extra = self._store_info() if self.store_mode else {}
        try:
            topo = self.engine.get_local_topology()
        except Exception as exc:  # noqa: BLE001 - unknown is an answer
            topo = f"unknown ({type(exc).__name__})"
        devices = self.devices or "none" if self.protocol == "tcp" else self.devices or "auto"
        return {"backend": "Mooncake TransferEngine", "mooncake_version": libs.version(),
                "path": f"Mooncake {self.protocol} (devices: {devices})",
                "mooncake_topology": topo, "mooncake_session": self.session,
                "mooncake_metadata": "P2PHANDSHAKE",
                "mooncake_private_libs": list(libs._preloaded),
                "engine_start_ms": self.engine_start_ms, **self.record_fields(),
                "failed_transfers": errors, **extra}

    def _store_info(self) -> dict:
        """The store's own counters from the master (collective: misses summed)."""
        from kvbench.p2p.transports.mooncake import store

        misses = self.comm.allreduce(self.misses)
        rejected = self.comm.allreduce(self.rejected)
        codes: dict[str, int] = {}
        for part in self.comm.allgather(self.get_codes):
            for code, n in part.items():
                codes[str(code)] = codes.get(str(code), 0) + n
        out = {"store_master": self.master_addr, "store_segment_bytes": self.segment,
               "store_master_started": self.master is not None, "store_misses": misses,
               "store_put_rejected": rejected, "store_get_codes": codes}
        if self.metrics_port and self.ctx.rank == 0:
            out.update(store.read_counters("127.0.0.1", self.metrics_port))
        return out

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:  # noqa: BLE001 - the master may be gone
                pass
            self.store = None
        if self.master is not None:
            self.master.stop()
            self.master = None
        self.engine = None  # its destructor stops the engine's threads and listener
        self.comm.Free()


def _my_address() -> str:
    import socket

    return socket.gethostbyname(socket.gethostname())
