"""The shared harness: the loop that times handoffs (cold run, warm-up, adaptive iteration
count, interleaved rounds), the critical path across ranks on one clock, completion notices,
barriers with a deadline, and progress. The handoff protocol itself is `kvbench.p2p.engine`.

A sample is one handoff's critical path: max over ranks of t1 minus min over senders of t0,
every stamp moved onto rank 0's clock (`Clock`). For a pair that is the sender's t0 to the
moment the decode rank's 1-byte completion notice arrived; the notice's one-way latency is
measured separately (ping-pong, half the round trip) and recorded as `notice_ms`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbench.p2p.transports.base import TransferTimeout
from kvbench.p2p.watchdog import WATCHDOG
from kvbench.records.stats import Measurement, percentile

NOTICE_TAG = 7001
PING_TAG = 7002


def now() -> float:
    return time.perf_counter()


IDLE_POLL_S = 200e-6


def nap() -> None:
    """An idle rank's pause between two tests: it leaves the CPUs to the ranks being measured."""
    time.sleep(IDLE_POLL_S)


def wait_request(req, deadline: float, what: str, pause: Callable[[], None] | None = None) -> None:
    """Poll an mpi4py request until done or the deadline passes, calling `pause` between tests
    (None: spin; `nap` for ranks not timed; a transport's own way, Transport.between_tests)."""
    while not req.Test():
        if now() > deadline:
            raise TransferTimeout(f"{what} got no answer before the --timeout (a peer stopped "
                                  "answering or died)")
        if pause is not None:
            pause()


def barrier(comm, timeout_s: float, what: str = "barrier",
            pause: Callable[[], None] | None = None) -> None:
    """A barrier that cannot hang forever if a peer died or stopped answering."""
    wait_request(comm.Ibarrier(), now() + timeout_s, what, pause)


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
    barrier(comm, timeout_s, "the notice-latency barrier")
    rtts = []
    deadline = now() + timeout_s
    for _ in range(rounds):
        if rank == a:
            t0 = now()
            comm.Send(buf, dest=b, tag=PING_TAG)
            wait_request(comm.Irecv(buf, source=b, tag=PING_TAG), deadline, "a notice ping")
            rtts.append((now() - t0) * 1e3)
        elif rank == b:
            wait_request(comm.Irecv(buf, source=a, tag=PING_TAG), deadline, "a notice ping")
            comm.Send(buf, dest=a, tag=PING_TAG)
    return percentile(rtts, 50) / 2 if rank == a else None


@dataclass
class LoopSettings:
    warmup: int = 2
    iters: int = 20
    min_iters: int = 5
    seconds_per_point: float = 5.0  # adaptive: fewer iterations for very large payloads


def choose_iters(settings: LoopSettings, warm_ms: float) -> int:
    """Requested iterations, cut down so a point takes about `seconds_per_point`, never < min."""
    if not (warm_ms > 0 and math.isfinite(warm_ms)):
        return settings.iters
    fit = settings.seconds_per_point * 1e3 / warm_ms  # compared as a float: never int(inf)
    return max(settings.min_iters, settings.iters if fit >= settings.iters else int(fit))


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


@dataclass
class LoopResult:
    """One handoff's measurement, across ranks (built on rank 0 by `critical_paths`)."""

    cold_ms: float | None
    warmup_ms: list[float]
    samples: Measurement
    iters: int
    rounds: list[int] = field(default_factory=list)  # the round each sample was taken in
    rank_ms: list[list[float] | None] = field(default_factory=list)  # per rank: t1 - start
    rank_start_ms: list[list[float] | None] = field(default_factory=list)  # per sender: t0 - start
    rank_cold_ms: list[float | None] = field(default_factory=list)  # per rank: cold t1 - start
    rank_cold_start_ms: list[float | None] = field(default_factory=list)  # per sender: cold t0 - start


@dataclass
class LocalLoop:
    """One rank's stamps for one handoff: (t0, t1) tuples on its own clock, None where the rank
    did not take part."""

    cold: tuple | None
    warm: list
    samples: list
    rounds: list[int]


def _stamp(st) -> tuple | None:
    return None if st is None else (st.t0, st.t1)


def _local_ms(stamps: list) -> float:
    """This rank's own duration of its fastest stamp with a start (0: none)."""
    spans = [(s[1] - s[0]) * 1e3 for s in stamps if s is not None and s[0] is not None]
    return min(spans) if spans else 0.0


def measure(comm, settings: LoopSettings, handoffs: list[Callable[[], object]], points: int = 1,
            on_round: Callable[[int, int], None] | None = None) -> list[LocalLoop]:
    """Time several handoffs in interleaved rounds. Collective over `comm`.

    Each handoff gets a cold run and --warmup runs first; then every round runs each handoff
    once, starting one further along each round, so drifting load falls on all of them alike
    instead of on whichever ran last. The round count comes from the slowest rank's warm-up
    (one round's sum), so that the loop takes about `seconds_per_point` per point measured in
    it (`points`: how many sizes share the rounds), within --min-iters..--iters."""
    k = len(handoffs)
    WATCHDOG.phase("warm-up")
    cold = [_stamp(h()) for h in handoffs]
    warm: list[list] = [[] for _ in handoffs]
    for _ in range(settings.warmup):
        for j, h in enumerate(handoffs):
            warm[j].append(_stamp(h()))
    mine = [_local_ms(w or [c]) for w, c in zip(warm, cold, strict=True)]
    per_round = sum(max(col) for col in zip(*comm.allgather(mine), strict=True))
    n = choose_iters(settings, per_round / max(1, points))
    WATCHDOG.phase("timing")
    samples: list[list] = [[] for _ in handoffs]
    for i in range(n):
        for j in range(k):
            at = (i + j) % k
            samples[at].append(_stamp(handoffs[at]()))
        if on_round:
            on_round(i + 1, n)
    return [LocalLoop(c, w, s, list(range(n))) for c, w, s in zip(cold, warm, samples, strict=True)]


def _critical(per_rank: list[tuple | None], offsets: list[float]):
    """(critical-path ms, per-rank t1 - start ms, per-rank t0 - start ms) of one handoff."""
    t0 = [s[0] - off for s, off in zip(per_rank, offsets, strict=True) if s and s[0] is not None]
    if not t0:
        return None
    start = min(t0)
    ends = [None if s is None else (s[1] - off - start) * 1e3
            for s, off in zip(per_rank, offsets, strict=True)]
    starts = [None if s is None or s[0] is None else (s[0] - off - start) * 1e3
              for s, off in zip(per_rank, offsets, strict=True)]
    return max(e for e in ends if e is not None), ends, starts


def critical_paths(comm, loops: list[LocalLoop], offsets_s: list[float] | None = None
                   ) -> list[LoopResult] | None:
    """Every rank's stamps, gathered on rank 0 and merged per handoff iteration into the
    critical path max(t1) - min(t0), each rank's stamps first moved onto rank 0's clock by
    subtracting its offset. Collective; rank 0 gets one LoopResult per handoff, others None."""
    mine = [(lp.cold, lp.warm, lp.samples) for lp in loops]
    every = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    offsets = offsets_s or [0.0] * len(every)
    out = []
    for j, lp in enumerate(loops):
        cold = _critical([r[j][0] for r in every], offsets)
        warm = [_critical([r[j][1][w] for r in every], offsets) for w in range(len(lp.warm))]
        crit = [_critical([r[j][2][i] for r in every], offsets) for i in range(len(lp.samples))]
        timed = [c for c in crit if c is not None]
        ranks = len(every)
        rank_ms = [[c[1][r] for c in timed] for r in range(ranks)]
        rank_start = [[c[2][r] for c in timed] for r in range(ranks)]
        out.append(LoopResult(
            cold_ms=cold[0] if cold else None,
            rank_cold_ms=cold[1] if cold else [None] * len(every),
            rank_cold_start_ms=cold[2] if cold else [None] * len(every),
            warmup_ms=[w[0] for w in warm if w is not None],
            samples=Measurement([c[0] for c in timed]),
            iters=len(lp.samples),
            rounds=[rd for rd, c in zip(lp.rounds, crit, strict=True) if c is not None],
            rank_ms=[None if all(v is None for v in col) else col for col in rank_ms],
            rank_start_ms=[None if all(v is None for v in col) else col for col in rank_start]))
    return out


# ---------------------------------------------------------------------------
# one clock across ranks


@dataclass
class Clock:
    """How every rank's perf_counter maps onto rank 0's: common = local - offset."""

    method: str
    offset_s: list[float]
    uncertainty_s: list[float]

    def as_dict(self) -> dict:
        return {"method": self.method,
                "offset_ms": [o * 1e3 for o in self.offset_s],
                "uncertainty_ms": [u * 1e3 for u in self.uncertainty_s]}


def offset_from_pingpong(rounds: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, uncertainty) of a peer's clock from ping-pongs (t_send, t_peer, t_back), the
    first and last on this clock. The round with the shortest round trip bounds the peer's
    reading best: it was taken within [t_send, t_back], so offset = t_peer - midpoint with an
    error of at most half that round trip (whatever the asymmetry of the two directions)."""
    t_a, t_r, t_b = min(rounds, key=lambda r: r[2] - r[0])
    return t_r - (t_a + t_b) / 2, (t_b - t_a) / 2


def estimate_clock(comm, hosts: list[str], method: str, timeout_s: float,
                   rounds: int = 64) -> Clock:
    """One timeline for every rank. On one host perf_counter (CLOCK_MONOTONIC) is the same clock
    in every process: offsets 0. Across hosts (or with method 'pingpong'), rank 0 ping-pongs
    each other rank in turn and keeps the offset of the shortest round trip, with half that
    round trip as its uncertainty. Collective; every rank gets the same Clock."""
    import numpy as np

    size, rank = comm.Get_size(), comm.Get_rank()
    if method == "auto" and len(set(hosts)) <= 1:
        return Clock("one host: perf_counter (CLOCK_MONOTONIC) is shared by every process",
                     [0.0] * size, [0.0] * size)
    buf = np.zeros(1, dtype=np.float64)
    result = [(0.0, 0.0)]
    barrier(comm, timeout_s, "the clock barrier")
    deadline = now() + timeout_s
    for peer in range(1, size):
        seen = []
        for _ in range(rounds):
            if rank == 0:
                t_a = now()
                comm.Send(buf, dest=peer, tag=PING_TAG)
                wait_request(comm.Irecv(buf, source=peer, tag=PING_TAG), deadline, "a clock ping")
                seen.append((t_a, float(buf[0]), now()))
            elif rank == peer:
                wait_request(comm.Irecv(buf, source=0, tag=PING_TAG), deadline, "a clock ping")
                buf[0] = now()
                comm.Send(buf, dest=0, tag=PING_TAG)
        if rank == 0:
            result.append(offset_from_pingpong(seen))
    result = comm.bcast(result if rank == 0 else None, root=0)
    return Clock(f"ping-pong with rank 0, {rounds} rounds per rank, shortest round trip",
                 [o for o, _ in result], [u for _, u in result])
