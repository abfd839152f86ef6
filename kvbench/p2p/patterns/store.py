"""`--pattern store`: the shared KV store handoff (prefill puts the request's KV into Mooncake
Store, decode gets it into its own cache), on `--transport mooncake` (its store channel:
kvbench.p2p.transports.mooncake.store). The handoff is timed as decode sees it: put, the
put notice, and get; the put and get times of each handoff are in `breakdown_ms`
(store_put_ms, store_get_ms) and the store's counters in the record's transport_info. The
put and the get are also written as records of their own (variants `put` and `get`, the same
handoffs' times), so `kvbench fit` fits each as setup + bytes / rate beside the handoff."""

from __future__ import annotations

from dataclasses import replace

from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.base import Measured
from kvbench.p2p.patterns.sequential import Sequential


@register
class Store(Sequential):
    name = "store"
    description = "through a shared KV store (Mooncake Store): prefill puts, decode gets"

    def setup(self, point):
        """The sequential point, with the store's fields."""
        return self._with_store_fields(super().setup(point))

    def _with_store_fields(self, run):
        """`run`'s records told how many gets missed (collective): a handoff whose objects
        were not all got back is not a transfer to fit; and what the pool holds."""
        inner, ch = run.records, run.links[0].channel if run.links[0] is not None else None

        def records(loops, wrong) -> list[Measured]:
            mine = sum((ch.breakdown() if ch is not None else {}).get("store_misses", []))
            missed = int(self.ctx.comm.allreduce(mine))
            out = inner(loops, wrong)
            pool = self.ctx.transport.segment * self.ctx.comm.Get_size()
            for rec in (m.fields for m in out):
                rec["store_misses"] = missed
                # what the mounted pool holds of this request's KV (one replica each)
                rec["store_pool_bytes"] = pool
                rec["store_capacity_requests"] = pool // rec["bytes"] if rec["bytes"] else None
                if missed:
                    rec["fit_as_link"] = False
                    rec["not_link_reason"] = (f"store misses: {missed} gets did not return "
                                              "their object; times are not a transfer")
            return out + [v for rec in out for v in self._parts(rec)]

        run.records = records
        return run

    def _parts(self, rec: Measured) -> list[Measured]:
        """The put and the get of the same handoffs as variants `put` and `get` (rank 0): each
        its own record, spec and fit group, so `kvbench fit` fits each as setup + bytes /
        rate. Their times come from the channel's per-handoff lists (cold first, then the
        warm-up, then the timed handoffs, in the harness's order)."""
        from kvbench.p2p.harness import LoopResult
        from kvbench.records.stats import Measurement

        loop, w = rec.loop, self.ctx.settings.warmup
        if loop is None:
            return []
        n, out = len(loop.samples), []
        for variant, key in (("put", "store_put_ms"), ("get", "store_get_ms")):
            times = rec.fields["breakdown_ms"].get(key, [])
            if len(times) < 1 + w + n:
                continue
            part = LoopResult(cold_ms=times[0], warmup_ms=times[1:1 + w],
                              samples=Measurement(times[1 + w:1 + w + n]), iters=loop.iters,
                              rounds=loop.rounds)
            out.append(Measured(part, {**rec.fields, "variant": variant},
                                replace(rec.spec, variant=variant)))
        return out

    def prepare(self, points) -> str | None:
        if self.ctx.transport.name != "mooncake":
            return f"pattern {self.name} runs on --transport mooncake (Mooncake Store)"
        self.ctx.transport.store_mode = True
        return super().prepare(points)
