"""The shared harness: timing, warm-up, adaptive iteration counts, completion notices,
barriers with a deadline, and progress. Patterns and transports are thin on top of it.

How a handoff is timed (one clock, the sender's):

    receiver: pre-post every receive  ->  barrier  ->  wait (unpack, device sync)  ->  notice
    sender:   barrier  ->  t0  ->  pack + post every send  ->  sends done + notice  ->  t1

`t1 - t0` covers the sender's start until the receiver holds every byte, plus one one-way
latency of the 1-byte notice, which is measured separately (ping-pong, half the round
trip) and recorded as `notice_ms`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbench.stats import Measurement, percentile
from kvbench.transports.base import TransferTimeout

NOTICE_TAG = 7001
PING_TAG = 7002


def now() -> float:
    return time.perf_counter()


IDLE_POLL_S = 200e-6


def wait_request(req, deadline: float, what: str, idle: bool = False) -> None:
    """Poll an mpi4py request until done or the deadline passes. `idle` ranks (not timed)
    sleep between tests so they leave the CPUs to the ranks being measured."""
    while not req.Test():
        if now() > deadline:
            raise TransferTimeout(f"{what}: no answer before the --timeout")
        if idle:
            time.sleep(IDLE_POLL_S)


def barrier(comm, timeout_s: float, what: str = "barrier", idle: bool = False) -> None:
    """A barrier that cannot hang forever if a peer died or stopped answering."""
    wait_request(comm.Ibarrier(), now() + timeout_s, f"{what} (a peer stopped answering)", idle)


class Notice:
    """The 1-byte 'I hold every byte' message from receiver to sender, on MPI."""

    def __init__(self, comm, peer: int):
        import numpy as np

        self.comm, self.peer = comm, peer
        self.buf = np.zeros(1, dtype=np.uint8)

    def post_wait(self):
        return self.comm.Irecv(self.buf, source=self.peer, tag=NOTICE_TAG)

    def send(self) -> None:
        self.comm.Send(self.buf, dest=self.peer, tag=NOTICE_TAG)


def notice_latency_ms(comm, a: int, b: int, timeout_s: float, rounds: int = 200) -> float | None:
    """One-way latency of a 1-byte MPI message between ranks a and b (median RTT / 2).

    Collective over `comm`; ranks other than a and b only take part in the barrier.
    Returns the figure on rank a, None elsewhere."""
    import numpy as np

    buf = np.zeros(1, dtype=np.uint8)
    rank = comm.Get_rank()
    barrier(comm, timeout_s, "notice latency")
    rtts = []
    deadline = now() + timeout_s
    for _ in range(rounds):
        if rank == a:
            t0 = now()
            comm.Send(buf, dest=b, tag=PING_TAG)
            wait_request(comm.Irecv(buf, source=b, tag=PING_TAG), deadline, "notice ping")
            rtts.append((now() - t0) * 1e3)
        elif rank == b:
            wait_request(comm.Irecv(buf, source=a, tag=PING_TAG), deadline, "notice ping")
            comm.Send(buf, dest=a, tag=PING_TAG)
    return percentile(rtts, 50) / 2 if rank == a else None


@dataclass
class LoopSettings:
    warmup: int = 2
    iters: int = 20
    min_iters: int = 5
    seconds_per_point: float = 4.0  # adaptive: fewer iterations for very large payloads


def choose_iters(settings: LoopSettings, warm_ms: float) -> int:
    """Requested iterations, cut down so a point takes about `seconds_per_point`, never < min."""
    if warm_ms <= 0 or math.isnan(warm_ms):
        return settings.iters
    fit = int(settings.seconds_per_point * 1e3 / warm_ms)
    return max(settings.min_iters, min(settings.iters, fit))


@dataclass
class LoopResult:
    cold_ms: float | None
    warmup_ms: list[float]
    samples: Measurement
    iters: int


def timed_loop(comm, settings: LoopSettings, handoff: Callable[[], float | None],
               timer_rank: int = 0, on_iter: Callable[[int, int], None] | None = None) -> LoopResult:
    """Cold handoff, warm-up, then timed handoffs. Collective over `comm`.

    `handoff()` returns the handoff time in ms on `timer_rank` (None elsewhere); the
    iteration count is decided there from the warm-up and broadcast, so every rank runs
    the same number of handoffs."""
    rank = comm.Get_rank()
    cold = handoff()
    warm = [handoff() for _ in range(settings.warmup)]
    if rank == timer_rank:
        basis = [w for w in warm if w is not None] or [cold or 0.0]
        n = choose_iters(settings, min(basis))
    else:
        n = None
    n = comm.bcast(n, root=timer_rank)
    samples = Measurement()
    for i in range(n):
        ms = handoff()
        if ms is not None:
            samples.add(ms)
        if on_iter:
            on_iter(i + 1, n)
    return LoopResult(cold if rank == timer_rank else None,
                      [w for w in warm if w is not None], samples, n)


@dataclass
class Progress:
    """Progress on stderr, rank 0 only: one line per point, live counts on a terminal."""

    enabled: bool = True
    total: int = 0
    done: int = 0
    t_start: float = field(default_factory=now)
    _label: str = ""

    def start(self, label: str) -> None:
        self._label = label
        if self.enabled:
            print(f"[{self.done + 1}/{self.total}] {label} ...", file=sys.stderr, flush=True)

    def iteration(self, i: int, n: int) -> None:
        if self.enabled and sys.stderr.isatty():
            print(f"\r    timed {i}/{n}", end="", file=sys.stderr, flush=True)

    def finish(self, summary: str) -> None:
        self.done += 1
        if self.enabled:
            end = "\r" if sys.stderr.isatty() else ""
            print(f"{end}    {summary}  (elapsed {now() - self.t_start:.1f} s)", file=sys.stderr,
                  flush=True)



def interleaved_loops(comm, settings: LoopSettings, handoffs: list[Callable[[], float | None]],
                      on_iter: Callable[[int, int], None] | None = None) -> list[LoopResult]:
    """Several handoffs of one point measured in the same run, round-robin. Collective.

    Each handoff gets its own cold run and warm-up; then every round runs each handoff
    once, starting one further along each round, so drifting load on a shared machine
    falls on all of them alike instead of on whichever ran last. The iteration count
    comes from the slowest rank's warm-up times (one round's sum) and is the same for
    every handoff. Each rank keeps the times its own calls returned (None: not timed
    there); take the maximum across ranks where a handoff spans several (the sharded
    pattern's critical path)."""
    k = len(handoffs)
    cold = [h() for h in handoffs]
    warm: list[list[float]] = [[] for _ in handoffs]
    for _ in range(settings.warmup):
        for j, h in enumerate(handoffs):
            ms = h()
            if ms is not None:
                warm[j].append(ms)
    mine = [min(w) if w else (c or 0.0) for w, c in zip(warm, cold, strict=True)]
    per_round = sum(max(col) for col in zip(*comm.allgather(mine), strict=True))
    n = choose_iters(settings, per_round)
    samples = [Measurement() for _ in handoffs]
    for i in range(n):
        for j in range(k):
            at = (i + j) % k
            ms = handoffs[at]()
            if ms is not None:
                samples[at].add(ms)
        if on_iter:
            on_iter(i + 1, n)
    return [LoopResult(c, w, s, n) for c, w, s in zip(cold, warm, samples, strict=True)]
