"""Sequential handoff: prefill finishes, then its whole KV moves to decode (rank 0 -> 1)."""

from __future__ import annotations

from kvbench.p2p.engine import Handoff
from kvbench.p2p.engine_shape import plan_engine
from kvbench.p2p.layout import KVCache
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.base import (
    Pattern,
    Point,
    PointRun,
    engine_pool_bytes,
    engine_shaped,
    kv_spec,
    make_data,
    make_engine_data,
    peak_device_bytes,
    peak_rss_bytes,
    per_rank_or_none,
)


def estimate_bytes(ctx, point: Point, granularity: str) -> int:
    """Peak bytes one rank allocates: the KV (paged: pool with slack, plus staging when the
    granularity packs) and the pattern-generation scratch used for fill and check."""
    if point.raw_bytes is not None:
        return point.raw_bytes + min(point.raw_bytes, 1 << 26) * 9
    data_spec = kv_spec(ctx, point)
    payload = data_spec.payload_bytes
    row = data_spec.tensor_tokens(0) * data_spec.row_elems
    scratch = row * 8 * 3  # int64 grid + one layer's values + comparison
    if engine_shaped(ctx):  # its pool is sized by the block table (a file's ids)
        return engine_pool_bytes(ctx, point) + scratch
    if ctx.args.layout == "paged":
        pool = int(payload * 1.125) + data_spec.row_elems * data_spec.block_size * ctx.dtype.bytes * 2
        staging = payload if granularity != "block" else 0
        return pool + staging + scratch
    return payload + scratch


def pair_records(ctx, links, fields: dict, loops, wrong) -> dict | None:
    """The fields every 2-rank record shares (collective): total wrong elements, each side's
    transport breakdown, peak memory per rank. Rank 0 gets `fields` with them added."""
    total = None if wrong is None else ctx.comm.allreduce(wrong)
    parts = ctx.comm.gather([lk.channel.breakdown() for lk in links if lk is not None], root=0)
    tel = ctx.comm.gather([lk.channel.telemetry() for lk in links
                           if lk is not None and hasattr(lk.channel, "telemetry")], root=0)
    rss = ctx.comm.gather(peak_rss_bytes(), root=0)
    gpu = ctx.comm.gather(peak_device_bytes(), root=0)
    if ctx.rank != 0:
        return None
    breakdown = {k: v for rank in parts for part in rank for k, v in part.items()}
    out = {**fields, "wrong": total, "breakdown_ms": breakdown, "peak_rss_bytes": rss,
           "peak_device_bytes": per_rank_or_none(gpu)}
    got = next((t for rank in tel for t in rank if t), None)
    if got is not None:
        out.update(telemetry_fields(got, loops[0] if loops else None, ctx.settings.warmup))
    return out


def telemetry_fields(tel: dict, loop, warmup: int) -> dict:
    """NIXL's per-transfer telemetry of the engine-shaped handoff, split like the samples:
    `nixl_telemetry` holds the timed handoffs' values in samples_ms order (the cold one and
    the data check's apart), and the means the engine's Prometheus histograms average."""
    if loop is None or not tel.get("post_ms"):
        return {}
    n = len(loop.samples.samples_ms)
    timed = {k: v[1 + warmup:1 + warmup + n] for k, v in tel.items()}
    if len(timed["post_ms"]) != n:  # every handoff reads its telemetry: this is a bug
        raise RuntimeError(f"telemetry for {len(timed['post_ms'])} of {n} timed handoffs")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"nixl_telemetry": {**timed, "cold": {k: v[0] for k, v in tel.items()}},
            "nixl_post_mean_ms": mean(timed["post_ms"]),
            "nixl_xfer_mean_ms": mean(timed["xfer_ms"]),
            "nixl_desc_count": timed["desc_count"][-1],
            "nixl_expected_desc_count": timed["expected_desc_count"][-1]}


@register
class Sequential(Pattern):
    name = "sequential"
    description = "the whole KV after prefill is done, rank 0 -> rank 1"

    def bytes_per_rank(self, point: Point) -> int:
        return estimate_bytes(self.ctx, point, self.ctx.args.granularity)

    def setup(self, point: Point) -> PointRun:
        ctx, eng = self.ctx, self.ctx.engine
        if engine_shaped(ctx):
            data = make_engine_data(ctx, point)
            plan = plan_engine(data)
        else:
            data = make_data(ctx, point, table_seed=ctx.rank)
            plan = plan_messages(data, ctx.args.granularity)
        link = eng.link(0, 1, data, plan)
        eng.settle()
        handoff = Handoff(eng, [link])

        def records(loops, wrong) -> list[dict]:
            rec = pair_records(ctx, [link], {
                "granularity": ctx.args.granularity,
                "bytes": plan.nbytes,
                "messages": plan.n,
                "packed": plan.packed,
                "stored_tokens": (data.spec.tensor_tokens(0) if isinstance(data, KVCache) else None),
                "loop": loops[0] if loops else None,
                "fit_as_link": True,
                "not_link_reason": None,
            }, loops, wrong)
            return [rec] if rec else []

        return PointRun(point, [handoff], handoff, [link], records)
