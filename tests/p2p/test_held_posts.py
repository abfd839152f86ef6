"""HeldPosts (kvbench.p2p.transports.base): a step's post held until its gate is done, polled,
released oldest first; the held requests answer for what was posted. Each rule is planted
out below and the test sees it."""

from __future__ import annotations

from types import SimpleNamespace

from kvbench.p2p.transports.base import HeldPosts, Request
from kvbench.p2p.transports.gloo import GlooTransport
from kvbench.p2p.transports.mpi import MPITransport


class Gate:
    def __init__(self, done=False):
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class Posted(Request):
    def __init__(self, name, log):
        self.name, self.log, self.done = name, log, False

    def test(self) -> bool:
        self.log.append(("tested", self.name))
        return self.done


def test_posts_go_out_in_order_once_their_gates_are_done():
    held, out = HeldPosts(), []
    first, second = Gate(), Gate(done=True)
    held.hold(first, lambda: out.append("a"))
    held.hold(second, lambda: out.append("b"))
    held.hold(None, lambda: out.append("c"))  # no gate: as soon as the queue reaches it
    held.release()
    assert out == [] and len(held) == 3  # b's gate is done, but a's is not: nothing overtakes
    first.done = True
    held.release()
    assert out == ["a", "b", "c"] and len(held) == 0
    held.release()
    assert out == ["a", "b", "c"]  # each post runs once


def test_clear_drops_what_is_held():
    held, out = HeldPosts(), []
    gate = Gate()
    held.hold(gate, lambda: out.append("old"))
    held.clear()
    gate.done = True
    held.release()
    assert out == [] and len(held) == 0


def test_held_requests_release_when_tested_and_answer_for_their_post():
    held, log = HeldPosts(), []
    gate = Gate()
    posted = [Posted("x", log), Posted("y", log)]
    reqs = held.hold_requests(gate, lambda: posted, 2)
    assert not reqs[0].test() and gate.queries == 1 and log == []  # not posted yet
    gate.done = True
    assert not reqs[1].test()  # released now: y is posted, and tested, not done
    assert log == [("tested", "y")]
    posted[0].done = True
    assert reqs[0].test() and log[-1] == ("tested", "x")


def test_one_queue_per_peer_for_every_channel_to_it():
    """MPI and Gloo match a peer's messages in posting order: two channels to one peer must
    share a queue (a queue per channel could let the second channel's sends overtake)."""
    for cls in (MPITransport, GlooTransport):
        t = cls(SimpleNamespace())  # not opened: the queues need no MPI or torch.distributed
        a, b, c = t.held_for(1), t.held_for(1), t.held_for(2)
        assert a is b and a is not c, cls
