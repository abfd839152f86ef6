"""The per-descriptor term in a plan: how many pieces a handoff posts, what they cost, and the
smallest block size (or the merge) that keeps the handoff within a budget.

    handoff_floor_ms = setup_ms + descriptors x us_per_desc / 1000 + bytes / (GB/s x 1e9) x 1000

The count comes from the same code that cut the KV when it was measured
(kvbench.kv.cut.count_pieces): per layer, pools x pieces per page x blocks, where a TP pair
(P, D) cuts every page into one piece per serving prefill rank and part, and consecutive
whole pages join into one piece when the block ids are merged. How the fitted transport
itself posts them is its own declaration (kvbench.p2p.transports: `descriptors`; ipc copies
adjacent messages as one, so contiguous ids post one piece per run), read here without
naming any transport. A fit with a second term (NIXL joins adjacent descriptors
itself: us_per_merged_desc) adds the count left after that join. With a TP pair the bytes
are one decode rank's share of the KV, the handoff each decode rank waits for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.errors import UsageError
from kvbench.kv.cut import (
    Cut,
    count_pieces,
    declared_cuts,
    layer_blocks,
    page_layout,
    read_block_file,
)
from kvbench.kv.geometry import DType, KVSizing, ModelSpec
from kvbench.kv.shards import ShardError
from kvbench.p2p import transports
from kvbench.units import handoff_ms

CANDIDATE_BLOCK_SIZES = tuple(2 ** k for k in range(11))  # 1 .. 1024 tokens


@dataclass(frozen=True)
class PlannedCut:
    """The deployment's cut, from the plan's flags (None: the flags named no cut)."""

    cut: Cut

    @classmethod
    def from_args(cls, block_size: int | None, kv: str | None, blocks: str | None,
                  tp: str | None) -> PlannedCut | None:
        if block_size is None and kv is None and blocks is None and tp is None:
            return None
        try:
            cuts = declared_cuts([block_size or 16], kv, blocks, tp, pages=True)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if len(cuts) != 1:
            raise UsageError("plan one cut at a time: one --kv-pages, --block-ids and --tp-pair")
        return cls(cuts[0])

    def with_block_size(self, bs: int) -> Cut:
        c = self.cut
        return Cut(bs, c.kv, c.blocks, c.tp)


def posted_count(link, model: ModelSpec, dtype: DType, tokens: int, cut: Cut) -> int:
    """The descriptors the fitted link's transport posts for one prompt under one cut: its
    own declaration (kvbench.p2p.transports.base.Transport.descriptors); a transport this
    install does not have (or a link given as numbers) posts one per piece."""
    cls = transports.declared(str((link.group or {}).get("transport") or ""))
    if cls is None:
        return count_pieces(model, dtype, tokens, cut)
    return cls.descriptors(model, dtype, tokens, cut)


def counts_at(link, model: ModelSpec, dtype: DType, tokens: int, cut: Cut) -> tuple[int, int | None]:
    """(descriptors posted, descriptors left after the transport joined adjacent ones; None
    when the fit has no such term) for one prompt under one cut."""
    posted = posted_count(link, model, dtype, tokens, cut)
    if link.us_per_merged_desc is None:
        return posted, None
    return posted, count_pieces(model, dtype, tokens, cut, merge_adjacent=True)


def descriptor_ms(link, posted: int, joined: int | None) -> float:
    """The descriptors' time in a handoff (negative fitted costs used as 0)."""
    ms = posted * max(link.us_per_desc, 0.0) / 1000.0
    if joined is not None:
        ms += joined * max(link.us_per_merged_desc, 0.0) / 1000.0
    return ms


def decode_bytes(model: ModelSpec, dtype: DType, sizing: KVSizing, cut: Cut) -> int:
    """The bytes one decode rank receives under the cut's TP pair (all of them at 1:1)."""
    try:
        lay = page_layout(model, dtype, cut)
    except ShardError as exc:
        raise UsageError(f"--tp-pair {cut.tp[0]}:{cut.tp[1]}: {exc}") from None
    return sizing.kv_bytes * len(lay.decode_heads) // model.n_heads


def term(link, model: ModelSpec, dtype: DType, tokens: int, cut: Cut, scale: tuple) -> dict:
    """(bytes, descriptors, floor ms) of one prompt under one cut on a link with the term."""
    sizing = KVSizing(model, dtype, tokens, scale[0], scale[1], cut.block_size)
    nbytes = decode_bytes(model, dtype, sizing, cut)
    posted, joined = counts_at(link, model, dtype, tokens, cut)
    cost = link.for_payload(nbytes).cost
    dms = descriptor_ms(link, posted, joined)
    floor = handoff_ms(cost.setup_ms or 0.0, nbytes, cost.effective_gb_s) + dms
    return {"bytes": nbytes, "descriptors": posted, "descriptors_merged": joined,
            "descriptor_ms": dms, "floor_ms": floor}


def smallest_block_size(link, model, dtype, tokens: int, planned: PlannedCut, budget: float,
                        scale: tuple) -> int | None:
    """The smallest block size (1 .. 1024 tokens) whose handoff stays within the budget; with
    recorded block ids (file:PATH) only sizes whose request the file holds ids for."""
    held = None
    if planned.cut.blocks.startswith("file:"):
        ids = read_block_file(planned.cut.blocks[5:])
        held = min(len(ids["prefill"]), len(ids["decode"]))
    for bs in CANDIDATE_BLOCK_SIZES:
        if held is not None and layer_blocks(model, tokens, bs, 0) > held:
            continue
        if term(link, model, dtype, tokens, planned.with_block_size(bs), scale)["floor_ms"] <= budget:
            return bs
    return None


def band(link, nbytes: int, desc: int, joined: int | None) -> list[float] | None:
    """95% band of the floor from the fit's joint draws of (setup, slope, us_per_desc[,
    us_per_merged_desc])."""
    d = link.desc_draws
    if d is None or not len(d):
        return None
    floor = np.maximum(d[:, 0], 0.0) + d[:, 1] * nbytes / 1e9 + np.maximum(d[:, 2], 0.0) * desc / 1e3
    if joined is not None and d.shape[1] > 3:
        floor = floor + np.maximum(d[:, 3], 0.0) * joined / 1e3
    lo, hi = np.percentile(floor, [2.5, 97.5])
    return [round(float(lo), 6), round(float(hi), 6)]


def descriptor_fields(link, model, dtype, tokens: int, planned: PlannedCut, budget: float,
                      scale: tuple) -> dict:
    """A plan row's per-descriptor part (its floor replaces the two-term floor)."""
    cut = planned.cut
    now = term(link, model, dtype, tokens, cut, scale)
    merged = Cut(cut.block_size, cut.kv, "merged", cut.tp)
    joined = term(link, model, dtype, tokens, merged, scale)
    return {
        "block_size": cut.block_size, "kv_pages": cut.kv, "block_ids": cut.blocks,
        "tp_pair": f"{cut.tp[0]}:{cut.tp[1]}", "kv_bytes": now["bytes"],
        "descriptors": now["descriptors"], "us_per_desc": link.us_per_desc,
        **({} if now["descriptors_merged"] is None else {
            "descriptors_merged": now["descriptors_merged"],
            "us_per_merged_desc": link.us_per_merged_desc}),
        "descriptor_ms": round(now["descriptor_ms"], 6), "floor_ms": now["floor_ms"],
        "band": band(link, now["bytes"], now["descriptors"], now["descriptors_merged"]),
        "smallest_block_size_within_budget": smallest_block_size(link, model, dtype, tokens,
                                                                 planned, budget, scale),
        "merged_descriptors": joined["descriptors"],
        "merged_handoff_floor_ms": round(joined["floor_ms"], 6),
        "merged_within_budget": joined["floor_ms"] <= budget,
    }
