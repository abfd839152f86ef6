"""NCCL without a GPU: the calls kvbench makes, recorded per rank, replayed under NCCL's rules.

NCCL connects a pair of ranks lazily: the first call on the pair blocks the calling host
thread until the peer makes a call on the same pair. MPI's barrier blocks until every rank
has entered it. The real NCCL transport (`transports/nccl.py`, its pre-connect in `open()`
and its grouped posts) and the real engine run here once per rank, in-process, against a
recording stand-in for torch.distributed and for the MPI communicator; a small simulator then
replays every rank's recorded sequence together and says whether they can all finish.

What this proves: the order of calls cannot deadlock under the lazy-connect rule, for these
pair layouts, and a rank's posts of one step go out as one group. What it does not: anything
about NCCL's own behaviour on a GPU (scripts/gpu-check runs the real thing).
"""

from __future__ import annotations

import random
from argparse import Namespace
from collections import Counter
from dataclasses import dataclass

import pytest

from kvbench.p2p.devices import CPUDevice
from kvbench.p2p.engine import Engine, Handoff
from kvbench.p2p.layout import RawBuffer
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.patterns.sharded import shard_plan
from kvbench.p2p.transports import _torchdist
from kvbench.p2p.transports.base import TransportContext
from kvbench.p2p.transports.nccl import NCCLTransport


@dataclass
class Op:
    op: object
    tensor: object
    peer: int


class FakeWork:
    def __init__(self, log, wid):
        self.log, self.wid, self.logged = log, wid, False

    def _complete(self):
        if not self.logged:
            self.log.append(("complete", self.wid))
            self.logged = True

    def is_completed(self) -> bool:
        self._complete()
        return True

    def wait(self) -> None:
        self._complete()


class FakeDist:
    """torch.distributed's p2p calls, recorded: ("group", work id, [(kind, peer), ...])."""

    P2POp = Op

    def __init__(self, log):
        self.log, self.n = log, 0

    def _group(self, ops):
        self.n += 1
        wid = (id(self.log), self.n)
        self.log.append(("group", wid, [("send" if o.op == self.isend else "recv", o.peer)
                                         for o in ops]))
        for o in ops:
            if o.op == self.irecv:
                o.tensor.fill_(o.peer)  # what the peer's pre-connect tensor holds
        return FakeWork(self.log, wid)

    def isend(self, tensor, peer):
        return self._group([Op(self.isend, tensor, peer)])

    def irecv(self, tensor, peer):
        return self._group([Op(self.irecv, tensor, peer)])

    def batch_isend_irecv(self, ops):
        return [self._group(ops)]

    def init_process_group(self, *args, **kwargs):
        self.log.append(("init_process_group",))


class FakeReq:
    def __init__(self, log, entry):
        self.log, self.entry, self.logged = log, entry, False

    def Test(self) -> bool:
        if not self.logged and self.entry:
            self.log.append(self.entry)
            self.logged = True
        return True


class FakeComm:
    """The MPI calls the engine makes: barriers, notice receives and sends, recorded."""

    def __init__(self, rank, size, log):
        self.rank, self.size, self.log = rank, size, log
        self.irecvs = Counter()

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Ibarrier(self):
        self.log.append(("barrier",))
        return FakeReq(self.log, None)

    def Irecv(self, buf, source, tag):
        n = self.irecvs[source]
        self.irecvs[source] += 1
        return FakeReq(self.log, ("mpi_complete", source, n))

    def Send(self, buf, dest, tag):
        self.log.append(("mpi_send", dest))

    def bcast(self, obj, root=0):
        return obj


def record(rank: int, size: int, edges, monkeypatch, preconnect=None, batch=None,
           order=None) -> list[tuple]:
    """One rank: the NCCL transport's open() (with its pre-connect), then one engine handoff
    over `edges`."""
    log: list[tuple] = []
    fake = FakeDist(log)
    monkeypatch.setattr(_torchdist, "dist", fake)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # open() must not point NCCL at a log file here
    comm = FakeComm(rank, size, log)
    ctx = TransportContext(comm, "cpu", 5.0, Namespace(), ["h"] * size, CPUDevice(), list(edges))
    t = NCCLTransport(ctx)
    if batch is not None:  # None: the transport's own setting (what a fault would change)
        t.batch_posts = batch
    if preconnect is not None:
        t.lazy_connect = preconnect
    if order is not None:
        monkeypatch.setattr(_torchdist, "preconnect_order", order)
    t.open()
    t.waiter.stop()
    log.append(("connected",))  # marker: what follows is the handoff
    eng = Engine(comm, t, ctx.dev, 5.0)
    links = [eng.link(s, d, RawBuffer(64), plan_messages(RawBuffer(64), "whole"))
             for s, d in edges]
    links = [lk for lk in links if lk is not None]
    eng.settle()
    eng.run(Handoff(eng, links, idle_sleep=True))
    return log


def simulate(logs: list[list[tuple]]) -> dict | None:
    """Replay every rank's calls together. None if all finish; else where each rank is stuck.

    Rules: a group call blocks until every pair it names is connected, and a pair connects
    when both of its ranks stand at group calls naming each other (lazy connect). A barrier
    releases when every rank stands at one. A work completes once the peer has posted the
    matching send/receive (n-th with n-th). An MPI receive completes once the peer sent."""
    size = len(logs)
    pc = [0] * size
    connected: set[frozenset] = set()
    posted = Counter()  # (kind, src, dst) -> ops posted
    works: dict = {}  # work id -> [(kind, me, peer, index)]
    mpi_sent = Counter()

    def cur(r):
        return logs[r][pc[r]] if pc[r] < len(logs[r]) else None

    def peers_at_group(r):
        op = cur(r)
        return {p for _, p in op[2]} if op and op[0] == "group" else set()

    logs = [[e for e in log if e[0] not in ("connected", "init_process_group")] for log in logs]
    progress = True
    while progress:
        progress = False
        for r in range(size):  # lazy connection: both ends at a call naming the other
            for p in peers_at_group(r):
                if r in peers_at_group(p):
                    connected.add(frozenset((r, p)))
        if all(cur(r) and cur(r)[0] == "barrier" for r in range(size)):
            for r in range(size):
                pc[r] += 1
            progress = True
            continue
        for r in range(size):
            op = cur(r)
            if op is None or op[0] == "barrier":
                continue
            kind = op[0]
            if kind == "group":
                if any(frozenset((r, p)) not in connected for _, p in op[2]):
                    continue
                entries = []
                for k, p in op[2]:
                    src, dst = (r, p) if k == "send" else (p, r)
                    entries.append((k, src, dst, posted[(k, src, dst)]))
                    posted[(k, src, dst)] += 1
                works[op[1]] = entries
            elif kind == "complete":
                other = {"send": "recv", "recv": "send"}
                if not all(posted[(other[k], s, d)] > n for k, s, d, n in works[op[1]]):
                    continue
            elif kind == "mpi_send":
                mpi_sent[(r, op[1])] += 1
            elif kind == "mpi_complete":
                if mpi_sent[(op[1], r)] <= op[2]:
                    continue
            pc[r] += 1
            progress = True
    stuck = {r: cur(r) for r in range(size) if cur(r) is not None}
    return stuck or None


def run_all(size, edges, monkeypatch, **kw):
    return [record(r, size, edges, monkeypatch, **kw) for r in range(size)]


LAYOUTS = {
    "pair": (2, [(0, 1)]),
    "tp2->2": (4, [(e.src, e.dst) for e in shard_plan(8, 2, 2).edges]),
    "tp4->2": (6, [(e.src, e.dst) for e in shard_plan(8, 4, 2).edges]),
    "tp2->4": (6, [(e.src, e.dst) for e in shard_plan(8, 2, 4).edges]),
    "tp1->2": (3, [(e.src, e.dst) for e in shard_plan(1, 1, 2).edges]),
    "tp4->4 replicated": (8, [(e.src, e.dst) for e in shard_plan(2, 4, 4).edges]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_preconnect_then_handoff_cannot_deadlock(layout, monkeypatch):
    size, edges = LAYOUTS[layout]
    logs = run_all(size, edges, monkeypatch)
    assert simulate(logs) is None
    for r, log in enumerate(logs):  # the pre-connect precedes the handoff
        connects = [e for e in log[:log.index(("connected",))] if e[0] == "group"]
        mine = sorted({d if s == r else s for s, d in edges if r in (s, d)})
        assert sorted(p for e in connects for _, p in e[2]) == sorted(mine * 2)


@pytest.mark.parametrize("seed", range(20))
def test_preconnect_order_is_deadlock_free_for_any_pairs(seed, monkeypatch):
    rng = random.Random(seed)
    size = rng.randint(2, 8)
    edges = sorted({(a, b) for a, b in ((rng.randrange(size), rng.randrange(size))
                                        for _ in range(rng.randint(1, 12))) if a != b})
    if not edges:
        edges = [(0, 1)]
    logs = [record(r, size, edges, monkeypatch) for r in range(size)]
    # the handoff itself may hold a rank both sending and receiving: only the connect phase
    # matters here, so replay up to each rank's first barrier
    heads = [log[:log.index(("connected",))] for log in logs]
    assert simulate(heads) is None


def test_without_preconnect_the_first_handoff_deadlocks(monkeypatch):
    """Finding 1: the receiver's pre-posted irecv is its first NCCL call on the pair and blocks
    before the barrier the sender waits in. The simulator must see it (the fix is needed)."""
    logs = run_all(2, [(0, 1)], monkeypatch, preconnect=False)
    stuck = simulate(logs)
    first = logs[1][2]  # after init and the marker: the receiver's pre-posted irecv
    assert first[0] == "group" and first[2] == [("recv", 0)]
    assert stuck == {0: ("barrier",), 1: first}


def test_a_rank_local_connect_order_can_deadlock(monkeypatch):
    """The checker can fail: ranks connecting their pairs in an order of their own (here
    descending peer on odd ranks) wait on each other in a cycle."""
    def own_order(pairs):
        return sorted({(min(a, b), max(a, b)) for a, b in pairs})

    size, edges = 3, [(0, 1), (1, 2), (0, 2)]
    logs = []
    for r in range(size):
        order = own_order if r % 2 == 0 else (lambda pairs: list(reversed(own_order(pairs))))
        log = record(r, size, edges, monkeypatch, order=order)
        logs.append(log[:log.index(("connected",))])
    assert simulate(logs) is not None


@pytest.mark.parametrize("layout,rank,peers", [("tp4->2", 4, [0, 1]), ("tp2->4", 0, [2, 3])])
def test_a_steps_posts_to_several_peers_are_one_group(layout, rank, peers, monkeypatch):
    """Finding 4: a decode rank's receives from two prefill ranks (4->2), and a prefill rank's
    sends to two decode ranks (2->4), are posted as one batch_isend_irecv group, so NCCL does
    not serialise them on one stream."""
    size, edges = LAYOUTS[layout]
    log = record(rank, size, edges, monkeypatch)
    handoff_groups = [e for e in log[log.index(("connected",)):] if e[0] == "group"]
    assert len(handoff_groups) == 1, handoff_groups
    assert sorted(p for _, p in handoff_groups[0][2]) == peers
    unbatched = record(rank, size, edges, monkeypatch, batch=False)
    groups = [e for e in unbatched[unbatched.index(("connected",)):] if e[0] == "group"]
    assert len(groups) == len(peers)  # the fault shows: one call per peer
