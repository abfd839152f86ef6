"""`--transport nixl`: its flags, the rank's NIXL agent (UCX backend), the notifications it
routes to channels, and what the record says about the path UCX took
(kvbench.p2p.transports.nixl)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Mapping, Sequence, Set

from kvbench.cli import UsageError
from kvbench.links.linkpath import LinkPath, PairFacts, classify_ucx_info
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import (
    Channel,
    Transport,
    TransportError,
)
from kvbench.p2p.transports.nixl import profile
from kvbench.p2p.transports.nixl.binding import (
    _version,
    agent_with_progress_delay,
    import_nixl,
)
from kvbench.p2p.transports.nixl.channel import (
    _NOTIF,
    CHANNELS,
    NIXLChannel,
    default_batch,
    now,
)
from kvbench.p2p.transports.ucx_info import (
    _flush_c_stdio,
    _ucx_probe,
    _ucx_version,
    parse_ucx_proto_info,
    path_category,
    peer_rows,
    read_complete_lines,
    summarize_path,
)

CUDA_IPC_GET = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_SET_BY_KVBENCH: set[str] = set()  # UCX variables this process's kvbench set (not the user)


def kvbench_ucx_env(environ: Mapping[str, str], device: str, cuda_ipc_get: bool,
                    engine: bool, ours: Set[str] = frozenset()) -> dict[str, str]:
    """The UCX variables kvbench sets before the agent is made, given the environment (a pure
    decision; `ours`: those kvbench itself set earlier in this process, not the user).

    On --device cuda, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: UCX's default (auto) turns cuda_ipc's
    GET off unless NVML reports an active NVLink, and a READ then falls back to software
    emulation over TCP (docs/nixl.md, "When the path is not the link"); engines can set the
    same. --no-nixl-cuda-ipc-get leaves UCX's default. The engine shape also sets what vLLM
    sets, UCX_RCACHE_MAX_UNRELEASED=1024. A variable the user set is never changed."""
    want = {}
    if device == "cuda" and cuda_ipc_get:
        want[CUDA_IPC_GET] = "y"
    if engine:
        want["UCX_RCACHE_MAX_UNRELEASED"] = "1024"
    return {k: v for k, v in want.items() if k not in environ or k in ours}


@register
class NIXLTransport(Transport):
    name = "nixl"
    description = "NIXL agents, UCX backend: one-sided WRITE/READ + notifications (metadata over MPI)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("nixl transport (--transport nixl)")
        g.add_argument("--nixl-op", choices=("write", "read"), default=None,
                       help="write: prefill pushes into decode's registered buffers; read: decode "
                            "pulls from prefill's (default write; read with --nixl-engine-profile)")
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
        g.add_argument("--nixl-cuda-ipc-get", action=argparse.BooleanOptionalAction, default=True,
                       help="on --device cuda set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y unless it is "
                            "set (default on: without NVLink UCX's default turns cuda_ipc's READ "
                            "off and emulates it over TCP); recorded in transport_info.ucx_env")
        g.add_argument("--nixl-progress-thread", action=argparse.BooleanOptionalAction, default=True,
                       help="NIXL's own progress thread (NIXL's default, on); without it progress "
                            "comes only from polling, which is faster when cores are scarce")
        e = parser.add_argument_group(
            "nixl engine-shaped handoff (--nixl-engine-profile; docs/nixl.md)")
        profile.add_arguments(e)
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
        self.read_options(o)
        engine = self.shape == "engine"
        # Set before the agent (UCX reads them when it starts), for the whole process, as vLLM
        # sets its one variable; a variable the user set stays theirs.
        if not getattr(o, "nixl_cuda_ipc_get", True) and CUDA_IPC_GET in _SET_BY_KVBENCH:
            os.environ.pop(CUDA_IPC_GET, None)  # set by an earlier transport of this process
            _SET_BY_KVBENCH.discard(CUDA_IPC_GET)
        ours = kvbench_ucx_env(os.environ, self.ctx.device, getattr(o, "nixl_cuda_ipc_get", True),
                               engine, _SET_BY_KVBENCH)
        os.environ.update(ours)
        _SET_BY_KVBENCH.update(ours)
        # On GPU the harness has already bound this rank to its local GPU (kvbench.p2p.gpu_select).
        self.comm = self.ctx.comm.Dup()
        self.ucx_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
        self.ucx_env_set = sorted(ours)
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

    def read_options(self, o) -> None:
        """The agent's and the engine shape's settings from the options (the link shape's
        defaults, or an engine profile's values: .profile); what record_fields reports."""
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
        from kvbench.p2p.transports.nixl.engine_shape import ENGINE_SPIN_WINDOW_MS, Gaps, Waits

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

    def channel(self, peer: int, buffers: Sequence, is_sender: bool, layer_of=None,
                regions=None, blocks=None) -> Channel:
        if self.shape == "engine":  # kvbench.p2p.transports.nixl.engine adds itself here
            from kvbench.p2p.transports.nixl import engine  # noqa: F401  (needs torch)

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
        if self.shape == "engine":  # (K/V pages and block ids are the cut's: kvbench.kv.cut)
            out.update(nixl_shape="engine",
                       nixl_per_request=self.per_request,
                       nixl_mode="per-request" if self.per_request else "reuse",
                       nixl_announce=self.announce, **self.waits.label())
            if self.region_order != "natural":
                out["nixl_region_order"] = self.region_order
        return out

    @property
    def kv_memory(self) -> str:
        """Where the KV lives, in UCX's memory types: its rows between this memory on both
        sides are the KV's path (kvbench.links.ucx_rows)."""
        return "cuda" if self.ctx.device == "cuda" else "host"

    def _poll_label(self) -> str:
        from kvbench.p2p.transports.nixl.engine_shape import PollSchedule

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
            path = summarize_path(rows, self.op, self.kv_memory) or f"unknown ({how})"
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
        path = summarize_path(flat, self.op, self.kv_memory)
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
            "ucx_env_set_by_kvbench": self.ucx_env_set,
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

    # -- the declaration (kvbench.p2p.transports.base: torch-free, read without the runtime) --

    record_field_names = (
        "nixl_op", "nixl_mode", "nixl_prep", "nixl_batch", "nixl_progress_thread",
        "nixl_threads", "nixl_telemetry", "nixl_poll", "nixl_progress_delay_us", "nixl_gap_ms",
        "nixl_gaps", "nixl_gap_seed", "nixl_busy_ms", "nixl_shape", "nixl_per_request",
        "nixl_announce", "nixl_waits", "nixl_spin_window_ms", "nixl_region_order",
        # telemetry_fields (the engine shape's per-transfer telemetry)
        "nixl_post_mean_ms", "nixl_xfer_mean_ms", "descriptors_merged",
        "descriptors_merged_expected")

    @classmethod
    def check_arguments(cls, args, world_size: int) -> None:
        """The engine shape's flags and its pacing knobs (--nixl-poll, --nixl-waits,
        --nixl-gaps, --nixl-announce, --nixl-spin-window-ms, --nixl-gap-ms, --nixl-busy-ms)
        together (kvbench.p2p.transports.nixl.engine_shape.usage_error), whichever transport was chosen: an
        engine-shape flag given with another transport is refused, not ignored."""
        from kvbench.p2p.transports.nixl import engine_shape

        shape_error = engine_shape.usage_error(args)
        if shape_error:
            raise UsageError(shape_error)

    @classmethod
    def page_plan(cls, args) -> bool:
        """The engine shape addresses the KV by the page plan even with no page option."""
        return getattr(args, "nixl_shape", "link") == "engine"

    @classmethod
    def check_cuts(cls, args, cuts) -> None:
        engine = cls.page_plan(args)
        if engine and any(c.merged for c in cuts):
            raise UsageError("--block-ids merged: NIXL joins adjacent descriptors itself; measure "
                             "--block-ids contiguous (its descriptors_merged counts what NIXL posted)")

    @classmethod
    def telemetry_fields(cls, tel: dict, timed: int, warmup: int) -> dict:
        """NIXL's per-transfer telemetry of the engine-shaped handoff, split like the samples:
        `nixl_telemetry` holds the timed handoffs' values in samples_ms order (the cold one and
        the data check's apart), and the means the engine's Prometheus histograms average."""
        if not tel.get("post_ms"):
            return {}
        n = timed
        timed_values = {k: v[1 + warmup:1 + warmup + n] for k, v in tel.items()}
        if len(timed_values["post_ms"]) != n:  # every handoff reads its telemetry: this is a bug
            raise RuntimeError(f"telemetry for {len(timed_values['post_ms'])} of {n} timed handoffs")
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return {"nixl_telemetry": {**timed_values, "cold": {k: v[0] for k, v in tel.items()}},
                "nixl_post_mean_ms": mean(timed_values["post_ms"]),
                "nixl_xfer_mean_ms": mean(timed_values["xfer_ms"]),
                # NIXL's own count after it joined adjacent entries (vLLM's nixl_num_descriptors),
                # and kvbench's prediction of that join
                "descriptors_merged": timed_values["desc_count"][-1],
                "descriptors_merged_expected": timed_values["expected_desc_count"][-1]}

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        """UCX's own protocol rows for the KV's memory (older records: the path string)."""
        return classify_ucx_info(info, pair)
