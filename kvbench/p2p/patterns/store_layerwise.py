"""`--pattern store-layerwise`: the shared KV store, layer by layer. Prefill puts layer l's
objects into Mooncake Store and announces layer l (a small notice per layer, as the whole
store pattern's put notice); decode gets layer l as soon as it is announced, while prefill
puts layer l+1. It is to `--pattern store` what `layerwise` is to `sequential`: the same
engine, declared per layer (`Handoff(layers=L)`: the engine posts each layer's messages in
turn, and the store channel puts a layer when its last message is posted).

A sample is the handoff as decode sees it: from the start barrier until decode has got the
last layer and told prefill so (the engine's critical path, as for the whole pattern).
`breakdown_ms` has per layer (L entries per handoff, in order): `store_layer_put_ms`,
`store_layer_put_end_ms` (prefill), `store_layer_get_ms`, `store_layer_get_start_ms`
(decode); both stamps are ms since prefill's first put of the handoff began, on the job's
common clock (harness.Clock). Per handoff, as for the whole pattern: `store_put_ms` and
`store_get_ms` (the layers' sums), `store_misses`, `store_put_rejected`; the store's own
counters in transport_info. Keys: one object per message (per block with
`--granularity block`, per layer and K/V part with `--granularity layer`), per handoff.

`store_overlap_ms` (per timed handoff) = prefill's last put end - decode's first get start:
> 0 when decode was reading while prefill was still putting. No put and get variants: the
whole store pattern fits each hop; here they overlap, and the handoff is the figure."""

from __future__ import annotations

from kvbench.p2p.engine import Handoff
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.base import Measured, Point, PointRun, make_data
from kvbench.p2p.patterns.layerwise import layer_granularity
from kvbench.p2p.patterns.sequential import cut_fields, estimate_bytes, pair_records
from kvbench.p2p.patterns.store import Store
from kvbench.records.stats import percentile


def overlap_ms(bd: dict, layers: int, first: int, n: int) -> list[float]:
    """Per handoff `first`..`first + n - 1`: prefill's last put end minus decode's first get
    start (ms, one timeline), from the per-layer stamps in `bd` (L entries per handoff)."""
    ends, starts = bd.get("store_layer_put_end_ms", []), bd.get("store_layer_get_start_ms", [])
    out = []
    for h in range(first, first + n):
        if len(ends) < (h + 1) * layers or len(starts) < (h + 1) * layers:
            break
        out.append(ends[(h + 1) * layers - 1] - starts[h * layers])
    return out


@register
class StoreLayerwise(Store):
    name = "store-layerwise"
    description = ("through Mooncake Store layer by layer: decode gets layer l while prefill "
                   "puts layer l+1")

    @classmethod
    def layout_error(cls, args, world_size, model) -> str | None:
        err = super().layout_error(args, world_size, model)
        if err:
            return err
        if args.bytes or args.minbytes or args.maxbytes:
            return (f"pattern {cls.name} moves a model's KV layer by layer: give --sizes in "
                    "tokens, not --bytes")
        return None

    def bytes_per_rank(self, point: Point) -> int:
        return estimate_bytes(self.ctx, point, layer_granularity(self.ctx.args.granularity))

    def setup(self, point: Point) -> PointRun:
        """One link at the layer granularity ('whole' becomes 'layer'), its store channel in
        per-layer mode, and one handoff posted layer by layer."""
        ctx, eng = self.ctx, self.ctx.engine
        gran, L = layer_granularity(ctx.args.granularity), ctx.model.layers
        data = make_data(ctx, point, table_seed=ctx.rank)
        plan = plan_messages(data, gran)
        link = eng.link(0, 1, data, plan)
        offset = ctx.clock.offset_s[ctx.rank] if ctx.clock is not None else 0.0
        link.channel.by_layer(offset)
        eng.settle()
        handoff = Handoff(eng, [link], layers=L, name=self.name)

        def records(loops, wrong) -> list[Measured]:
            loop, cut = (loops[0] if loops else None), cut_fields(ctx, point)
            rec = pair_records(ctx, [link], {
                "granularity": gran, "bytes": plan.nbytes, "packed": plan.packed,
                "stored_tokens": data.spec.tensor_tokens(0), "layers": L, **cut,
                "fit_as_link": True, "not_link_reason": None}, loops, wrong)
            if not rec:
                return []
            spec = self.entries(gran, packed=plan.packed, block_size=cut.get("block_size"),
                                cut=cut.get("cut"))
            return [Measured(loop, rec, spec, self._overlap(rec, loop))]

        return self._with_store_fields(PointRun(point, [handoff], handoff, [link], records))

    def _overlap(self, rec: dict, loop) -> str | None:
        """The timed handoffs' overlap (see the module doc) into `rec`; the table's note."""
        L, w = rec["layers"], self.ctx.settings.warmup
        n = len(loop.samples.samples_ms) if loop is not None else 0
        bd = rec["breakdown_ms"]
        over = overlap_ms(bd, L, 1 + w, n)  # after the cold handoff and the warm-up
        rec["store_overlap_ms"] = over
        if not over:
            return None
        p50 = rec["store_overlap_p50_ms"] = percentile(over, 50)
        put = percentile(bd.get("store_layer_put_ms") or [0.0], 50)
        get = percentile(bd.get("store_layer_get_ms") or [0.0], 50)
        head = f"{L} layers: put {put:.2f} ms, get {get:.2f} ms per layer (p50); "
        return head + (f"decode's first get began {p50:.2f} ms before prefill's last put ended"
                       if p50 > 0 else f"no overlap (first get {-p50:.2f} ms after the last put)")

    def _parts(self, rec: Measured) -> list[Measured]:
        return []
