"""`--pattern store`: the shared KV store handoff (prefill puts the request's KV into Mooncake
Store, decode gets it into its own cache), on `--transport mooncake` (its store channel:
kvbench.p2p.transports.mooncake.store). The handoff is timed as decode sees it: put, the
put notice, and get; the put and get times of each handoff are in `breakdown_ms`
(store_put_ms, store_get_ms) and the store's counters in the record's transport_info."""

from __future__ import annotations

from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.sequential import Sequential


@register
class Store(Sequential):
    name = "store"
    description = "through a shared KV store (Mooncake Store): prefill puts, decode gets"

    def setup(self, point):
        """The sequential point, its records told how many gets missed (collective): a
        handoff whose objects were not all got back is not a transfer to fit."""
        run = super().setup(point)
        inner, ch = run.records, run.links[0].channel if run.links[0] is not None else None

        def records(loops, wrong) -> list[dict]:
            mine = sum((ch.breakdown() if ch is not None else {}).get("store_misses", []))
            missed = int(self.ctx.comm.allreduce(mine))
            out = inner(loops, wrong)
            for rec in out:
                rec["store_misses"] = missed
                if missed:
                    rec["fit_as_link"] = False
                    rec["not_link_reason"] = (f"store misses: {missed} gets did not return "
                                              "their object; times are not a transfer")
            return out

        run.records = records
        return run

    def prepare(self, points) -> str | None:
        if self.ctx.transport.name != "mooncake":
            return "pattern store runs on --transport mooncake (Mooncake Store)"
        self.ctx.transport.store_mode = True
        return super().prepare(points)
