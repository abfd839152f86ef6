"""Sequential handoff: prefill finishes, then its whole KV moves to decode (rank 0 -> 1)."""

from __future__ import annotations

import torch

from kvbench.harness import barrier, timed_loop
from kvbench.layout import KVCache
from kvbench.messages import plan_messages
from kvbench.patterns import register
from kvbench.patterns.base import PairHandoff, Pattern, Point, kv_spec, make_data, peak_rss_bytes


def estimate_bytes(ctx, point: Point, granularity: str) -> int:
    """Peak bytes one rank allocates: the KV (paged: pool with slack, plus staging when the
    granularity packs) and the pattern-generation scratch used for fill and check."""
    if point.raw_bytes is not None:
        return point.raw_bytes + min(point.raw_bytes, 1 << 26) * 9
    data_spec = kv_spec(ctx, point)
    payload = data_spec.payload_bytes
    row = data_spec.tensor_tokens(0) * data_spec.row_elems
    scratch = row * 8 * 3  # int64 grid + one layer's values + comparison
    if ctx.args.layout == "paged":
        pool = int(payload * 1.125) + data_spec.row_elems * data_spec.block_size * ctx.dtype.bytes * 2
        staging = payload if granularity != "block" else 0
        return pool + staging + scratch
    return payload + scratch


def check_handoff(ctx, data, plan, handoff, is_receiver: bool) -> int:
    """One more handoff after the receiver wiped its copy; count wrong elements there."""
    if is_receiver:
        data.clear()
        plan.clear_staging()
    elif ctx.args.debug_corrupt_elements:  # injected fault: the sender's bytes go out wrong
        flat = data.backing.view(-1).view(torch.uint8)
        flat[: ctx.args.debug_corrupt_elements * data.backing.element_size()] += 1
    barrier(ctx.comm, ctx.timeout_s, "data check")
    handoff()
    wrong = data.count_wrong() if is_receiver else 0
    return ctx.comm.allreduce(wrong)


@register
class Sequential(Pattern):
    name = "sequential"
    description = "the whole KV after prefill is done, rank 0 -> rank 1"

    def bytes_per_rank(self, point: Point) -> int:
        return estimate_bytes(self.ctx, point, self.ctx.args.granularity)

    def run_point(self, point: Point) -> list[dict]:
        ctx = self.ctx
        rank = ctx.rank
        is_sender, peer = rank == 0, 1 - rank
        data = make_data(ctx, point, table_seed=rank)
        (data.fill if is_sender else data.clear)()
        plan = plan_messages(data, ctx.args.granularity)
        ch = ctx.transport.channel(peer, plan.buffers, is_sender)
        try:
            handoff = PairHandoff(ctx, ch, plan, peer, is_sender)
            loop = timed_loop(ctx.comm, ctx.settings, handoff,
                              on_iter=ctx.progress.iteration if rank == 0 else None)
            wrong = check_handoff(ctx, data, plan, handoff, not is_sender) if ctx.args.check else None
            parts = ctx.comm.gather(ch.breakdown(), root=0)
        finally:
            ch.close()
        rss = ctx.comm.gather(peak_rss_bytes(), root=0)
        if rank != 0:
            return []
        breakdown = {k: v for part in parts for k, v in part.items()}
        return [{
            "granularity": ctx.args.granularity,
            "bytes": plan.nbytes,
            "messages": plan.n,
            "packed": plan.packed,
            "stored_tokens": (data.spec.tensor_tokens(0) if isinstance(data, KVCache) else None),
            "loop": loop,
            "wrong": wrong,
            "breakdown_ms": breakdown,
            "peak_rss_bytes": rss,
        }]
