"""torch.distributed with the Gloo backend: plain TCP sockets between the ranks.

Gloo moves host memory; device buffers are staged through pinned host memory, timed.
"""

from __future__ import annotations

from kvbench.transports import register
from kvbench.transports._torchdist import TorchDistTransport
from kvbench.transports.staging import HostStaging


@register
class GlooTransport(TorchDistTransport):
    name = "gloo"
    description = "torch.distributed Gloo over TCP (rendezvous address sent over MPI)"
    backend = "gloo"

    def _staging(self, ch) -> HostStaging:
        if not hasattr(ch, "staging"):
            ch.staging = HostStaging(ch.buffers)
        return ch.staging

    def prepare(self, ch, i):
        st = self._staging(ch)
        if not st.active:
            return ch.buffers[i]
        return st.to_host(i) if ch.is_sender else st.host[i]

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
