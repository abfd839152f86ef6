"""The one handoff protocol. Every pattern is a declaration on it: which links (edges between a
prefill rank and a decode rank, each with its data, message plan and channel) take part in a
handoff, and optionally a per-layer hook (layerwise compute) on the sending side.

One handoff, on every rank that takes part:

    receivers  pre-post every receive (all peers' in one group)
    senders    pre-post the completion notices
    all        barrier (world) -> t0 (senders)
    senders    per step (the whole handoff, or one layer): hook(layer) -> produce (pack) ->
               record a readiness event -> post the step's messages with that event
    receivers  as each message lands: unpack (queued on the device), then device completion
               (synchronize) -> t1 -> one notice to each sender
    senders    every send done and every notice in -> t1

Before the first handoff the data is filled (sender) or wiped (receiver) on the device and
synchronised once (`settle`), as nccl-tests does after InitData; the data check wipes,
synchronises, hands off once more and counts wrong elements on the receivers.

Each rank returns a `Stamp` (t0 on senders, t1 everywhere); the harness turns the stamps of
all ranks into the handoff's critical path, max(t1) - min(t0) on one clock.

Connections are not made here: a lazily connecting transport (NCCL) connected every pair in
`open()`, before the first handoff (see transports/torchdist.preconnect).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvbench.p2p.harness import Notice, barrier, nap, now, wait_request
from kvbench.p2p.messages import MessagePlan
from kvbench.p2p.transports.base import TransferTimeout, Transport, wait_all


@dataclass
class Link:
    """This rank's end of one edge: its data, the message plan over it, the channel."""

    src: int
    dst: int
    is_sender: bool
    data: Any  # KVCache | RawBuffer
    plan: MessagePlan
    channel: Any  # transports.base.Channel
    notice: Notice

    @property
    def peer(self) -> int:
        return self.dst if self.is_sender else self.src


@dataclass
class Stamp:
    """One rank's view of one handoff on its own clock (perf_counter seconds)."""

    t0: float | None  # start after the barrier: senders (and ranks running a hook) only
    t1: float  # done: sender = sends done and notices in; receiver = bytes on device, notices sent


Hook = Callable[[int, Callable[[], None]], None]  # hook(layer, poll): runs before layer's posts


@dataclass
class Handoff:
    """A declared handoff: this rank's links in it (none: the rank only meets the barrier),
    and for per-layer posting the layer count and an optional hook run before each layer."""

    engine: Engine
    links: list[Link]
    layers: int = 0  # > 0: post layer by layer (each step's messages: plan.messages_for_layer)
    hook: Hook | None = None  # sender side only
    idle_sleep: bool = False  # a rank with nothing to do sleeps between barrier tests
    name: str = ""

    _layout: tuple | None = field(default=None, init=False, repr=False)

    def __call__(self) -> Stamp | None:
        return self.engine.run(self)

    def layout(self) -> tuple:
        """What every call of this handoff does, worked out once: the receiving links, the
        sending links, the receives as (link, message) and as (channel, message), and the
        steps: (layer, [(channel, message)], [(link, message)], packed links' messages)."""
        if self._layout is None:
            recv = [lk for lk in self.links if not lk.is_sender]
            send = [lk for lk in self.links if lk.is_sender]
            recv_msgs = [(lk, i) for lk in recv for i in range(lk.plan.n)]
            layers = range(self.layers) if self.layers else [None]
            steps = []
            for layer in layers:
                msgs = [(lk, i) for lk in send for i in (range(lk.plan.n) if layer is None
                                                         else lk.plan.messages_for_layer(layer))]
                packs = {}
                for lk, i in msgs:
                    if lk.plan.packed:
                        packs.setdefault(id(lk), (lk, []))[1].append(i)
                steps.append((layer, [(lk.channel, i) for lk, i in msgs], msgs,
                              list(packs.values())))
            self._layout = (recv, send, recv_msgs, [(lk.channel, i) for lk, i in recv_msgs], steps)
        return self._layout


@dataclass
class Engine:
    comm: Any  # MPI world
    transport: Transport
    device: Any  # kvbench.p2p.devices.Device
    timeout_s: float
    _inflight: list = field(default_factory=list)
    _owned: set = field(default_factory=set)

    # -- set-up ----------------------------------------------------------------

    def link(self, src: int, dst: int, data, plan: MessagePlan) -> Link | None:
        """This rank's end of the edge src -> dst over `plan` (None if the rank is on neither
        end). Both ranks call it together, edges in the same order everywhere (the channel's
        set-up is collective between the two). The first link over a data object queues its
        fill (sender) or wipe (receiver); `settle()` makes them final."""
        rank = self.comm.Get_rank()
        if rank not in (src, dst):
            return None
        is_sender = rank == src
        if id(data) not in self._owned:
            self._owned.add(id(data))
            self.device.run(data.fill if is_sender else data.clear)
        peer = dst if is_sender else src
        shape = ({"regions": plan.regions, "blocks": plan.blocks}
                 if plan.regions and self.transport.uses_regions else {})
        ch = self.transport.channel(peer, plan.buffers, is_sender, plan.layer_of, **shape)
        return Link(src, dst, is_sender, data, plan, ch, Notice(self.comm, peer))

    def settle(self) -> None:
        """Every queued fill/wipe applied before any transport may touch the buffers."""
        self._order_before_first_post()
        self._owned.clear()

    # The three orderings the protocol owes the device, named so a test can remove each one
    # and watch the data check fail (tests/plant.py):

    def _order_before_first_post(self) -> None:
        """Fills and wipes are queued work: apply them before a transport may read or write."""
        self.device.synchronize()

    def _readiness(self):
        """The event a transport that is not stream-ordered must see done before its backend
        reads a step's bytes (it holds the post until then, or waits on it)."""
        return self.device.record()

    def _complete_on_device(self) -> None:
        """Receiver: unpack and staging copies applied before the notice says 'done'."""
        self.device.synchronize()

    # -- one handoff -------------------------------------------------------------

    def run(self, h: Handoff) -> Stamp | None:
        if not h.links and h.hook is None:
            barrier(self.comm, self.timeout_s, "the handoff's start barrier",
                    pause=nap if h.idle_sleep else None)
            return None
        recv, send, recv_msgs, recv_items, steps = h.layout()
        for lk in h.links:
            lk.channel.begin_handoff()
        deadline = now() + self.timeout_s
        pending = self.transport.post_many(recv_items) if recv_items else []
        notes = [lk.notice.post_wait() for lk in send]
        pause = self.transport.between_tests
        barrier(self.comm, self.timeout_s, "the handoff's start barrier", pause=pause)
        hook = h.hook
        t0 = now() if send or hook is not None else None
        sends: list = []
        self._inflight = sends if hook is not None else []
        for layer, items, _msgs, packs in steps:
            if hook is not None:
                hook(layer, self.poll)
            if not items:
                continue
            ready = self._produce(packs) if packs or hook is not None else None
            sends += self.transport.post_many(items, ready)
        if pending:
            self._receive(recv_msgs, pending, deadline)
        t1 = None
        if recv:
            self._complete_on_device()  # unpack and staging copies landed: the KV is usable
            t1 = now()
            for lk in recv:
                lk.notice.send()
        wait_all(sends, deadline, "send")
        for note in notes:
            wait_request(note, deadline, "the completion notice from a decode rank", pause=pause)
        if t1 is None:
            t1 = now()
        for lk in h.links:
            lk.channel.end_handoff()
            lk.channel.close_count()
        return Stamp(t0, t1)

    def poll(self) -> None:
        """Test the sends still in flight (a hook calls this between chunks of compute, the
        way an engine's progress thread drives a transport that only moves data when called).
        Costs O(in flight), not O(posted)."""
        inflight = self._inflight
        if inflight:
            inflight[:] = [r for r in inflight if not r.test()]

    def _produce(self, packs: list):
        """Queue the packing of a step's messages; return the readiness event of everything
        that produced them (the packing, and whatever a hook queued before it)."""
        for lk, idx in packs:
            if len(idx) == lk.plan.n:
                self.device.run(lk.plan.pack)
            else:
                for i in idx:
                    self.device.run(partial(lk.plan.pack, i))
        return self._readiness()

    def _receive(self, recv_msgs: list, pending: list, deadline: float) -> None:
        """Complete receives in posting order (per layer: decode could start layer by layer),
        queueing each packed message's unpack as soon as it is in."""
        for k, ((lk, i), req) in enumerate(zip(recv_msgs, pending, strict=True)):
            while not req.test():
                if now() > deadline:
                    raise TransferTimeout(f"receive did not complete before the --timeout "
                                          f"({len(pending) - k} of {len(pending)} messages "
                                          "pending)")
            if lk.plan.packed:
                self.device.run(partial(lk.plan.unpack, i))

    # -- the data check ------------------------------------------------------------

    def check(self, h: Handoff, corrupt_elements: int = 0) -> int:
        """One more handoff on fresh buffers; returns this rank's wrong elements (receivers).

        Receivers wipe their KV and staging, senders their staging (so the check sees this
        handoff's packing, not a copy left by an earlier one); the wipes are synchronised
        before the first post. `corrupt_elements` (a test fault) alters the sender's bytes."""
        for lk in h.links:
            if not lk.is_sender:
                self.device.run(lk.data.clear)
            self.device.run(lk.plan.clear_staging)
        sender = next((lk for lk in h.links if lk.is_sender), None)
        if corrupt_elements and sender is not None:
            self.device.run(partial(_corrupt, sender.data, corrupt_elements))
        self._order_before_first_post()
        barrier(self.comm, self.timeout_s, "the data check's barrier")
        self.run(h)
        return sum(lk.data.count_wrong() for lk in h.links if not lk.is_sender)


def _corrupt(data, elements: int) -> None:
    import torch

    flat = data.backing.view(-1).view(torch.uint8)
    flat[: elements * data.backing.element_size()] += 1


def close_links(links: list[Link | None]) -> None:
    """Close every distinct channel (several links may share one)."""
    seen = set()
    for lk in links:
        if lk is not None and id(lk.channel) not in seen:
            seen.add(id(lk.channel))
            lk.channel.close()
