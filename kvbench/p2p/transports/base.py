"""The one small interface every transport implements.

A transport moves a list of *messages* (contiguous byte tensors) from one rank to a
peer. The harness never knows how: it asks for a `Channel` between two ranks over a
fixed set of buffers, posts messages, and polls `Request`s until they complete. Each
backend keeps its quirks (rendezvous, staging, registration, notifications) inside
its own module.

A transport also owns what the rest of kvbench knows of it (its *declaration*, the hooks at
the end of `Transport`): its flags and their cross-checks (`add_arguments`,
`check_arguments`, `page_plan`, `check_cuts`), the fields it adds to a record
(`record_fields`, `record_field_names`, `telemetry_fields`), how many descriptors a handoff
posts (`descriptors`, what `kvbench plan` counts) and which kind of link its
`transport_info` names (`link_path`, what `kvbench fit --expect-link`, the matrix and the
report read). So a new backend is one module under transports/: nothing outside it names it
(tests/p2p/test_planted_transport.py plants one to keep it so).

Why the declaration must import without torch: the fit, the matrix, the plan and the report
read it (through kvbench.p2p.transports: classify_record, descriptors) on installs without
torch and mpi4py (the `p2p` extra). The registry imports every transport module to find the
declarations, so a transport module, and what it imports at module level, imports neither:
the runtime reaches them inside methods or through kvbench.p2p.registry.LazyModule. This
module is torch-free for the same reason.
"""

from __future__ import annotations

import argparse
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.links.linkpath import LinkPath, PairFacts, by_path


class TransportError(RuntimeError):
    """A transfer failed or stalled; the harness turns this into a clean abort."""


class TransferTimeout(TransportError):
    pass


class Reported(TransportError):
    """This rank's failure, already told to its peer (which raises PeerReported): the two can
    end together (a barrier, then a normal exit) instead of by MPI_Abort, which may end the
    job before the launcher has forwarded this rank's error line. `everyone`: every rank of
    the job knows (an error agreed over MPI), not only the pair."""

    def __init__(self, message: str, everyone: bool = False):
        super().__init__(message)
        self.everyone = everyone


class PeerReported(TransportError):
    """The peer rank's failure, learnt from the peer (or found by both ranks alike): the peer
    prints its one line and ends the job, so this rank ends without a line of its own (one
    error line per failure, not one per rank)."""


def seen_by_both(rank: int, peer: int, message: str) -> TransportError:
    """A problem both ranks of a pair find alike (their set-ups disagree): the lower rank
    reports it, the other ends quietly."""
    return (Reported if rank < peer else PeerReported)(message)


class Request(ABC):
    """One posted send or receive."""

    @abstractmethod
    def test(self) -> bool:
        """True once complete. Must not block; calling it also drives progress."""


def wait_all(requests: Sequence[Request], deadline: float, what: str = "transfer") -> None:
    """Poll until every request completes; past `deadline` (perf_counter) raise TransferTimeout.

    Busy-polling is deliberate: it is what MPI progress engines do, and sleeping would add
    scheduler latency to the very thing being timed.
    """
    pending = [r for r in requests if not r.test()]
    while pending:
        if time.perf_counter() > deadline:
            raise TransferTimeout(f"{what} did not complete before the --timeout "
                                  f"({len(pending)} of {len(requests)} still pending)")
        pending = [r for r in pending if not r.test()]


def by_channel(items: Sequence[tuple[Channel, int]]) -> list[list[int]]:
    """The positions of (channel, message) items grouped by channel, channels in the order
    first seen and each channel's positions in order."""
    groups: dict[int, list[int]] = {}
    for k, (ch, _i) in enumerate(items):
        groups.setdefault(id(ch), []).append(k)
    return list(groups.values())


class HeldPosts:
    """Posts that may go out only once their step's event is done, released in posting order.

    A transport that is not stream-ordered must not hand its backend a message before the
    bytes are final. Waiting on the event on the host (Event.wait) would stop the host from
    queueing the next layer's compute, so a layerwise handoff could not overlap: instead each
    step's post is held with its gate (the readiness event, or the staging copies' event) and
    released by whoever polls (`release`, from a request's test), oldest first, up to the first
    gate not yet done: a later step's bytes are never handed over before an earlier step's.
    The order holds within one queue: a backend that matches a peer's messages in order (MPI
    on one communicator and tag, Gloo) keeps one queue per peer, shared by every channel to
    it (Transport.held_for).

    With `--no-layer-poll` nothing tests the requests while the layers are queued, so held
    posts go out only once the engine waits for the sends, after the last layer is queued."""

    __slots__ = ("_held",)

    def __init__(self):
        self._held: deque[tuple[Any, Callable[[], object]]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, gate, post: Callable[[], object]) -> None:
        """Run `post()` once `gate.query()` is true (None: as soon as the queue reaches it)."""
        self._held.append((gate, post))

    def hold_requests(self, gate, post: Callable[[], Sequence[Request]], n: int) -> list[Request]:
        """`n` requests that stand for what `post()` returns once the gate is done: each
        releases what it can when tested, then answers for its own posted request."""
        reqs = [_HeldRequest(self) for _ in range(n)]

        def go() -> None:
            for r, posted in zip(reqs, post(), strict=True):
                r.posted = posted
        self.hold(gate, go)
        return reqs

    def release(self) -> None:
        """Post every held step whose gate is done, oldest first (never blocks)."""
        held = self._held
        while held and (held[0][0] is None or held[0][0].query()):
            held.popleft()[1]()

    def clear(self) -> None:
        """Forget what is held (an abandoned handoff's posts must not go out in the next)."""
        self._held.clear()


class _HeldRequest(Request):
    __slots__ = ("held", "posted")

    def __init__(self, held: HeldPosts):
        self.held, self.posted = held, None

    def test(self) -> bool:
        if self.posted is None:
            self.held.release()
            if self.posted is None:
                return False
        return self.posted.test()


@dataclass
class TransportContext:
    """What a transport may use: the MPI world (for rendezvous and metadata), the device,
    the timeout, the parsed command line (for its own flags), and every (src, dst) pair of
    ranks that will exchange data (so a lazily connecting backend can connect them all in
    `open()`, before anything is timed)."""

    comm: Any  # mpi4py.MPI.Comm
    device: str  # "cpu", "cuda" or "cpu-async" (the Device's name)
    timeout_s: float
    options: argparse.Namespace
    hosts: list[str] = field(default_factory=list)
    dev: Any = None  # kvbench.p2p.devices.Device (None: a plain CPU device)
    pairs: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self):
        if self.dev is None:
            from kvbench.p2p.devices import make_device

            self.dev = make_device(self.device)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


class Channel(ABC):
    """A fixed set of message buffers between this rank and one peer.

    The sender builds it with `send` buffers, the receiver with `recv` buffers of the same
    sizes, in the same order; both sides call the constructor collectively (a backend may
    exchange metadata here). `post(i)` starts message i on this side. The engine has made
    the buffers' contents final on the device (filled, cleared: synchronised) before the
    first post; later producers are announced through `post`'s `ready` event.

    Descriptors: each backend calls `count_posted(n)` where it hands pieces to the transport
    itself (a NIXL transfer list's entries, an MPI or Gloo send, an ipc copy), on the side
    that moves the data; the engine closes the count after every handoff (`close_count`), so
    `posted_per_handoff` is what the transport was actually given, one entry per handoff.
    """

    def __init__(self, transport: Transport, peer: int, buffers: Sequence, is_sender: bool,
                 layer_of: Sequence[int] | None = None):
        self.transport = transport
        self.peer = peer
        self.buffers = list(buffers)
        self.is_sender = is_sender
        self.layer_of = list(layer_of) if layer_of is not None else [-1] * len(self.buffers)
        self.posted_now = 0
        self.posted_per_handoff: list[int] = []

    def count_posted(self, n: int = 1) -> None:
        """`n` more pieces handed to the transport in this handoff, by this side."""
        self.posted_now += n

    def close_count(self) -> None:
        """End of a handoff (the engine calls it): its count joins `posted_per_handoff`."""
        self.posted_per_handoff.append(self.posted_now)
        self.posted_now = 0

    @abstractmethod
    def post(self, i: int, ready=None) -> Request:
        """Start sending (sender) or receiving (receiver) message i.

        `ready` (sender only; None when nothing was produced since the data was set up) is
        the device Event recorded right after message i's bytes were produced (packed,
        computed). A transport that is not stream-ordered must not let its bytes be read
        before `ready` is done: it holds the post until `ready.query()` says so (HeldPosts,
        released from its requests' test(): the host goes on queueing work) or waits on it
        (`ready.wait()`; the engine hands every message of one production step the same
        event, so that is one real wait per step). A stream-ordered transport (NCCL) may
        enqueue after the producer on the device instead."""

    def begin_handoff(self) -> None:
        """Called on both sides before each handoff, outside the timed window."""

    def end_handoff(self) -> None:
        """Called on both sides after each handoff (timed window closed)."""

    def breakdown(self) -> dict[str, list[float]]:
        """Optional per-handoff component times in ms (e.g. staging, registration)."""
        return {}

    def telemetry(self) -> dict[str, list]:
        """The backend's own per-handoff figures ({name: one value per handoff, cold and
        warm-up included}), which the transport's `telemetry_fields` turns into record
        fields; {} when it keeps none."""
        return {}

    def close(self) -> None:
        """Release registrations and handles. Must be safe to call on every path."""


def cancel_pending(requests) -> None:
    """Cancel every MPI request not yet complete; best effort, for close and abort paths (a
    peer that has gone may leave a send that never completes)."""
    for r in requests:
        try:
            if not r.Test():
                r.Cancel()
        except Exception:  # noqa: BLE001 - best effort on the abort path
            pass


class TimedParts:
    """A channel's named part times in ms, kept for `breakdown`: `_add` sums into the current
    figure (this handoff's, or the set-up's), `_flush` closes it (one entry per figure and
    handoff; a one-element list for the set-up). The channel sets `self.cur = {}` and
    `self.per = {}` before its set-up."""

    cur: dict[str, float]
    per: dict[str, list[float]]

    def _add(self, name: str, ms: float) -> None:
        self.cur[name] = self.cur.get(name, 0.0) + ms

    def _flush(self) -> None:
        for k, v in self.cur.items():
            self.per.setdefault(k, []).append(v)
        self.cur = {}

    def breakdown(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self.per.items()}


class Transport(ABC):
    """A way of moving bytes between ranks. Subclasses register themselves by `name`."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    gpu_only: ClassVar[bool] = False
    stream_ordered: ClassVar[bool] = False  # ops run after earlier work on the device stream
    # What the harness's own waits (the start barrier, the completion notice) do between two
    # tests: None spins (MPI's progress engines' way). A transport that models an engine whose
    # threads yield or sleep while they wait (the engine-shaped NIXL handoff) sets its way, so
    # the harness does not take the core from the transport's own threads as no engine does.
    between_tests: Callable[[], None] | None = None
    # True: channel() takes the page plan's region table and (region, block) per message
    # (`regions=`, `blocks=`) to address the KV as an engine does (NIXL's engine shape)
    uses_regions: bool = False

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        self._held_by_peer: dict[int, HeldPosts] = {}

    def held_for(self, peer: int) -> HeldPosts:
        """The posts to `peer` held for their bytes (HeldPosts), one queue for every channel to
        it: a backend that matches a peer's messages in posting order (MPI on one communicator
        and tag, Gloo) must not let one channel's sends overtake another's."""
        return self._held_by_peer.setdefault(peer, HeldPosts())

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this transport's own flags (prefixed with its name)."""

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """Why this transport cannot run here (missing package, no GPU), or None."""
        return None

    def refusal(self) -> str | None:
        """Why this transport cannot run on this world (ctx.hosts, ctx.pairs are known), the
        same line on every rank; None: it can. Asked before anything is set up."""
        return None

    def open(self) -> None:
        """Collective connection set-up (all ranks call it)."""

    @abstractmethod
    def channel(self, peer: int, buffers: Sequence, is_sender: bool,
                layer_of: Sequence[int] | None = None) -> Channel:
        """A channel to `peer` over these buffers (both sides call it together). `layer_of`
        gives each message's layer (-1: all layers), for backends that group by layer."""

    def post_many(self, items: Sequence[tuple[Channel, int]], ready=None) -> list[Request]:
        """Post several (channel, message) at once, possibly to several peers, all produced by
        the step `ready` marks; one Request per item, in order. A backend that serialises
        separate posts (NCCL: one stream per communicator) overrides this to post them as one
        group."""
        return [ch.post(i, ready) for ch, i in items]

    @staticmethod
    def post_by_channel_runs(items: Sequence[tuple[Channel, int]], ready=None) -> list[Request]:
        """post_many for backends whose channels post a run of their own messages at once
        (ch.post_many): consecutive items of one channel go together, order kept."""
        out: list[Request] = []
        k = 0
        while k < len(items):
            ch = items[k][0]
            j = k + 1
            while j < len(items) and items[j][0] is ch:
                j += 1
            out += ch.post_many([i for _, i in items[k:j]], ready)
            k = j
        return out

    def spec_options(self) -> dict:
        """The options that change what this transport measures (scalars): written into
        every record's spec, so records made with different ones are never pooled."""
        return {}

    def info(self) -> dict:
        """What actually carried the data, as far as the backend can tell."""
        return {}

    def note_peer(self, peer: int) -> None:
        """Whatever the backend said since the last note came from this rank's work with
        `peer` (connecting, a first handoff): a backend whose log names no peer (UCX's
        protocol tables) keeps it for `info_by_pair`. Local, no communication."""

    def info_by_pair(self, info: dict, pairs: Sequence[tuple[int, int]]) -> dict:
        """{(src, dst): what carried that pair's bytes}, collective (every rank calls it with
        the same pairs). By default every pair gets the run's `info`: a backend that cannot
        tell pairs apart (MPI, Gloo) says nothing per pair it does not know."""
        return {tuple(p): info for p in pairs}

    def yardsticks(self, fields: dict | None) -> dict[str, float | None]:
        """--baseline: the transport's own benchmark on the point's bytes (`fields`: the first
        measured record's fields on rank 0, None elsewhere), as {kind: GB/s} on rank 0, listed
        after the generic yardsticks so kvbench's ratio (`vs_baseline`) is to it. Collective.
        Default: none."""
        return {}

    def record_fields(self) -> dict:
        """Top-level fields this transport adds to every record (e.g. the operation measured,
        so that fits group by it). Every key is one of `record_field_names`."""
        return {}

    def close(self) -> None:
        """Collective tear-down."""

    # -- the declaration: what the rest of kvbench knows of this transport ---------------
    # Class-level and torch-free (the module docstring says why): the flags' checks run
    # before any rank allocates, the rest is read by the fit, the matrix, the plan and the
    # report without the runtime. Defaults suit a transport with no flags of its own that
    # posts one descriptor per piece and writes its path in words the link module knows.

    # Every top-level record field `record_fields` and `telemetry_fields` may write, so a
    # reader knows whose they are without running the transport.
    record_field_names: ClassVar[tuple[str, ...]] = ()
    # True: the transport moves pieces adjacent in memory on both sides as one (ipc's one
    # copy per run): a handoff's `descriptors` counts the runs, and `descriptors` says so.
    joins_adjacent: ClassVar[bool] = False

    @classmethod
    def check_arguments(cls, args: argparse.Namespace, world_size: int) -> None:
        """Cross-checks of this transport's own flags, on every rank alike before anything is
        allocated. Called for every registered transport, chosen or not (its flags given
        with another transport may be refused here). Raises kvbench.errors.UsageError with
        one line; the default checks nothing."""

    @classmethod
    def page_plan(cls, args: argparse.Namespace) -> bool:
        """True when these flags make this transport address the KV by the page plan
        (kvbench.kv.cut) although no page option was given (NIXL's engine shape)."""
        return False

    @classmethod
    def check_cuts(cls, args: argparse.Namespace, cuts: Sequence) -> None:
        """Refuse declared cuts (kvbench.kv.cut.Cut) these flags cannot measure, after the
        cuts themselves were checked; UsageError with one line. Default: all are fine."""

    @classmethod
    def telemetry_fields(cls, telemetry: dict[str, list], timed: int, warmup: int) -> dict:
        """Record fields from a channel's `telemetry()` (one value per handoff: the cold
        one, `warmup` more, then `timed` timed ones and the data check's). Default: none."""
        return {}

    @classmethod
    def descriptors(cls, model, dtype, tokens: int, cut) -> int:
        """Descriptors one handoff of `tokens` posts under the page plan's `cut` (what its
        channels `count_posted`, and what `kvbench plan` counts for a fit of this
        transport's records): kvbench.kv.cut.count_pieces, runs of adjacent pieces when the
        transport `joins_adjacent`."""
        from kvbench.kv.cut import count_pieces  # (pydantic-backed model types: on use)

        return count_pieces(model, dtype, tokens, cut, cls.joins_adjacent)

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        """The kind of link a record of this transport took, from its `transport_info` (what
        `info()` wrote, older records' forms included) and its pair's facts (where the KV
        lived, hosts, GPUs: kvbench.links.linkpath.pair_facts), in the link module's
        vocabulary (kinds, LinkPath, causes). Default: the link module's rules for a path in
        words it knows (UCX's, TCP), else unknown."""
        return by_path(info, pair)
