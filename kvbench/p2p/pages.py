"""One side's paged KV under a cut (kvbench.kv.cut): the caches it holds and the messages
it moves, as zero-copy byte views of its own tensors.

The cut's arithmetic (block tables, page layout, pool sizes) is torch-free and lives in
kvbench.kv.cut; this module is where it meets torch.
"""

from __future__ import annotations

from kvbench.kv.cut import Cut, PageLayout, Region, block_table, layer_blocks, page_layout
from kvbench.model import DType, ModelSpec
from kvbench.p2p.layout import KVCache, KVSpec, as_bytes
from kvbench.p2p.messages import MessagePlan


def cut_data(model: ModelSpec, dtype: DType, tokens: int, cut: Cut, side: str, device):
    """The caches one side holds for a cut: decode, one cache with its heads; prefill, one
    cache per serving prefill rank. Values are seeded by global head, so the decode rank
    checks every element it received whoever sent it."""
    lay = page_layout(model, dtype, cut)
    need = layer_blocks(model, tokens, cut.block_size, 0)
    heads = [lay.decode_heads] if side == "decode" else list(lay.source_heads)
    out = []
    for k, held in enumerate(heads):  # (each serving prefill rank draws its own scattered ids)
        spec = KVSpec(model, dtype, tokens, list(held), "paged", cut.block_size,
                      pages=cut.kv, hnd=lay.hnd)
        out.append(KVCache(spec, device, table=block_table(cut.blocks, need, side, seed=k)))
    return out, lay


class Sources:
    """The caches of the serving prefill ranks, held by one rank: filled, wiped and checked
    together (the engine treats them as one data object)."""

    def __init__(self, caches: list):
        self.caches = caches
        self.spec = caches[0].spec
        self.backing = caches[0].backing  # (a planted corruption alters the first)

    def fill(self) -> None:
        for c in self.caches:
            c.fill()

    def clear(self) -> None:
        for c in self.caches:
            c.clear()

    def count_wrong(self) -> int:
        return sum(c.count_wrong() for c in self.caches)


def plan_pages(caches: list, lay: PageLayout, cut: Cut, side: str):
    """One side's MessagePlan under the page plan: messages region-major (pool, piece of the
    page, then the request's blocks in table order), each a byte view of the side's own KV
    (zero copy). `plan.regions` (kvbench.p2p.transports.nixl.engine_shape.Region) and `plan.blocks` give each
    message's (region, block) for NIXL's descriptor lists; merged block ids join runs of
    consecutive whole pages and carry no per-block ids."""
    peer_side = "prefill" if side == "decode" else "decode"
    flats = [as_bytes(c.backing) for c in caches]
    pools = [c.pools() for c in caches]
    spec = caches[0].spec
    need = max(spec.layer_blocks(layer) for layer in range(spec.model.layers))
    peer = block_table(cut.blocks, need, peer_side)
    join = cut.merged and lay.whole_pages
    bufs, layers, regions, blocks = [], [], [], []
    for q in range(len(pools[0])):
        layer = q // lay.pools_per_layer
        for piece in lay.pieces:
            src = 0 if side == "decode" else piece.source
            pool, cache = pools[src][q], caches[src]
            size = pool.element_size()
            stride = pool.stride(0) * size
            base = pool.data_ptr() + (piece.local if side == "decode" else piece.remote)
            r = len(regions)
            regions.append(Region(base, stride, pool.shape[0], piece.length))
            table = cache.block_ids[layer]
            mine, theirs = (table, peer[:len(table)])
            spans = _spans(mine, theirs) if join else [(i, i + 1) for i in range(len(mine))]
            off0 = cache.backing.data_ptr()
            for a, b in spans:
                start = base + mine[a] * stride - off0
                bufs.append(flats[src][start:start + (b - a) * piece.length])
                layers.append(layer)
                blocks.append((r, mine[a]))
    plan = MessagePlan(bufs, layers, _cache=caches[0])
    plan.regions, plan.blocks = regions, (None if join else blocks)
    return plan


def _spans(mine: list[int], theirs: list[int]) -> list[tuple[int, int]]:
    """[a, b) runs of table entries consecutive on both sides."""
    out, a = [], 0
    for i in range(1, len(mine) + 1):
        if i == len(mine) or not (mine[i] == mine[i - 1] + 1 and theirs[i] == theirs[i - 1] + 1):
            out.append((a, i))
            a = i
    return out
