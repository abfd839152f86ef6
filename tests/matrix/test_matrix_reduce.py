"""Rank 0 that does not hold the job (issue 44 item 2): the matrix's stamps are reduced where
they are made (each pair on its receiver, from its own and its sender's stamps, after one
Allreduce of the rounds' first starts), then gathered. On planted stamps (skewed clocks,
late starts, missing samples) the new reduction gives each pair exactly what the old one
gave (every rank's stamps gathered on rank 0, critical_paths, then pair_loop): the same
samples to the bit, so the same records. The ranks are threads here, with a communicator
that does the three collectives in memory; the real jobs are tests/matrix/test_matrix_mpi*.py."""

from __future__ import annotations

import random
import threading

import pytest
from mpi4py import MPI

from kvbench.p2p.harness import LocalLoop, critical_paths
from kvbench.p2p.patterns.matrix import pair_loop, reduce_pairs, schedule


class ThreadComm:
    """One rank's view of n threads' collectives (Allreduce MIN, alltoall, gather to 0)."""

    def __init__(self, shared: dict, rank: int, n: int):
        self.shared, self.rank, self.n = shared, rank, n

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.n

    def _swap(self, mine):
        box, bar = self.shared["box"], self.shared["barrier"]
        box[self.rank] = mine
        bar.wait()
        every = list(box)
        bar.wait()
        return every

    def Allreduce(self, send, recv, op):
        assert op is MPI.MIN
        every = self._swap(send.copy())
        recv[...] = every[0]
        for a in every[1:]:
            recv[...] = recv.clip(max=a)

    def alltoall(self, out):
        return [part[self.rank] for part in self._swap(out)]

    def gather(self, mine, root=0):
        every = self._swap(mine)
        return every if self.rank == root else None

    def allgather(self, mine):
        return self._swap(mine)


def run_ranks(n: int, fn) -> list:
    shared = {"box": [None] * n, "barrier": threading.Barrier(n, timeout=30)}
    out: list = [None] * n
    errors: list = []

    def body(rank):
        try:
            out[rank] = fn(ThreadComm(shared, rank, n))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def planted_stamps(n: int, rounds, warm: int, iters: int, seed: int) -> list[list[LocalLoop]]:
    """Each rank's LocalLoops, one per round: a sender's (t0, t1), a receiver's (None, t1),
    an idle rank's None; clocks skewed by whole seconds, starts late by up to 3 ms, one
    sample of one round missing on every rank."""
    rng = random.Random(seed)
    skew = [float(r) + rng.random() for r in range(n)]
    out: list[list[LocalLoop]] = [[] for _ in range(n)]
    for k, rnd in enumerate(rounds):
        cols = 1 + warm + iters
        per = {r: [None] * cols for r in range(n)}
        for c in range(cols):
            if k == 1 and c == cols - 1:
                continue  # a sample nobody took
            base = 100.0 + k + c * 0.05
            for s, r in rnd:
                t0 = base + rng.uniform(0, 0.003)
                per[s][c] = (t0 + skew[s], t0 + rng.uniform(0.001, 0.02) + skew[s])
                per[r][c] = (None, t0 + rng.uniform(0.001, 0.02) + skew[r])
        for r in range(n):
            col = per[r]
            out[r].append(LocalLoop(col[0], col[1:1 + warm], col[1 + warm:], list(range(iters))))
    return out


def old_way(n, rounds, stamps, offsets):
    """Every rank's stamps gathered on rank 0, critical_paths, then pair_loop (as before)."""
    def fn(comm):
        return critical_paths(comm, stamps[comm.Get_rank()], offsets)

    loops = run_ranks(n, fn)[0]
    return {(s, r): pair_loop(loop, s, r, len(rnd) == 1)
            for loop, rnd in zip(loops, rounds, strict=True) for s, r in rnd}


def new_way(n, rounds, stamps, offsets):
    out = run_ranks(n, lambda comm: reduce_pairs(comm, rounds, stamps[comm.Get_rank()], offsets))
    assert all(o is None for o in out[1:])
    return out[0]


@pytest.mark.parametrize("n,kind,warm", [(6, "rounds", 0), (7, "rounds", 2), (4, "serial", 2),
                                         (2, "rounds", 1)])
def test_each_pair_reduced_on_its_receiver_is_what_rank_0_computed(n, kind, warm):
    rounds = schedule(n, kind)
    stamps = planted_stamps(n, rounds, warm, iters=5, seed=n)
    offsets = [float(r) for r in range(n)]  # not the skews: clocks stay a little apart
    old, new = old_way(n, rounds, stamps, offsets), new_way(n, rounds, stamps, offsets)
    assert sorted(new) == sorted(old) == sorted(p for rnd in rounds for p in rnd)
    for pair, a in old.items():
        b = new[pair]
        assert b.samples.samples_ms == a.samples.samples_ms  # exactly: the same records
        assert (b.cold_ms, b.warmup_ms, b.iters, b.rounds) == \
            (a.cold_ms, a.warmup_ms, a.iters, a.rounds)
        assert b.samples.summary() == a.samples.summary()
    missing = [p for p in rounds[1]]
    assert all(len(new[p].samples.samples_ms) == 4 and new[p].rounds == [0, 1, 2, 3]
               for p in missing)


def test_a_changed_stamp_changes_only_its_pair():
    """The comparison can fail: one receiver's end moved 1 ms later changes its pair's sample
    (and no other pair's), so a reduction reading the wrong rank's stamps would be caught."""
    n, rounds = 6, schedule(6)
    stamps = planted_stamps(n, rounds, 0, iters=3, seed=1)
    before = new_way(n, rounds, stamps, None)
    s, r = rounds[2][0]
    lp = stamps[r][2]
    t0, t1 = lp.samples[0]
    lp.samples[0] = (t0, t1 + 0.001 + 1.0)  # past every other end of its round
    after = new_way(n, rounds, stamps, None)
    changed = [p for p in before if before[p].samples.samples_ms != after[p].samples.samples_ms]
    assert changed == [(s, r)]
