"""torch.distributed with the Gloo backend: plain TCP sockets between the ranks.

Gloo moves host memory; device buffers are staged through pinned host memory, timed. Gloo
is not stream-ordered: on an asynchronous device (CUDA) the staging copies wait on the
producer's readiness event on the device's copy stream and the sends go to Gloo once the
copies are done (polled, as host-staged MPI's); host buffers are posted once the event is done.
"""

from __future__ import annotations

from functools import partial

from kvbench.links.linkpath import LinkPath, PairFacts, by_path
from kvbench.p2p.transports import register
from kvbench.p2p.transports.base import Request, by_channel
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
        """Sends: each channel's messages staged together (on host memory: once the step's
        event is done, one wait per channel and step)."""
        out: dict[int, object] = {}
        for ks in by_channel(items):
            ch = items[ks[0]][0]
            st = self._staging(ch)
            bufs = (st.to_host_many([items[k][1] for k in ks], ready) if ch.is_sender
                    else [st.host[items[k][1]] for k in ks])
            out.update(zip(ks, bufs, strict=True))
        return [out[k] for k in range(len(items))]

    def post_many(self, items, ready=None) -> list[Request]:
        """On an asynchronous device (CUDA) a step's sends never wait on the host: each
        channel's staging copies are queued on the device's copy stream after `ready`, and
        its sends go to Gloo once the copies' event is done (HeldPosts, polled from test()),
        so a layerwise handoff's next compute is queued while this layer's copy runs."""
        dev = self.ctx.dev
        if not dev.asynchronous or dev.host_visible:
            return super().post_many(items, ready)
        out: dict[int, Request] = {}
        for ks in by_channel(items):
            sub = [items[k] for k in ks]
            ch, st = sub[0][0], self._staging(sub[0][0])
            if not ch.is_sender:
                got = super().post_many(sub)
            else:
                gate = st.to_host_later([i for _, i in sub], ready)
                bufs = [st.host[i] for _, i in sub]
                post = partial(self.post_buffers, sub, bufs)
                got = self.held_for(ch.peer).hold_requests(gate, post, len(sub))
            out.update(zip(ks, got, strict=True))
        return [out[k] for k in range(len(items))]

    def spec_options(self) -> dict:
        return {"host_staged": not self.ctx.dev.host_visible}

    def finish_recv(self, ch, i) -> None:
        self._staging(ch).to_device(i)

    def begin(self, ch) -> None:
        # nothing of an earlier (abandoned) handoff may go out in this one (the queue is the
        # peer's: every link of a handoff begins before anything is posted)
        self.held_for(ch.peer).clear()
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
