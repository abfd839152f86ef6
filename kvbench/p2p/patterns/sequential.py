"""Sequential handoff: prefill finishes, then its whole KV moves to decode (rank 0 -> 1)."""

from __future__ import annotations

from kvbench.kv.cut import page_layout, pool_bytes
from kvbench.p2p.engine import Handoff
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.pages import Sources, cut_data, plan_pages
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


def estimate_bytes(ctx, point: Point, granularity: str) -> int:
    """Peak bytes one rank allocates: the KV (paged: pool with slack, plus staging when the
    granularity packs) and the pattern-generation scratch used for fill and check. Under a
    cut's TP pair the prefill rank holds every serving prefill rank's heads."""
    if point.raw_bytes is not None:
        return point.raw_bytes + min(point.raw_bytes, 1 << 26) * 9
    data_spec = kv_spec(ctx, point)
    payload = data_spec.payload_bytes
    row = data_spec.tensor_tokens(0) * data_spec.row_elems
    scratch = row * 8 * 3  # int64 grid + one layer's values + comparison
    if point.cut is not None and point.cut.pages:  # pools sized by the block tables
        side = "prefill" if ctx.rank == 0 else "decode"
        return pool_bytes(ctx.model, ctx.dtype, point.prompt_tokens, point.cut, side) + scratch
    if ctx.args.layout == "paged":
        pool = int(payload * 1.125) + data_spec.row_elems * data_spec.block_size * ctx.dtype.bytes * 2
        staging = payload if granularity != "block" else 0
        return pool + staging + scratch
    return payload + scratch


def pair_records(ctx, links, fields: dict, loops, wrong) -> dict | None:
    """The fields every 2-rank record shares (collective): total wrong elements, each side's
    transport breakdown, peak memory per rank, and the pieces a timed handoff over the first
    link posted (`descriptors`). Rank 0 gets `fields` with them added."""
    total = None if wrong is None else ctx.comm.allreduce(wrong)
    parts = ctx.comm.gather([lk.channel.breakdown() for lk in links if lk is not None], root=0)
    tel = ctx.comm.gather([lk.channel.telemetry() for lk in links if lk is not None], root=0)
    counts = posted_counts(ctx, links)
    rss = ctx.comm.gather(peak_rss_bytes(), root=0)
    gpu = ctx.comm.gather(peak_device_bytes(), root=0)
    if ctx.rank != 0:
        return None
    breakdown = {k: v for rank in parts for part in rank for k, v in part.items()}
    out = {**fields, "wrong": total, "breakdown_ms": breakdown, "peak_rss_bytes": rss,
           "peak_device_bytes": per_rank_or_none(gpu)}
    got = next((t for rank in tel for t in rank if t), None)
    loop = loops[0] if loops else None
    if got is not None and loop is not None:  # the transport's own fields from its telemetry
        out.update(ctx.transport.telemetry_fields(got, len(loop.samples.samples_ms),
                                                  ctx.settings.warmup))
    if counts is not None:
        out.update(descriptors_of(counts[0]))
    return out


def cut_fields(ctx, point: Point) -> dict:
    """The cut a point was measured under, as record fields (the spec's entries take its
    `block_size` and `cut`), with the TP pair and the heads the decode rank holds."""
    cut = point.cut
    if cut is None or ctx.args.layout != "paged":
        return {}
    if not cut.pages:
        return {"block_size": cut.block_size}
    lay = page_layout(ctx.model, ctx.dtype, cut)
    return {"block_size": cut.block_size, "cut": cut.spec(), "prefill_tp": cut.tp[0],
            "decode_tp": cut.tp[1], "decode_heads": list(lay.decode_heads),
            "pieces_per_page": len(lay.pieces), "heads_major": lay.hnd}


@register
class Sequential(Pattern):
    name = "sequential"
    description = "the whole KV after prefill is done, rank 0 -> rank 1"

    def bytes_per_rank(self, point: Point) -> int:
        return estimate_bytes(self.ctx, point, self.ctx.args.granularity)

    def setup(self, point: Point) -> PointRun:
        ctx, eng, cut = self.ctx, self.ctx.engine, point.cut
        if cut is not None and cut.pages:
            side = "prefill" if ctx.rank == 0 else "decode"
            caches, lay = cut_data(ctx.model, ctx.dtype, point.prompt_tokens, cut, side,
                                   ctx.dev.torch_device)
            plan = plan_pages(caches, lay, cut, side)
            data = caches[0] if len(caches) == 1 else Sources(caches)
        else:
            data = make_data(ctx, point, table_seed=ctx.rank)
            plan = plan_messages(data, ctx.args.granularity)
        link = eng.link(0, 1, data, plan)
        eng.settle()
        handoff = Handoff(eng, [link])

        def records(loops, wrong) -> list[Measured]:
            cut = cut_fields(ctx, point)
            rec = pair_records(ctx, [link], {
                "granularity": ctx.args.granularity,
                "bytes": plan.nbytes,
                "packed": plan.packed,
                "stored_tokens": (data.spec.tensor_tokens(0) if point.prompt_tokens else None),
                **cut,
                "fit_as_link": True,
                "not_link_reason": None,
            }, loops, wrong)
            if not rec:
                return []
            spec = self.entries(ctx.args.granularity, packed=plan.packed,
                                block_size=cut.get("block_size"), cut=cut.get("cut"))
            return [Measured(loops[0] if loops else None, rec, spec)]

        return PointRun(point, [handoff], handoff, [link], records)
