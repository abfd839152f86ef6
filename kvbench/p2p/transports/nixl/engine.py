"""The engine-shaped NIXL handoff (--nixl-engine-profile): what vLLM 0.32.0's pull connector does.

Per channel, once (as the connector does at registration and at the handshake):
  - one registration covering the whole KV backing buffer (NX/base_worker.py:1737-1749);
  - a local dlist of every block of every region, region-major, and a remote one built from
    the peer's region table (NX/base_worker.py:1973-2052), both prepped (prep_xfer_dlist);
  - each side's descriptor ids for the request (region * pool_blocks + block) exchanged.
Per handoff (one request):
  - prefill announces the request (the control plane of the engine: the proxy's
    kv_transfer_params; not part of the engine's NIXL metrics), over MPI as the engine's
    comes over HTTP, outside NIXL (profile key announce=mpi, default), or as a NIXL
    notification (announce=nixl, the link shape's way);
  - decode makes a prepped READ over the request's ids with the notification attached
    (make_prepped_xfer(..., notif_msg)), posts it without a message (NX/pull_worker.py:546-559),
    looks at it once in the same step and then once per engine step (PollSchedule); on DONE
    it reads NIXL's telemetry for the handle and releases it (NX/base_worker.py:3083-3087);
  - prefill "frees its blocks" when the READ's notification arrives.
Switches (profile keys per_request=false: one handle made once and reposted with the
notification; poll=busy; threads; telemetry; and the cut's --kv-pages split, --block-ids)
isolate each feature's cost (kvbench.p2p.transports.nixl.profile). Telemetry per handoff: postDuration, xferDuration (NIXL's, microseconds,
recorded in ms), totalBytes and descCount after merging, beside kvbench's own times.
"""

from __future__ import annotations

import time
from dataclasses import astuple

import numpy as np

from kvbench.p2p.transports.base import TransportError, seen_by_both
from kvbench.p2p.transports.nixl.channel import (
    _ANNOUNCE,
    _SETUP,
    _SYNC,
    CHANNELS,
    PROC,
    NIXLChannel,
    _notif,
    now,
)
from kvbench.p2p.transports.nixl.engine_shape import (
    PollSchedule,
    Region,
    check_region_major,
    desc_ids,
    dlist_rows,
    merged_count,
)

# `looks`: how many times the engine's poll saw the READ still in flight (PROC) before DONE
# (0: the look in the posting step already saw it done); `post_done`: 1 when the post itself
# returned DONE (the READ and its notification finished inside the call); `idle_ms`: how long
# decode had been without work when it posted (its last look or post; waits=engine
# yield-spins for the window after it, then sleeps); `gap_ms`: the idle time drawn before the
# handoff (gap_ms, gaps).
TELEMETRY_KEYS = ("post_ms", "xfer_ms", "desc_count", "bytes", "expected_desc_count", "looks",
                  "post_done", "idle_ms", "gap_ms")


def _rows(regions: list[Region]) -> np.ndarray:
    """The full dlist as NIXL's Nx3 (address, length, device) array."""
    rows = dlist_rows(regions)
    out = np.zeros((len(rows), 3), dtype=np.uint64)
    if rows:
        out[:, :2] = np.asarray(rows, dtype=np.uint64)
    return out


class EngineChannel(NIXLChannel):
    """A NIXL channel in the engine's shape (see the module doc). Read only: decode initiates."""

    def __init__(self, transport, peer, buffers, is_sender, layer_of=None, regions=None,
                 blocks=None):
        if regions is None or blocks is None:
            raise TransportError("nixl: the engine-shaped handoff needs the paged KV's region "
                                 "table (--layout paged --granularity block)")
        check_region_major(blocks)
        self.region_list, self.block_list = list(regions), list(blocks)
        self.ids = desc_ids(self.region_list, self.block_list)
        self.poll = PollSchedule(transport.poll_text, seed=transport.ctx.rank)
        self.per_request, self.waits = transport.per_request, transport.waits
        self.next_poll = 0.0
        self.looks = self.post_done = 0
        self.idle_ms = self.gap_ms = 0.0
        self.tel: dict[str, list] = {k: [] for k in TELEMETRY_KEYS}
        self.remote_ids: list[int] = []
        self.expected = None
        super().__init__(transport, peer, buffers, is_sender, layer_of)

    # -- set-up ------------------------------------------------------------------

    def _setup(self) -> None:
        agent, t = self.agent, self.t
        self._register()
        self.xc.swap(None, self._tag(_SYNC), "set-up sync")
        t0 = now()
        mine = {"cid": self.cid, "op": self.op, "role": self.role, "mem": self.mem,
                "sizes": [d[1] for d in self.descs], "md": agent.get_agent_metadata(),
                "regions": [astuple(r) for r in self.region_list],
                "ids": self.ids}
        theirs = self.xc.swap(mine, self._tag(_SETUP), "NIXL metadata")
        if theirs["role"] == self.role or theirs.get("regions") is None:
            raise seen_by_both(t.ctx.rank, self.peer, f"nixl: rank {self.peer}: its channel is not "
                               f"an engine-shaped {'decode' if self.is_sender else 'prefill'} channel")
        if theirs["sizes"] != mine["sizes"] or theirs["mem"] != self.mem:
            raise seen_by_both(t.ctx.rank, self.peer,
                               f"nixl: rank {self.peer}: block sizes or memory types differ")
        self.remote = t.load_remote(self.peer, theirs["md"])
        t.attach(self)
        if self.initiator:
            self._add("nixl_metadata_ms", (now() - t0) * 1e3)
            remote_regions = [Region(*r) for r in theirs["regions"]]
            self.remote_ids = list(theirs["ids"])
            if t.region_order == "reversed":  # test fault: the peer's regions in the wrong order
                self.remote_ids = _reverse_regions(self.remote_ids, remote_regions)
            local_rows, remote_rows = _rows(self.region_list), _rows(remote_regions)
            t1 = now()
            self.local_dl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, self.mem)
            self.remote_dl = agent.prep_xfer_dlist(self.remote, remote_rows, self.mem)
            self._add("nixl_prep_dlist_ms", (now() - t1) * 1e3)
            self.expected = merged_count(dlist_rows(self.region_list), self.ids,
                                         dlist_rows(remote_regions), self.remote_ids)
            if not self.per_request:
                self._make(0)
        self._flush()

    def _make(self, u: int, notif: bytes = b"") -> None:
        t0 = now()
        self.xfers[u] = self.agent.make_prepped_xfer(self.OP, self.local_dl, self.ids,
                                                     self.remote_dl, self.remote_ids, notif)
        self.list_len[u] = len(self.ids)
        self._add("nixl_make_xfer_ms", (now() - t0) * 1e3)
        if self.t.backend_used is None:
            try:
                self.t.backend_used = self.agent.query_xfer_backend(self.xfers[u])
            except Exception:  # noqa: BLE001 - unknown is an answer
                self.t.backend_used = "unknown"

    # -- the handoff ---------------------------------------------------------------

    def pump(self, from_test: bool) -> None:
        """Drive the handoff; never blocks. With announce=mpi (the default) the request
        reaches decode outside NIXL, as vLLM's does (the proxy's kv_transfer_params over
        HTTP, then the engine core's step), so decode's NIXL is left alone between its last
        step and the post; with nixl the announcement is a NIXL notification, whose arrival
        NIXL's progress thread handles right before the post (it makes posts slower: the
        post then more often loses the core, docs/nixl.md)."""
        if self.t.announce != "mpi":
            super().pump(from_test)
            return
        if self.initiator:
            while True:
                ok, msg = self.xc.try_recv(self._tag(_ANNOUNCE))
                if not ok:
                    break
                self.notify("r", *msg)
            while self.queue:
                self._issue(self.queue.popleft())
            return
        while self.queue:  # prefill: announce, then look for the READ's notification
            self.xc.send((self.h, self.queue.popleft()), self._tag(_ANNOUNCE))
        self.t.poll_notifs()

    def _issue(self, u: int) -> None:
        notif = _notif(self.cid, "d", self.h, u)
        self.idle_ms = self.waits.idle_s() * 1e3
        if self.per_request:  # the notification rides on the READ from its creation
            self._make(u, notif)
        t0 = now()
        try:
            st = (self.agent.transfer(self.xfers[u]) if self.per_request
                  else self.agent.transfer(self.xfers[u], notif))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error classes
            self._failed(u, f"post failed: {type(exc).__name__}: {exc}")
        t1 = now()
        self.count_posted(self.list_len[u])
        self.waits.worked()
        self._add("nixl_post_ms", (t1 - t0) * 1e3)
        self.t_first = t0
        self.looks, self.post_done = 0, int(st == "DONE")
        self.state[u] = PROC
        if st == "ERR":
            self._failed(u, "post returned ERR")
        self.next_poll = t1  # the engine looks once more in the step that posted

    def check(self, u: int) -> None:
        """One engine step's look at the transfer: not before the step comes (waiting as the
        engine's threads do, the profile key waits), then NIXL's state; on DONE its telemetry, then the release."""
        if not self.poll.busy:
            self.waits.until(self.next_poll)
        try:
            st = self.agent.check_xfer_state(self.xfers[u])
        except Exception as exc:  # noqa: BLE001
            self._failed(u, f"{type(exc).__name__}: {exc}")
        t = now()
        self.waits.worked()
        if st == "PROC":
            self.looks += 1
            if not self.poll.busy:
                self.next_poll = t + self.poll.next_ms() / 1e3
            return
        if st != "DONE":
            self._failed(u, f"ended in {st}")
        self._telemetry(u)
        if self.per_request:
            t2 = now()
            self.xfers[u].release()
            self.xfers[u] = None
            self._add("nixl_release_ms", (now() - t2) * 1e3)
        self._unit_done(u, t)

    def idle(self, u: int) -> None:
        """Between two looks, wait as the engine's threads do (the key waits, default sleep):
        decode waiting for a request it has not been told of pauses once; prefill waits for
        its next step before it looks for the READ's notification again; decode with a READ
        in flight waits in check()."""
        if self.initiator and self.state[u] == PROC:
            return
        if self.initiator or self.poll.busy:
            self.waits.pause()
            return
        self.waits.until(self.next_poll)
        self.waits.worked()  # prefill's engine step: it looks for the READ's notification
        self.next_poll = now() + self.poll.next_ms() / 1e3

    def idle_before(self) -> None:
        """The time between two requests (gap_ms, drawn by gaps): decode first
        works for up to busy_ms (decoding the last request: forward passes that keep
        its core busy), then idles for the rest, waiting as the engine's threads wait
        (waits=engine: yield-spinning through the window after the last work, then
        asleep; other waits sleep it). A gap shorter than the work leaves no idle: the post
        follows the work, as when a request arrives while another decodes. Prefill idles the
        whole gap. Recorded per handoff (gap_ms; idle_ms at the post)."""
        gap = self.t.gaps.next_s()
        self.gap_ms = gap * 1e3
        if not gap:
            return
        t_end = now() + gap
        if self.initiator and self.t.busy_s:
            self.waits.busy(min(t_end, now() + self.t.busy_s))
        if self.waits.mode == "engine":
            self.waits.until(t_end)
        else:
            time.sleep(max(0.0, t_end - now()))

    def _telemetry(self, u: int) -> None:
        if not self.t.telemetry:
            return
        try:
            res = self.agent.get_xfer_telemetry(self.xfers[u])
        except Exception as exc:  # noqa: BLE001 - telemetry off by NIXL_TELEMETRY_ENABLE=n
            raise TransportError(f"nixl: no transfer telemetry ({type(exc).__name__}: {exc}); "
                                 "is NIXL_TELEMETRY_ENABLE set to n?") from None
        self.tel["post_ms"].append(res.postDuration / 1e3)
        self.tel["xfer_ms"].append(res.xferDuration / 1e3)
        self.tel["desc_count"].append(int(res.descCount))
        self.tel["bytes"].append(int(res.totalBytes))
        self.tel["expected_desc_count"].append(self.expected)
        self.tel["looks"].append(self.looks)
        self.tel["post_done"].append(self.post_done)
        self.tel["idle_ms"].append(self.idle_ms)
        self.tel["gap_ms"].append(self.gap_ms)

    def end_handoff(self) -> None:
        """Handles were released on DONE (per request); nothing else is per handoff."""
        self.xc.finish_sends()
        self._flush()
        self.in_handoff = False

    def telemetry(self) -> dict[str, list]:
        """Per handoff on the initiator (cold, warm-ups, timed, data check, in order)."""
        return {k: list(v) for k, v in self.tel.items()} if self.initiator else {}


def _reverse_regions(ids: list[int], regions: list[Region]) -> list[int]:
    """The same blocks addressed in the reverse region order (a planted fault)."""
    offsets = np.cumsum([0] + [r.n_blocks for r in regions[:-1]]).tolist()
    out = []
    for i in ids:
        r = max(k for k, o in enumerate(offsets) if o <= i)
        out.append(offsets[len(regions) - 1 - r] + (i - offsets[r]))
    return out


CHANNELS["engine"] = EngineChannel
