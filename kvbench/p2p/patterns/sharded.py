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

Every rank's times are on one clock (`harness.estimate_clock`: on one host perf_counter is
shared; across hosts offsets come from a ping-pong at start). A handoff starts at the first
prefill rank's start (t0, right after the world barrier) and ends when the last rank is done
(t1: a prefill rank once its sends completed and its decode peers' notices arrived, a decode
rank once its bytes are on its device and its notices are sent): the critical path is
max(t1) - min(t0) per handoff, so barrier-exit skew between ranks is inside it.
"""

from __future__ import annotations

import sys

from kvbench.cli import arg_int
from kvbench.kv.shards import Edge, ShardError, ShardPlan, _ranks, heads_by_rank, shard_plan  # noqa: F401
from kvbench.p2p.engine import Handoff
from kvbench.p2p.harness import LoopResult
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.base import (
    Measured,
    Pattern,
    Point,
    PointRun,
    descriptors_of,
    kv_spec,
    make_data,
    peak_device_bytes,
    peak_rss_bytes,
    per_rank_or_none,
    posted_counts,
)
from kvbench.records.stats import Measurement
from kvbench.units import gb_per_s


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


NOT_LINK_ISOLATED = ("bytes summed over edges, time a maximum over edges run separately: "
                     "a rate never observed")


def _isolated(edge_loops: list[LoopResult]) -> LoopResult:
    """Each round's slowest edge: the handoff time if the edges ran side by side without
    sharing anything (rounds line up: every edge ran once per round)."""
    def worst(cols):
        return [max(c) for c in zip(*cols, strict=True)]

    return LoopResult(max(lp.cold_ms for lp in edge_loops),
                      worst([lp.warmup_ms for lp in edge_loops]),
                      Measurement(worst([lp.samples.samples_ms for lp in edge_loops])),
                      edge_loops[0].iters, list(edge_loops[0].rounds))


def edge_fields(plan: ShardPlan, iso_loops: list[LoopResult], edge_desc: list, eb: dict
                ) -> list[dict]:
    """Each edge of the plan with its heads, bytes, descriptors and isolated times."""
    return [{"src": e.src, "dst": e.dst, "heads": list(e.heads), "bytes": eb[(e.src, e.dst)],
             "descriptors": d,
             "isolated_p50_ms": lp.samples.p50, "isolated_samples_ms": lp.samples.samples_ms,
             "isolated_gbps": gb_per_s(eb[(e.src, e.dst)], lp.samples.p50)}
            for e, lp, d in zip(plan.edges, iso_loops, edge_desc, strict=True)]


def table_note(plan: ShardPlan, rank_bytes: list, aggregate_gbps: float | None,
               ratio: float | None) -> str:
    """The line under the contended record's row: the plan, the aggregate rate, contention."""
    return (f"TP {plan.prefill_tp}->{plan.decode_tp}, {len(plan.edges)} edges, "
            f"rank bytes {rank_bytes}; aggregate "
            + ("-" if aggregate_gbps is None else f"{aggregate_gbps:.2f}")
            + " GB/s; contended/isolated p50 = " + ("-" if ratio is None else f"{ratio:.2f}")
            + (f"; {plan.note}" if plan.note else ""))


@register
class Sharded(Pattern):
    name = "sharded"
    description = "TP prefill ranks hand their KV-head shards to TP decode ranks (re-sharding)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("sharded pattern")
        g.add_argument("--tp", type=arg_int(1, 65536), default=None,
                       help="tensor-parallel size of both sides (world = 2 x TP; default world/2)")
        g.add_argument("--prefill-tp", type=arg_int(1, 65536), default=None,
                       help="prefill TP size (ranks 0..P-1)")
        g.add_argument("--decode-tp", type=arg_int(1, 65536), default=None,
                       help="decode TP size (the next D ranks)")

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

    def pairs(self) -> list[tuple[int, int]]:
        return [(e.src, e.dst) for e in self.plan.edges]

    def roles(self) -> tuple[list[int], list[int]]:
        p = self.plan.prefill_tp
        return list(range(p)), list(range(p, self.plan.world))

    def setup(self, point: Point) -> PointRun:
        """One link per edge this rank is on (channels built in the plan's global edge order on
        every rank); one isolated handoff per edge, and one with every edge at once."""
        ctx, eng, rank = self.ctx, self.ctx.engine, self.ctx.rank
        links: list[tuple[Edge, object]] = []
        for e in self.plan.edges:
            if rank in (e.src, e.dst):
                data = make_data(ctx, point, heads=list(e.heads), table_seed=rank)
                links.append((e, eng.link(e.src, e.dst, data, plan_messages(data, ctx.args.granularity))))
        eng.settle()
        mine = [lk for _, lk in links]
        iso = [Handoff(eng, [lk for e2, lk in links if e2 == e], idle_sleep=True,
                       name=f"{e.src}->{e.dst}") for e in self.plan.edges]
        contended = Handoff(eng, mine, name="contended")

        def records(loops, wrong) -> list[Measured]:
            if wrong is not None:
                wrong += self._held_mismatch(mine)
            return self._records(point, mine, loops, wrong)

        return PointRun(point, [*iso, contended], contended, mine, records)

    def _gather(self, links: list, wrong) -> tuple | None:
        """(per rank: bytes moved, wrong elements, peak RSS, peak device bytes; each edge's
        bytes; each edge's descriptors in the plan's order) on rank 0, None elsewhere
        (collective)."""
        ctx, plan = self.ctx, self.plan
        moved = sum(lk.plan.nbytes for lk in links)
        gathered = ctx.comm.gather((moved, wrong, peak_rss_bytes(), peak_device_bytes()), root=0)
        edge_bytes = {(lk.src, lk.dst): lk.plan.nbytes for lk in links if lk.is_sender}
        edge_bytes_all = ctx.comm.gather(edge_bytes, root=0)
        # every edge's link in the plan's global order (None where this rank is not on it)
        by_edge = {(lk.src, lk.dst): lk for lk in links}
        counts = posted_counts(ctx, [by_edge.get((e.src, e.dst)) for e in plan.edges])
        if ctx.rank != 0:
            return None
        eb = {}
        for d in edge_bytes_all:
            eb.update(d)
        return gathered, eb, [descriptors_of(c)["descriptors"] for c in counts]

    def _records(self, point: Point, links: list, loops, wrong) -> list[Measured]:
        ctx, plan = self.ctx, self.plan
        got = self._gather(links, wrong)
        if got is None:
            return []
        gathered, eb, edge_desc = got
        iso_loops, cont = loops[:-1], loops[-1]
        iso = _isolated(iso_loops)
        total = sum(eb.values())
        wrongs = [g[1] for g in gathered]
        ratio = cont.samples.p50 / iso.samples.p50 if iso.samples.p50 > 0 else None
        edges = edge_fields(plan, iso_loops, edge_desc, eb)
        homogeneous = plan.prefill_tp == plan.decode_tp
        common = {
            "granularity": ctx.args.granularity,
            "bytes": total,
            "descriptors": sum(d or 0 for d in edge_desc),
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
            "rank_bytes": [g[0] for g in gathered],
            "isolated_p50_ms": iso.samples.p50,
            "contended_p50_ms": cont.samples.p50,
            "contention_ratio": ratio,
            "aggregate_gbps": gb_per_s(total, cont.samples.p50),
            "peak_rss_bytes": [g[2] for g in gathered],
            "peak_device_bytes": per_rank_or_none([g[3] for g in gathered]),
        }
        contended_rec = {
            "variant": "contended", **common,
            "fit_as_link": True, "not_link_reason": None,
            "wrong": None if wrongs[0] is None else sum(w or 0 for w in wrongs),
            "rank_wrong": wrongs,
            "rank_p50_ms": [Measurement(r).p50 if r else None for r in cont.rank_ms],
            "rank_samples_ms": cont.rank_ms,
            "rank_start_ms": cont.rank_start_ms,
            "rank_cold_ms": cont.rank_cold_ms,
        }
        note = table_note(plan, common["rank_bytes"], common["aggregate_gbps"], ratio)
        isolated_rec = {"variant": "isolated", **common, "wrong": None,
                        "fit_as_link": False, "not_link_reason": NOT_LINK_ISOLATED}
        gran, packed = ctx.args.granularity, common["packed"]
        return [Measured(iso, isolated_rec, self.entries(gran, variant="isolated", packed=packed)),
                Measured(cont, contended_rec,
                         self.entries(gran, variant="contended", packed=packed), note)]

    def _held_mismatch(self, links: list) -> int:
        """1 if this decode rank does not hold exactly the heads the plan gives it."""
        ctx = self.ctx
        held = sorted(h for lk in links if not lk.is_sender for h in lk.data.spec.heads)
        if self.plan.role(ctx.rank) == "decode" and held != sorted(self.plan.held(ctx.rank)):
            print(f"sharded: decode rank {ctx.rank} holds heads {held}, expected "
                  f"{self.plan.held(ctx.rank)}", file=sys.stderr)
            return 1
        return 0
