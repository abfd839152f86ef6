"""`--pattern store` over Mooncake Store: prefill puts the request's KV into a shared store,
decode gets it into its own cache (kvbench.p2p.transports.mooncake).

The master (`mooncake_master`, from the wheel) is started by rank 0 on free ports of
127.0.0.1 and stopped by its PID when the transport closes (or `--store-master HOST:PORT`
names one already running). Every rank mounts a segment of `--store-segment` bytes into the
store (a client's `global_segment_size`: its share of the pool) and registers its KV for
zero-copy puts and gets.

Keys are one per message, so per block with `--granularity block` (what SGLang's HiCache
and LMCache's Mooncake backend key: one object per page or chunk of tokens) and per layer
with `--granularity layer`, and named per handoff: a stale or evicted object can only be a
miss, never an earlier handoff's bytes passing the data check. Prefill `batch_put_from`s its
messages, then tells decode over MPI; decode `batch_get_into`s its own buffers. A put the
store has no room for (-200) is counted as rejected; a get that does not return the object's
size is a miss, counted (-704: the store does not hold the key, never stored or evicted;
-707: its lease expired while it was read); its bytes are not accepted: they stay wiped, and
the data check counts them wrong. Every answer a get gave is counted in the record. The
master runs with its default lease (10 s): a lease of 0 turns every get into -707.
The store's own counters are read from the master's metrics endpoint (Prometheus text).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvbench.p2p.transports.base import (
    Channel,
    Request,
    TimedParts,
    TransferTimeout,
    TransportError,
    cancel_pending,
)
from kvbench.p2p.transports.mooncake import libs

_TAG = 7600
_NO_SPACE = -200  # a put the store has no room for (its objects are leased or in use)
MIN_SEGMENT = 16 << 20  # the least a client mounts: setup answers -600 below it
COUNTERS = {  # record field -> the master's metric (summed over its labels)
    "store_objects": "master_key_count",
    "store_bytes_used": "master_allocated_bytes",
    "store_capacity_bytes": "master_total_capacity_bytes",
    "store_evicted_objects": "master_successful_evictions_total",
    "store_put_failures": "master_put_start_failures_total",
    "store_get_failures": "master_get_replica_list_failures_total",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A mooncake_master of this job on 127.0.0.1 (started and stopped by PID)."""

    def __init__(self, timeout_s: float):
        exe = libs.executable("mooncake_master")
        if exe is None:
            raise TransportError("mooncake: mooncake_master is missing from the wheel")
        self.rpc, self.metrics = free_port(), free_port()
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvbench-mooncake-master-{os.getpid()}.log"
        cmd = [str(exe), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}",
               "--enable_http_metadata_server=false"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=libs.exe_env(), preexec_fn=libs.die_with_parent)
        deadline = time.perf_counter() + timeout_s
        while not _listening(self.rpc):
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                self.stop()
                raise TransportError(f"mooncake: mooncake_master did not start "
                                     f"({tail[0][:200] if tail else 'no output'})")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def read_counters(host: str, port: int) -> dict[str, float | None]:
    """The store's counters from the master's /metrics (None where it does not say)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            text = r.read().decode(errors="replace")
    except OSError as exc:
        return {"store_counters_error": f"{type(exc).__name__}: {exc}"}
    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            got[s.name] = got.get(s.name, 0.0) + s.value
    return {k: got.get(m) for k, m in COUNTERS.items()}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", text.strip(), re.I)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 2G)")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2].upper()]


class _Req(Request):
    __slots__ = ("ch", "h")

    def __init__(self, ch: StoreChannel):
        self.ch, self.h = ch, ch.h

    def test(self) -> bool:
        ch = self.ch
        if self.h != ch.h or ch.finished:
            return True
        ch.pump()
        return ch.finished


class _LayerReq(Request):
    """Decode: done once its layer is got; prefill: its layer was put when posted."""

    __slots__ = ("ch", "h", "layer")

    def __init__(self, ch: StoreChannel, layer: int):
        self.ch, self.h, self.layer = ch, ch.h, layer

    def test(self) -> bool:
        ch = self.ch
        if self.h != ch.h or ch.finished or self.layer in ch.layers_done:
            return True
        ch.pump()
        return self.layer in ch.layers_done


class StoreChannel(TimedParts, Channel):
    """Prefill puts every message of a handoff under its own key; decode gets them into its
    buffers once told they are in (see the module doc)."""

    def __init__(self, transport, peer: int, buffers: Sequence, is_sender: bool,
                 layer_of: Sequence[int] | None = None):
        super().__init__(transport, peer, buffers, is_sender, layer_of)
        self.t, self.store = transport, transport.store
        self.role = "prefill" if is_sender else "decode"
        self.addrs = [b.data_ptr() for b in self.buffers]
        self.lens = [b.numel() * b.element_size() for b in self.buffers]
        self.cid = transport.next_channel_id(peer)
        self.registered: list[int] = []
        self.h, self.in_handoff, self.finished, self.closed = 0, False, False, False
        self.sends: list = []
        self.per: dict[str, list[float]] = {}
        self.cur: dict[str, float] = {}
        self.msgs_of: dict[int, list[int]] | None = None  # per-layer mode: by_layer()
        t0 = time.perf_counter()
        seen: dict[int, int] = {}
        for b in self.buffers:
            st = b.untyped_storage()
            seen.setdefault(st.data_ptr(), st.nbytes())
        for addr, n in sorted(seen.items()):
            rc = self.store.register_buffer(addr, n)
            if rc != 0:
                self.close()
                raise TransportError(f"mooncake store: register_buffer of {n:,} bytes returned {rc}")
            self.registered.append(addr)
        self.per[f"store_register_{self.role}_ms"] = [(time.perf_counter() - t0) * 1e3]

    def _keys(self, idx: Sequence[int]) -> list[str]:
        return [f"{self.t.key_prefix}-c{self.cid}-h{self.h}-m{i}" for i in idx]

    def by_layer(self, clock_offset_s: float = 0.0) -> None:
        """Per-layer mode (`--pattern store-layerwise`): prefill puts a layer's objects as
        soon as the engine has posted that layer's messages and announces the layer; decode
        gets each layer once announced, while prefill puts the next. `clock_offset_s` maps
        this rank's perf_counter onto rank 0's (harness.Clock), so both ends' per-layer
        stamps share one timeline: ms since prefill's first put of the handoff began."""
        self.msgs_of: dict[int, list[int]] = {}
        for i, layer in enumerate(self.layer_of):
            self.msgs_of.setdefault(layer, []).append(i)
        self.offset = clock_offset_s

    def begin_handoff(self) -> None:
        self.h += 1
        self.in_handoff, self.finished, self.posted = True, False, 0
        if self.msgs_of is not None:
            self.left = {layer: len(m) for layer, m in self.msgs_of.items()}
            self.layers_done: set[int] = set()
            self.origin: float | None = None
            self.cur = {}

    def post(self, i: int, ready=None) -> Request:
        if not self.is_sender:
            return _Req(self) if self.msgs_of is None else _LayerReq(self, self.layer_of[i])
        if self.msgs_of is not None:
            layer = self.layer_of[i]
            self.left[layer] -= 1
            if self.left[layer] == 0:
                if ready is not None:
                    ready.wait()
                self._put_layer(layer)
            return _LayerReq(self, layer)
        self.posted += 1
        if self.posted == len(self.buffers):
            if ready is not None:
                ready.wait()
            self._put()
        return _Req(self)

    def _put_objects(self, idx: Sequence[int]) -> tuple[float, int]:
        """batch_put_from the messages `idx` (one object each): (ms, rejected for no room).
        Any other failure ends the job naming the master."""
        keys = self._keys(idx)
        t0 = time.perf_counter()
        rcs = self._chunked(self.store.batch_put_from, idx)
        ms = (time.perf_counter() - t0) * 1e3
        self.count_posted(len(keys))  # one object per message (decode gets the same keys)
        full = [k for k, rc in zip(keys, rcs, strict=True) if rc == _NO_SPACE]
        failed = [k for k, rc in zip(keys, rcs, strict=True) if rc not in (0, _NO_SPACE)]
        self.t.rejected += len(full)
        if failed:
            raise TransportError(f"mooncake store: put of {len(failed)} of {len(keys)} objects "
                                 f"failed (handoff {self.h}; first {failed[0]}: "
                                 f"{rcs[keys.index(failed[0])]}); is the master at "
                                 f"{self.t.master_addr} still running?")
        return ms, len(full)

    def _put(self) -> None:
        ms, full = self._put_objects(range(len(self.lens)))
        self.per.setdefault("store_put_ms", []).append(ms)
        self.per.setdefault("store_put_rejected", []).append(float(full))
        self.sends.append(self.t.comm.isend((self.h, ms), dest=self.peer, tag=self._tag()))
        self.finished = True  # prefill's part ends when its objects are in the store

    def _put_layer(self, layer: int) -> None:
        """Put one layer's objects, then announce the layer (with its put's start on the
        common clock); after the last layer, the handoff's totals (store_put_ms: the sum of
        the layers' puts)."""
        start = time.perf_counter() - self.offset
        ms, full = self._put_objects(self.msgs_of[layer])
        end = time.perf_counter() - self.offset
        self.origin = start if self.origin is None else self.origin
        self.per.setdefault("store_layer_put_ms", []).append(ms)
        self.per.setdefault("store_layer_put_end_ms", []).append((end - self.origin) * 1e3)
        self._add("store_put_ms", ms)
        self._add("store_put_rejected", float(full))
        self.sends.append(self.t.comm.isend((self.h, layer, start), dest=self.peer,
                                            tag=self._tag()))
        self.layers_done.add(layer)
        if len(self.layers_done) == len(self.msgs_of):
            self._flush()
            self.finished = True

    def _chunked(self, call, idx: Sequence[int]) -> list[int]:
        """`call` over at most --mooncake-inflight keys at a time, each key with its own
        message's address and length (a layer's keys with a layer's buffers: keys paired
        with another slice's buffers were the -600 of an earlier attempt, docs/mooncake.md).
        The store moves the bytes with the Transfer Engine, whose TCP transport fails (-800)
        what passes its per-peer queue of 1,024 (20,000 pages in one batch_put_from: half
        failed)."""
        idx, step, out = list(idx), self.t.inflight, []
        for k in range(0, len(idx), step):
            part = idx[k:k + step]
            out += call(self._keys(part), [self.addrs[i] for i in part],
                        [self.lens[i] for i in part])
        return out

    def _tag(self) -> int:
        return _TAG + (self.cid % 1000)

    def pump(self) -> None:
        if self.is_sender:
            return
        comm = self.t.comm
        while comm.iprobe(source=self.peer, tag=self._tag()):
            note = comm.recv(source=self.peer, tag=self._tag())
            if note[0] != self.h:
                raise TransportError(f"mooncake store: put notice for handoff {note[0]} in "
                                     f"handoff {self.h}")
            if self.msgs_of is None:
                self.per.setdefault("store_get_ms", []).append(self._get(range(len(self.lens))))
                self.finished = True
                return
            self._get_layer(note[1], note[2])

    def _get(self, idx: Sequence[int]) -> float:
        """batch_get_into the messages `idx`: ms. A get that does not return its object's
        size is a miss (counted, named once on stderr); every answer is counted."""
        keys = self._keys(idx)
        t0 = time.perf_counter()
        got = self._chunked(self.store.batch_get_into, idx)
        ms = (time.perf_counter() - t0) * 1e3
        misses = sum(1 for g, i in zip(got, idx, strict=True) if g != self.lens[i])
        for g in got:  # every answer counted; only the data check says whether bytes are right
            self.t.get_codes[g] = self.t.get_codes.get(g, 0) + 1
        self._add("store_misses", float(misses))
        if misses and not self.t.misses:
            print(f"kvbench mooncake store: rank {self.t.ctx.rank}: {misses} of {len(keys)} "
                  f"gets missed in handoff {self.h} (not stored: the store was full, or "
                  "evicted): their bytes are not accepted; the data check counts them wrong",
                  file=sys.stderr, flush=True)
        self.t.misses += misses
        if self.msgs_of is None:
            self._flush()
        return ms

    def _get_layer(self, layer: int, put_start: float) -> None:
        """Get one announced layer; its start is recorded since prefill's first put of the
        handoff (the layer-0 notice carries it), on the common clock."""
        if self.origin is None:
            self.origin = put_start
        start = time.perf_counter() - self.offset
        ms = self._get(self.msgs_of[layer])
        self.per.setdefault("store_layer_get_ms", []).append(ms)
        self.per.setdefault("store_layer_get_start_ms", []).append((start - self.origin) * 1e3)
        self._add("store_get_ms", ms)
        self.layers_done.add(layer)
        if len(self.layers_done) == len(self.msgs_of):
            self._flush()
            self.finished = True

    def end_handoff(self) -> None:
        from mpi4py import MPI

        deadline = time.perf_counter() + self.t.ctx.timeout_s
        while self.sends and not MPI.Request.Testall(self.sends):
            if time.perf_counter() > deadline:
                raise TransferTimeout(f"mooncake store: rank {self.peer} did not take the put "
                                      "notice before the --timeout")
        self.sends = []
        self.in_handoff = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        cancel_pending(self.sends)
        for addr in self.registered:
            try:
                self.store.unregister_buffer(addr)
            except Exception:  # noqa: BLE001
                pass
        self.registered = []
        if self.in_handoff:
            print(f"kvbench mooncake store: rank {self.t.ctx.rank}: handoff {self.h} aborted",
                  file=sys.stderr, flush=True)
