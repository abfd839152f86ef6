"""Sharded handoff: tensor-parallel prefill hands its KV to tensor-parallel decode, each rank
holding only its KV-head shard.

    mpirun -n 4 python -m kvbench.p2p --pattern sharded --tp 2                      # 0-1 -> 2-3
    mpirun -n 6 python -m kvbench.p2p --pattern sharded --prefill-tp 4 --decode-tp 2

Ranks 0..P-1 prefill, P..P+D-1 decode. TP rank r of a side holds kv heads
[r K/TP, (r+1) K/TP) when TP divides K; when TP is a multiple of K each head lives on
TP/K consecutive ranks (replicated); MLA's latent is not split by heads, so every rank of
both sides holds all of it. Every decode rank gets each of its heads from one prefill rank
that holds it (the least loaded holder): the send plan is a list of edges
(prefill rank -> decode rank: heads), built by `shard_plan`, printed, and recorded.

Each edge has its own Channel over its own tensors: an edge's heads are stored together
(head-major groups, as an HND layout allows), so re-sharding moves whole tensors and needs
no packing. One point measures, interleaved round by round in the same run:

    isolated   each edge alone (a world barrier holds every other rank idle, sleeping)
    contended  every edge at once after one world barrier

A rank's time runs from the start barrier to: all its sends done and the notices of its
decode peers in (prefill), or all its bytes received (decode). The handoff time of an
iteration is the maximum across ranks (the critical path).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from kvbench.harness import (
    LoopResult,
    Notice,
    barrier,
    interleaved_loops,
    now,
    wait_request,
)
from kvbench.messages import plan_messages
from kvbench.patterns import register
from kvbench.patterns.base import (
    Pattern,
    Point,
    device_sync,
    kv_spec,
    make_data,
    peak_rss_bytes,
)
from kvbench.stats import Measurement
from kvbench.transports.base import TransferTimeout, wait_all
from kvbench.units import gb_per_s


class ShardError(ValueError):
    """A TP layout that cannot shard the model's KV heads (one clear line)."""


def heads_by_rank(tp: int, kv_heads: int, mla: bool, side: str) -> list[list[int]]:
    """Global kv heads each TP rank of one side holds."""
    if mla:
        return [[0] for _ in range(tp)]
    if tp <= kv_heads:
        if kv_heads % tp:
            raise ShardError(f"--{side}-tp {tp} does not divide the model's {kv_heads} kv heads: "
                             f"each rank must hold whole heads (use a TP that divides {kv_heads}, "
                             f"or a multiple of {kv_heads} to replicate heads)")
        n = kv_heads // tp
        return [list(range(r * n, (r + 1) * n)) for r in range(tp)]
    if tp % kv_heads:
        raise ShardError(f"--{side}-tp {tp} is more than the model's {kv_heads} kv heads but not a "
                         f"multiple of it: heads cannot be replicated evenly")
    copies = tp // kv_heads
    return [[r // copies] for r in range(tp)]


@dataclass(frozen=True)
class Edge:
    src: int  # world rank on the prefill side
    dst: int  # world rank on the decode side
    heads: tuple[int, ...]  # global kv heads it carries


@dataclass
class ShardPlan:
    prefill_tp: int
    decode_tp: int
    kv_heads: int  # distinct heads (1 for MLA: the latent)
    mla: bool
    prefill_heads: list[list[int]]  # by prefill TP rank (= world rank)
    decode_heads: list[list[int]]  # by decode TP rank (world rank = prefill_tp + j)
    edges: list[Edge] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.prefill_tp + self.decode_tp

    def copies(self, side: str) -> int:
        """Ranks of a side holding each head (1: no replication)."""
        holders = self.prefill_heads if side == "prefill" else self.decode_heads
        return sum(1 for hs in holders if 0 in hs)

    @property
    def replicated(self) -> dict:
        return {"prefill": self.copies("prefill"), "decode": self.copies("decode")}

    @property
    def note(self) -> str:
        if self.mla:
            return "MLA latent is not split by heads: every rank of both sides holds all of it"
        parts = []
        for side, tp in (("prefill", self.prefill_tp), ("decode", self.decode_tp)):
            if self.copies(side) > 1:
                parts.append(f"{side}: kv_heads {self.kv_heads} < TP {tp}, each head replicated on "
                             f"{self.copies(side)} ranks")
        return "; ".join(parts)

    def role(self, rank: int) -> str:
        return "prefill" if rank < self.prefill_tp else "decode"

    def held(self, rank: int) -> list[int]:
        return (self.prefill_heads[rank] if rank < self.prefill_tp
                else self.decode_heads[rank - self.prefill_tp])

    def edges_of(self, rank: int) -> list[Edge]:
        return [e for e in self.edges if rank in (e.src, e.dst)]

    def describe(self) -> list[str]:
        def span(hs):
            hs = list(hs)
            if len(hs) > 1 and hs == list(range(hs[0], hs[-1] + 1)):
                return f"{hs[0]}-{hs[-1]}"
            return ",".join(map(str, hs))

        what = "latent" if self.mla else "heads"
        lines = [f"send plan: prefill TP {self.prefill_tp} ({_ranks(0, self.prefill_tp)}) -> "
                 f"decode TP {self.decode_tp} ({_ranks(self.prefill_tp, self.world)}), "
                 f"{self.kv_heads} kv {'latent' if self.mla else 'heads'}"
                 + (f"; {self.note}" if self.note else "")]
        for r in range(self.prefill_tp):
            out = [f"rank {e.dst} {what} {span(e.heads)}" for e in self.edges if e.src == r]
            lines.append(f"  prefill rank {r} holds {what} {span(self.held(r))}: sends "
                         + ("; ".join(out) if out else "nothing (another holder serves every decode rank)"))
        for r in range(self.prefill_tp, self.world):
            inn = [f"rank {e.src} ({span(e.heads)})" for e in self.edges if e.dst == r]
            lines.append(f"  decode rank {r} holds {what} {span(self.held(r))}: from "
                         + ", ".join(inn))
        return lines

    def as_dict(self) -> dict:
        return {"prefill_tp": self.prefill_tp, "decode_tp": self.decode_tp,
                "kv_heads": self.kv_heads, "mla": self.mla,
                "prefill_heads": self.prefill_heads, "decode_heads": self.decode_heads,
                "edges": [{"src": e.src, "dst": e.dst, "heads": list(e.heads)} for e in self.edges]}


def shard_plan(kv_heads: int, prefill_tp: int, decode_tp: int, mla: bool = False) -> ShardPlan:
    """Who sends which global heads to whom. Pure; raises ShardError on layouts that cannot
    shard. Each decode rank's head comes from the least-loaded prefill holder (ties: lowest
    rank), so replicated prefill heads spread their sends."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ShardError("--prefill-tp and --decode-tp must be at least 1")
    k = 1 if mla else kv_heads
    ph = heads_by_rank(prefill_tp, k, mla, "prefill")
    dh = heads_by_rank(decode_tp, k, mla, "decode")
    load = [0] * prefill_tp
    chosen: dict[tuple[int, int], list[int]] = {}
    for j, heads in enumerate(dh):
        for h in heads:
            holders = [i for i in range(prefill_tp) if h in ph[i]]
            src = min(holders, key=lambda i: (load[i], i))
            load[src] += 1
            chosen.setdefault((src, prefill_tp + j), []).append(h)
    edges = [Edge(s, d, tuple(sorted(hs))) for (s, d), hs in sorted(chosen.items(),
                                                                  key=lambda kv: (kv[0][1], kv[0][0]))]
    plan = ShardPlan(prefill_tp, decode_tp, k, mla, ph, dh, edges)
    for j, heads in enumerate(dh):  # invariant: every decode head arrives exactly once
        got = sorted(h for e in edges if e.dst == prefill_tp + j for h in e.heads)
        assert got == sorted(heads), (j, got, heads)
    return plan


def _ranks(a: int, b: int) -> str:
    return f"rank {a}" if b - a == 1 else f"ranks {a}-{b - 1}"


def resolve_tp(args, world_size: int) -> tuple[int, int]:
    """(prefill_tp, decode_tp) from --tp / --prefill-tp / --decode-tp and the world size."""
    p = args.prefill_tp if args.prefill_tp is not None else args.tp
    d = args.decode_tp if args.decode_tp is not None else args.tp
    if p is None and d is None:
        if world_size % 2:
            raise ShardError(f"pattern sharded on {world_size} ranks: give --prefill-tp and "
                             f"--decode-tp summing to {world_size} (or --tp with an even rank count)")
        return world_size // 2, world_size // 2
    if p is None:
        p = world_size - d
    if d is None:
        d = world_size - p
    if p < 1 or d < 1:
        raise ShardError(f"pattern sharded needs at least one prefill and one decode rank; "
                         f"got --prefill-tp {p} --decode-tp {d}")
    if p + d != world_size:
        raise ShardError(f"pattern sharded with prefill TP {p} + decode TP {d} needs {p + d} ranks "
                         f"({_ranks(0, p)} prefill, {_ranks(p, p + d)} decode), but the job has "
                         f"{world_size}: use mpirun -n {p + d}")
    return p, d


@dataclass
class Link:
    """One edge as seen from one of its ranks."""

    edge: Edge
    peer: int
    is_sender: bool
    data: object  # KVCache
    plan: object  # MessagePlan
    ch: object  # Channel
    notice: Notice


class ShardHandoff:
    """One handoff over several links at once (or none: the rank only meets the barrier).

    Receivers pre-post every receive, senders pre-post the completion notices; everyone meets
    one world barrier; senders take t0 and post every send of every link; receivers unpack
    messages as they land, then notify each of their senders. Returns this rank's time in
    ms (None on a rank with no link in this handoff)."""

    def __init__(self, ctx, links: list[Link]):
        self.ctx, self.links = ctx, links

    def __call__(self) -> float | None:
        ctx = self.ctx
        if not self.links:
            barrier(ctx.comm, ctx.timeout_s, "handoff start", idle=True)
            return None
        for lk in self.links:
            lk.ch.begin_handoff()
        deadline = now() + ctx.timeout_s
        recv = [lk for lk in self.links if not lk.is_sender]
        send = [lk for lk in self.links if lk.is_sender]
        pending = [(lk, i, lk.ch.post(i)) for lk in recv for i in range(lk.plan.n)]
        notes = [lk.notice.post_wait() for lk in send]
        barrier(ctx.comm, ctx.timeout_s, "handoff start")
        t0 = now()
        sreqs = []
        for lk in send:
            if lk.plan.packed:
                lk.plan.pack()
                device_sync(ctx.device)
            sreqs += [lk.ch.post(i) for i in range(lk.plan.n)]
        while pending:
            still = []
            for lk, i, r in pending:
                if r.test():
                    if lk.plan.packed:
                        lk.plan.unpack(i)
                else:
                    still.append((lk, i, r))
            pending = still
            if pending and now() > deadline:
                raise TransferTimeout(f"receive did not complete before the --timeout "
                                      f"({len(pending)} messages pending)")
        t1 = None
        if recv:
            device_sync(ctx.device)
            t1 = now()
            for lk in recv:
                lk.notice.send()
        wait_all(sreqs, deadline, "send")
        for n in notes:
            wait_request(n, deadline, "completion notice from a decode rank")
        if t1 is None:
            t1 = now()
        for lk in self.links:
            lk.ch.end_handoff()
        return (t1 - t0) * 1e3


def _critical(parts: list[tuple], n: int) -> LoopResult:
    """Per-iteration maximum over the ranks that timed a handoff (the critical path)."""
    timed = [p for p in parts if p[2]]
    samples = Measurement()
    for col in zip(*[p[2] for p in timed], strict=True):
        samples.add(max(col))
    colds = [p[0] for p in timed if p[0] is not None]
    warm = [max(col) for col in zip(*[p[1] for p in timed], strict=True)] if timed else []
    return LoopResult(max(colds) if colds else None, warm, samples, n)


@register
class Sharded(Pattern):
    name = "sharded"
    description = "TP prefill ranks hand their KV-head shards to TP decode ranks (re-sharding)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("sharded pattern")
        g.add_argument("--tp", type=int, default=None,
                       help="tensor-parallel size of both sides (world = 2 x TP; default world/2)")
        g.add_argument("--prefill-tp", type=int, default=None, help="prefill TP size (ranks 0..P-1)")
        g.add_argument("--decode-tp", type=int, default=None, help="decode TP size (the next D ranks)")

    @classmethod
    def layout_error(cls, args, world_size, model) -> str | None:
        if args.bytes or args.minbytes or args.maxbytes:
            return "pattern sharded splits a model's KV by heads: give --sizes in tokens, not --bytes"
        try:
            p, d = resolve_tp(args, world_size)
            shard_plan(model.kv_heads, p, d, model.is_mla)
        except ShardError as exc:
            return str(exc)
        return None

    def __init__(self, ctx):
        super().__init__(ctx)
        p, d = resolve_tp(ctx.args, ctx.comm.Get_size())
        self.plan = shard_plan(ctx.model.kv_heads, p, d, ctx.model.is_mla)

    def prepare(self, points: list[Point]) -> str | None:
        if self.ctx.rank == 0:
            print("sharded " + "\n".join(self.plan.describe()), flush=True)
        return None

    def bytes_per_rank(self, point: Point) -> int:
        total = 0
        for e in self.plan.edges_of(self.ctx.rank):
            s = kv_spec(self.ctx, point, e.heads)
            pay = s.payload_bytes
            total += int(pay * 2.25) if self.ctx.args.layout == "paged" else pay
            total += s.tensor_tokens(0) * s.row_elems * 8 * 3  # fill/check scratch
        return total

    def _links(self, point: Point) -> list[Link]:
        """This rank's links, channels built in the plan's global edge order on both sides."""
        ctx, rank = self.ctx, self.ctx.rank
        links = []
        for e in self.plan.edges:
            if rank not in (e.src, e.dst):
                continue
            is_sender = rank == e.src
            data = make_data(ctx, point, heads=list(e.heads), table_seed=rank)
            (data.fill if is_sender else data.clear)()
            mplan = plan_messages(data, ctx.args.granularity)
            peer = e.dst if is_sender else e.src
            ch = ctx.transport.channel(peer, mplan.buffers, is_sender)
            links.append(Link(e, peer, is_sender, data, mplan, ch, Notice(ctx.comm, peer)))
        return links

    def run_point(self, point: Point) -> list[dict]:
        ctx, plan, rank = self.ctx, self.plan, self.ctx.rank
        links = self._links(point)
        try:
            iso = [ShardHandoff(ctx, [lk for lk in links if lk.edge == e]) for e in plan.edges]
            contended = ShardHandoff(ctx, links)
            loops = interleaved_loops(ctx.comm, ctx.settings, [*iso, contended],
                                      on_iter=ctx.progress.iteration if rank == 0 else None)
            wrong = self._check(links, contended) if ctx.args.check else None
        finally:
            for lk in links:
                lk.ch.close()
        mine = [(lp.cold_ms, lp.warmup_ms, lp.samples.samples_ms) for lp in loops]
        moved = sum(lk.plan.nbytes for lk in links)
        gathered = ctx.comm.gather((mine, moved, wrong, peak_rss_bytes()), root=0)
        edge_bytes = {lk.edge: lk.plan.nbytes for lk in links if lk.is_sender}
        edge_bytes_all = ctx.comm.gather(edge_bytes, root=0)
        nmsgs = ctx.comm.gather(sum(lk.plan.n for lk in links if lk.is_sender), root=0)
        if rank != 0:
            return []
        n = loops[0].iters
        per_handoff = [[g[0][k] for g in gathered] for k in range(len(loops))]
        crit = [_critical(parts, n) for parts in per_handoff]
        iso_loops, cont = crit[:-1], crit[-1]
        # isolated critical path: each iteration's slowest edge, as if the edges ran side by side
        iso_samples = Measurement()
        for col in zip(*[lp.samples.samples_ms for lp in iso_loops], strict=True):
            iso_samples.add(max(col))
        iso = LoopResult(max(lp.cold_ms for lp in iso_loops),
                         [max(c) for c in zip(*[lp.warmup_ms for lp in iso_loops], strict=True)],
                         iso_samples, n)
        eb = {}
        for d in edge_bytes_all:
            eb.update(d)
        total = sum(eb.values())
        wrongs = [g[2] for g in gathered]
        contended_parts = per_handoff[-1]
        ratio = cont.samples.p50 / iso.samples.p50 if iso.samples.p50 > 0 else None
        edges = [{"src": e.src, "dst": e.dst, "heads": list(e.heads), "bytes": eb[e],
                  "isolated_p50_ms": lp.samples.p50, "isolated_samples_ms": lp.samples.samples_ms,
                  "isolated_gbps": gb_per_s(eb[e], lp.samples.p50)}
                 for e, lp in zip(plan.edges, iso_loops, strict=True)]
        homogeneous = plan.prefill_tp == plan.decode_tp
        common = {
            "granularity": ctx.args.granularity,
            "bytes": total,
            "messages": sum(nmsgs),
            "packed": any(lk.plan.packed for lk in links),
            "stored_tokens": kv_spec(ctx, point, [0]).tensor_tokens(0),
            "tp": plan.prefill_tp if homogeneous else None,
            "prefill_tp": plan.prefill_tp,
            "decode_tp": plan.decode_tp,
            "kv_heads": plan.kv_heads,
            "heads_split": not plan.mla,
            "replicated_heads": plan.replicated,
            "shard_note": plan.note or None,
            "send_plan": {**plan.as_dict(), "edges": edges},
            "rank_role": [plan.role(r) for r in range(plan.world)],
            "rank_heads": [plan.held(r) for r in range(plan.world)],
            "rank_bytes": [g[1] for g in gathered],
            "isolated_p50_ms": iso.samples.p50,
            "contended_p50_ms": cont.samples.p50,
            "contention_ratio": ratio,
            "aggregate_gbps": gb_per_s(total, cont.samples.p50),
            "peak_rss_bytes": [g[3] for g in gathered],
        }
        contended_rec = {
            "variant": "contended", **common, "loop": cont,
            "wrong": None if wrongs[0] is None else sum(w or 0 for w in wrongs),
            "rank_wrong": wrongs,
            "rank_p50_ms": [Measurement(p[2]).p50 if p[2] else None for p in contended_parts],
            "rank_samples_ms": [p[2] for p in contended_parts],
            "rank_cold_ms": [p[0] for p in contended_parts],
            "table_note": (f"TP {plan.prefill_tp}->{plan.decode_tp}, {len(plan.edges)} edges, "
                           f"rank bytes {[g[1] for g in gathered]}; aggregate "
                           f"{common['aggregate_gbps']:.2f} GB/s; contended/isolated p50 = "
                           + ("-" if ratio is None else f"{ratio:.2f}")
                           + (f"; {plan.note}" if plan.note else "")),
        }
        isolated_rec = {"variant": "isolated", **common, "loop": iso, "wrong": None}
        return [isolated_rec, contended_rec]

    def _check(self, links: list[Link], handoff: ShardHandoff) -> int:
        """One more contended handoff after each decode rank wiped its copies; count this rank's
        wrong elements over every head it holds."""
        ctx = self.ctx
        for lk in links:
            if not lk.is_sender:
                lk.data.clear()
                lk.plan.clear_staging()
        barrier(ctx.comm, ctx.timeout_s, "data check")
        handoff()
        wrong = sum(lk.data.count_wrong() for lk in links if not lk.is_sender)
        held = sorted(h for lk in links if not lk.is_sender for h in lk.data.spec.heads)
        if self.plan.role(ctx.rank) == "decode" and held != sorted(self.plan.held(ctx.rank)):
            print(f"sharded: decode rank {ctx.rank} holds heads {held}, expected "
                  f"{self.plan.held(ctx.rank)}", file=sys.stderr)
            wrong += 1
        return wrong

