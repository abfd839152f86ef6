"""NCCL without a GPU: the calls kvbench makes, recorded per rank, replayed under NCCL's rules.

NCCL connects a pair of ranks lazily: the first call on the pair blocks the calling host
thread until the peer makes a call on the same pair. MPI's barrier blocks until every rank
has entered it. The real NCCL transport (`transports/nccl.py`, its pre-connect in `open()`
and its grouped posts) and the real engine run here once per rank, in-process, against a
recording stand-in for torch.distributed and for the MPI communicator; a small simulator then
replays every rank's recorded sequence together and says whether they can all finish.

Two more rules of torch's NCCL backend are modelled (issue 20): a lone `isend`/`irecv` runs on
a two-rank communicator of its own, created lazily (the pre-connect, a batched exchange on the
world communicator, never made it), while `batch_isend_irecv` uses the world communicator;
and a communicator's groups run one after another on its stream, a group's operations all at
once, so an operation completes only while the groups holding both of its ends run.

What this proves: the order of calls cannot deadlock under these rules, for these pair
layouts; a rank's posts of one step go out as groups on the pre-connected communicator, even
a single operation; and with several peers every group carries every peer's share. What it
does not: anything about NCCL's own behaviour on a GPU (scripts/gpu-check runs the real
thing, on one GPU a batched send to itself).
"""

from __future__ import annotations

import random
from argparse import Namespace
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest

from kvbench.p2p.devices import CPUDevice
from kvbench.p2p.engine import Engine, Handoff
from kvbench.p2p.layout import RawBuffer
from kvbench.p2p.messages import MessagePlan, plan_messages
from kvbench.p2p.patterns.sharded import shard_plan
from kvbench.p2p.transports import torchdist
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


WORLD = "world"


class FakeDist:
    """torch.distributed's p2p calls, recorded: ("group", work id, [(kind, peer), ...], comm);
    comm is WORLD for batch_isend_irecv and ("pair", a, b) for a lone isend/irecv."""

    P2POp = Op

    def __init__(self, log, rank):
        self.log, self.n, self.rank = log, 0, rank

    def _group(self, ops, comm):
        self.n += 1
        wid = (id(self.log), self.n)
        self.log.append(("group", wid, [("send" if o.op == self.isend else "recv", o.peer)
                                         for o in ops], comm))
        for o in ops:
            if o.op == self.irecv:
                o.tensor.fill_(o.peer)  # what the peer's pre-connect tensor holds
        return FakeWork(self.log, wid)

    def _pair(self, peer):
        return ("pair", min(self.rank, peer), max(self.rank, peer))

    def isend(self, tensor, peer):
        return self._group([Op(self.isend, tensor, peer)], self._pair(peer))

    def irecv(self, tensor, peer):
        return self._group([Op(self.irecv, tensor, peer)], self._pair(peer))

    def batch_isend_irecv(self, ops):
        return [self._group(ops, WORLD)]

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
        return obj if self.rank == root else ("tcp://127.0.0.1:1", None)


def record(rank: int, size: int, edges, monkeypatch, preconnect=None, batch=None,
           order=None, messages=1) -> list[tuple]:
    """One rank: the NCCL transport's open() (with its pre-connect), then one engine handoff
    over `edges`, `messages` messages per edge."""
    log: list[tuple] = []
    fake = FakeDist(log, rank)
    monkeypatch.setattr(torchdist, "dist", fake)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # open() must not point NCCL at a log file here
    comm = FakeComm(rank, size, log)
    ctx = TransportContext(comm, "cpu", 5.0, Namespace(), ["h"] * size, CPUDevice(), list(edges))
    t = NCCLTransport(ctx)
    if batch is not None:  # None: the transport's own setting (what a fault would change)
        t.batch_posts = batch
    if preconnect is not None:
        t.lazy_connect = preconnect
    if order is not None:
        monkeypatch.setattr(torchdist, "preconnect_order", order)
    t.open()
    t.waiter.stop()
    log.append(("connected",))  # marker: what follows is the handoff
    eng = Engine(comm, t, ctx.dev, 5.0)
    links = [eng.link(s, d, data, _plan(data, messages))
             for s, d in edges for data in [RawBuffer(64)]]
    links = [lk for lk in links if lk is not None]
    eng.settle()
    eng.run(Handoff(eng, links, idle_sleep=True))
    return log


def _plan(data: RawBuffer, messages: int) -> MessagePlan:
    if messages == 1:
        return plan_messages(data, "whole")
    step = data.nbytes // messages
    return MessagePlan([data.backing[a:a + step] for a in range(0, step * messages, step)],
                       [-1] * messages)


def simulate(logs: list[list[tuple]]) -> dict | None:
    """Replay every rank's calls together. None if all finish; else where each rank is stuck.

    Rules: a group call blocks until every pair it names is connected on its communicator,
    and a pair connects when both of its ranks stand at group calls naming each other on the
    same communicator (lazy connect). A barrier releases when every rank stands at one. A
    communicator's groups on a rank run in posting order, one at a time; an operation
    completes once the group holding its other end (n-th send with n-th receive) runs too; a
    work completes with all of its group's operations. An MPI receive completes once the
    peer sent."""
    size = len(logs)
    pc = [0] * size
    connected: set[tuple] = set()
    posted = Counter()  # (kind, src, dst) -> ops posted
    group_of: dict[tuple, object] = {}  # (kind, src, dst, n) -> work id holding it
    works: dict = {}  # work id -> [(kind, src, dst, n)]
    streams: dict[tuple, list] = defaultdict(list)  # (rank, comm) -> work ids, posting order
    stream_of: dict = {}
    done: set = set()
    mpi_sent = Counter()
    other = {"send": "recv", "recv": "send"}

    def cur(r):
        return logs[r][pc[r]] if pc[r] < len(logs[r]) else None

    def calls_at(r):
        op = cur(r)
        return {(op[3], p) for _, p in op[2]} if op and op[0] == "group" else set()

    def running(wid):
        seq = streams[stream_of[wid]]
        return all(w in done for w in seq[:seq.index(wid)])

    def finish_groups():
        changed = True
        while changed:
            changed = False
            for wid, entries in works.items():
                if wid in done or not running(wid):
                    continue
                ends = [group_of.get((other[k], s, d, n)) for k, s, d, n in entries]
                if all(g is not None and running(g) for g in ends):
                    done.add(wid)
                    changed = True

    logs = [[e for e in log if e[0] not in ("connected", "init_process_group")] for log in logs]
    progress = True
    while progress:
        progress = False
        for r in range(size):  # lazy connection: both ends at a call naming the other
            for comm, p in calls_at(r):
                if (comm, r) in calls_at(p):
                    connected.add((comm, frozenset((r, p))))
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
                comm = op[3]
                if any((comm, frozenset((r, p))) not in connected for _, p in op[2]):
                    continue
                entries = []
                for k, p in op[2]:
                    src, dst = (r, p) if k == "send" else (p, r)
                    key = (k, src, dst, posted[(k, src, dst)])
                    entries.append(key)
                    group_of[key] = op[1]
                    posted[(k, src, dst)] += 1
                works[op[1]] = entries
                streams[(r, comm)].append(op[1])
                stream_of[op[1]] = (r, comm)
            elif kind == "complete":
                finish_groups()
                if op[1] not in done:
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
    assert first[0] == "group" and first[2] == [("recv", 0)] and first[3] == WORLD
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


def _handoff_groups(log):
    return [e for e in log[log.index(("connected",)):] if e[0] == "group"]


def test_a_single_op_post_uses_the_preconnected_communicator(monkeypatch):
    """Issue 20, defect 3: one message per side is one operation; posted as a lone isend/irecv
    it would run on a lazily made pair communicator the pre-connect never touched, and the
    receiver's pre-posted irecv would block before the barrier its sender waits in."""
    logs = run_all(2, [(0, 1)], monkeypatch)
    for log in logs:
        (group,) = _handoff_groups(log)
        assert len(group[2]) == 1 and group[3] == WORLD
    assert simulate(logs) is None
    # the checker sees the fault: lone isend/irecv (what batch=False posts) hang
    plain = run_all(2, [(0, 1)], monkeypatch, batch=False)
    assert _handoff_groups(plain[1])[0][3] == ("pair", 0, 1)
    assert simulate(plain) == {0: ("barrier",), 1: _handoff_groups(plain[1])[0]}


@pytest.mark.parametrize("layout,rank", [("tp1->2", 0), ("tp2->4", 0), ("tp4->2", 4)])
def test_every_group_carries_every_peers_share(layout, rank, monkeypatch):
    """Issue 20, defect 9: a rank with two peers and more operations than one group holds
    interleaves them before cutting groups, so no peer waits for the other's blocks."""
    monkeypatch.setattr(torchdist, "GROUP_MAX", 4)
    size, edges = LAYOUTS[layout]
    groups = _handoff_groups(record(rank, size, edges, monkeypatch, messages=8))
    peers = sorted({d if s == rank else s for s, d in edges if rank in (s, d)})
    assert len(peers) == 2 and len(groups) == 4  # 2 peers x 8 messages / 4 per group
    for g in groups:
        assert sorted(p for _, p in g[2]) == sorted(peers * 2), g


def test_interleaving_keeps_each_peers_order_and_the_fault_shows():
    ops = [("send", f"a{i}", 1) for i in range(3)] + [("send", f"b{i}", 2) for i in range(5)]
    got = torchdist.interleave_by_peer(ops)
    assert [t for _, t, _ in got] == ["a0", "b0", "a1", "b1", "a2", "b2", "b3", "b4"]
    assert sorted(got) == sorted(ops)
    # link order cut into groups of 4: the first two groups name one peer each
    firsts = [{p for *_, p in ops[a:a + 4]} for a in range(0, len(ops), 4)]
    assert firsts == [{1, 2}, {2}] and {p for *_, p in ops[:3]} == {1}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_groups_cannot_deadlock(layout, monkeypatch):
    """Many messages cut into groups of 3 (each rank's groups run one after another on its
    stream): every layout still completes."""
    monkeypatch.setattr(torchdist, "GROUP_MAX", 3)
    size, edges = LAYOUTS[layout]
    assert simulate(run_all(size, edges, monkeypatch, messages=8)) is None


class _FailedWork:
    """An NCCL work that failed: is_completed() is true, wait() raises."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("NCCL communicator was aborted on rank 1\nmore lines")


def test_a_failed_work_is_not_timed_as_done():
    """Issue 20, defect 4: is_completed() is true for a failed NCCL work too; the request
    calls wait() once completion shows, and that raises a one-line TransportError."""
    from kvbench.p2p.transports.base import TransportError

    req = torchdist._PolledRequest([FakeWork([], 1), _FailedWork()])
    with pytest.raises(TransportError, match="^torch.distributed transfer failed: NCCL "
                                             "communicator was aborted on rank 1$"):
        req.test()
    ok = torchdist._PolledRequest([FakeWork([], 2)])
    assert ok.test() is True
