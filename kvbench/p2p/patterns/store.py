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

    def prepare(self, points) -> str | None:
        if self.ctx.transport.name != "mooncake":
            return "pattern store runs on --transport mooncake (Mooncake Store)"
        self.ctx.transport.store_mode = True
        return super().prepare(points)
