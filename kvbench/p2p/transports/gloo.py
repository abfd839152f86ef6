"""torch.distributed with the Gloo backend: plain TCP sockets between the ranks.

Gloo moves host memory; device buffers are staged through pinned host memory, timed. Gloo
is not stream-ordered: the staging copy (or, for host buffers, the post) waits on the
producer's readiness event.
"""

from __future__ import annotations

from kvbench.links.linkpath import LinkPath, PairFacts, by_path
from kvbench.p2p.transports import register
from kvbench.p2p.transports.staging import HostStaging
from kvbench.p2p.transports.torchdist import TorchDistTransport


@register
class GlooTransport(TorchDistTransport):
    name = "gloo"
    description = "torch.distributed Gloo over TCP (rendezvous address sent over MPI)"
    backend = "gloo"

    def _staging(self, ch) -> HostStaging:
        if not hasattr(ch, "staging"):
            dev = self.ctx.dev
            ch.staging = HostStaging(ch.buffers, dev, not dev.host_visible)
        return ch.staging

    def prepare_many(self, items, ready=None) -> list:
        """Sends: each channel's messages staged together, one host wait per channel and step."""
        out: dict[int, object] = {}
        by_channel: dict[int, list[int]] = {}
        for k, (ch, _i) in enumerate(items):
            by_channel.setdefault(id(ch), []).append(k)
        for ks in by_channel.values():
            ch = items[ks[0]][0]
            st = self._staging(ch)
            bufs = (st.to_host_many([items[k][1] for k in ks], ready) if ch.is_sender
                    else [st.host[items[k][1]] for k in ks])
            out.update(zip(ks, bufs, strict=True))
        return [out[k] for k in range(len(items))]

    def spec_options(self) -> dict:
        return {"host_staged": not self.ctx.dev.host_visible}

    def finish_recv(self, ch, i) -> None:
        self._staging(ch).to_device(i)

    def begin(self, ch) -> None:
        self._staging(ch).begin()

    def end(self, ch) -> None:
        self._staging(ch).end()

    def channel_breakdown(self, ch):
        return self._staging(ch).breakdown()

    def info(self) -> dict:
        return {**super().info(), "path": "TCP sockets (Gloo)"}

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        """Gloo's TCP sockets (a path in UCX's words, never written by Gloo, read as UCX's)."""
        path = str(info.get("path") or "")
        if path.startswith("UCX"):
            return by_path(info, pair)
        return LinkPath(frozenset({"tcp"}), path or "Gloo TCP")
