"""The link matrix: every ordered pair of ranks (i -> j) hands off on the same engine, in a
schedule of rounds whose pairs share no rank, so no two pairs of a round share a host link.

Schedules (`--schedule`):

    rounds (default)  a round-robin tournament (the circle method): N-1 rounds of N/2 disjoint
                      pairs (N rounds with one rank idle when N is odd), each played once in
                      each direction: 2(N-1) rounds (2N when N is odd). The pairs of a round
                      run at the same time, each rank sending or receiving in one pair only.
    serial            one ordered pair at a time: N(N-1) rounds, nothing runs beside a pair.

Every round of every size is one handoff of the harness: timed in interleaved rounds with the
others (so drifting load falls on all pairs alike), each pair's sample its own critical path
(its sender's start to the later of its two ends, on one clock). Each rank holds one send
buffer and one receive buffer per size whatever N is: its links to every peer share them,
and a receiving link checks the values its own sender seeded (`FromPeer`).

Before the first size, a wire-up pass moves 4 KiB over every pair in the same rounds: it
makes every connection (lazy connection set-up lands there, recorded per pair as
`wireup_ms`), and it lets a transport whose log names no peer (UCX's protocol tables) note
which peer each table came with (Transport.note_peer), so every record carries its own
pair's path (Transport.info_by_pair).
"""

from __future__ import annotations

import numpy as np

from kvbench.p2p.engine import Handoff
from kvbench.p2p.harness import LocalLoop, LoopResult
from kvbench.p2p.layout import KVCache, RawBuffer
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.base import (
    Measured,
    Pattern,
    Point,
    PointRun,
    descriptors_of,
    make_data,
    peak_device_bytes,
    peak_rss_bytes,
    per_rank_or_none,
    posted_counts,
)
from kvbench.p2p.patterns.sequential import estimate_bytes
from kvbench.records.stats import Measurement

SCHEDULES = ("rounds", "serial")
WIREUP_BYTES = 4096

Pair = tuple[int, int]


def tournament(n: int) -> list[list[Pair]]:
    """Round-robin rounds of disjoint unordered pairs (circle method): every pair of n ranks
    meets exactly once; with n odd one rank sits out each round."""
    ranks: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(ranks)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ranks[i], ranks[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(a, b) if k % 2 == 0 else (b, a) for k, (a, b) in enumerate(pairs)
                       if a is not None and b is not None])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]  # rank 0 stays, the rest turn one place
    return rounds


def schedule(n: int, kind: str = "rounds") -> list[list[Pair]]:
    """The rounds of ordered pairs: each ordered pair (i, j), i != j, exactly once; within a
    round no rank appears twice."""
    if kind == "serial":
        return [[(i, j)] for i in range(n) for j in range(n) if i != j]
    if kind != "rounds":
        raise ValueError(f"unknown schedule {kind!r}; choose from {', '.join(SCHEDULES)}")
    out = []
    for rnd in tournament(n):
        out.append(list(rnd))
        out.append([(b, a) for a, b in rnd])
    return out


def ordered_pairs(n: int) -> list[Pair]:
    """Every ordered pair, in the one order every rank creates links in (deadlock-free: each
    pair's set-up waits only on pairs before it)."""
    return [(i, j) for i in range(n) for j in range(n) if i != j]


class FromPeer:
    """A receiving link's view of its rank's one receive buffer: cleared like it, but checked
    against the values its own sender (`origin`) seeded, so a pair that received another
    rank's bytes fails the data check."""

    def __init__(self, data: KVCache | RawBuffer, origin: int):
        self.data, self.origin = data, origin

    def _holder(self):
        return self.data.spec if isinstance(self.data, KVCache) else self.data

    def clear(self) -> None:
        self.data.clear()

    def fill(self) -> None:  # a receiving link never sends
        raise RuntimeError("a receiving link's buffer is never filled")

    def count_wrong(self) -> int:
        holder = self._holder()
        saved, holder.origin = holder.origin, self.origin
        try:
            return self.data.count_wrong()
        finally:
            holder.origin = saved

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def pair_loop(loop: LoopResult, src: int, dst: int, alone: bool) -> LoopResult:
    """One pair's measurement out of its round's: the round's own when the pair ran alone;
    otherwise, per sample, the later of the two ends minus the sender's start (every stamp is
    already on rank 0's clock, relative to the round's first start). The rule as rank 0
    applied it to critical_paths' loops before reduce_pairs; kept as the reference that
    reduce_pairs is held to (tests/matrix/test_matrix_reduce.py)."""
    if alone:
        return loop
    start, end_s, end_r = loop.rank_start_ms[src], loop.rank_ms[src], loop.rank_ms[dst]
    samples = [max(a, b) - t0 for t0, a, b in zip(start or [], end_s or [], end_r or [],
                                                   strict=True)]
    cold = None
    c0, c1, c2 = (loop.rank_cold_start_ms[src], loop.rank_cold_ms[src], loop.rank_cold_ms[dst])
    if None not in (c0, c1, c2):
        cold = max(c1, c2) - c0
    return LoopResult(cold_ms=cold, warmup_ms=[], samples=Measurement(samples), iters=loop.iters,
                      rounds=list(loop.rounds),
                      rank_ms=[col if r in (src, dst) else None for r, col in enumerate(loop.rank_ms)],
                      rank_start_ms=[col if r == src else None
                                     for r, col in enumerate(loop.rank_start_ms)])


# ---------------------------------------------------------------------------
# stamps reduced where they are made: rank 0 gets each pair's result, not every rank's stamps


def _columns(lp: LocalLoop) -> list:
    """A handoff's stamps in one row: the cold run, the warm-ups, then the timed samples."""
    return [lp.cold, *lp.warm, *lp.samples]


def round_starts(loops: list[LocalLoop], offset: float) -> np.ndarray:
    """(handoffs, columns) this rank's starts on rank 0's clock (t0 - offset), inf where it
    started nothing: the minimum over ranks (one Allreduce) is each round's first start,
    the value critical_paths measures every stamp from."""
    width = max((len(_columns(lp)) for lp in loops), default=0)
    out = np.full((len(loops), width), np.inf)
    for j, lp in enumerate(loops):
        for c, st in enumerate(_columns(lp)):
            if st is not None and st[0] is not None:
                out[j, c] = st[0] - offset
    return out


def _relative(st, offset: float, start: float) -> tuple:
    """(end, start) of one stamp in ms after the round's first start, as critical_paths
    computes them (the same operations: the same values)."""
    if st is None or not np.isfinite(start):
        return None, None
    end = None if st[1] is None else (st[1] - offset - start) * 1e3
    return end, None if st[0] is None else (st[0] - offset - start) * 1e3


def relative_stamps(lp: LocalLoop, offset: float, starts: np.ndarray) -> list[tuple]:
    """Each column's (end, start) in ms after its round's first start (None: not taken)."""
    return [_relative(st, offset, float(starts[c])) for c, st in enumerate(_columns(lp))]


def pair_result(sender: list[tuple], receiver: list[tuple], n_warm: int, rounds: list[int],
                alone: bool) -> LoopResult:
    """One pair's LoopResult from its two ranks' relative stamps: per column the later of the
    two ends minus the sender's start (pair_loop's rule on critical_paths' numbers; alone in
    its round, the pair's is the round's, warm-ups included)."""
    crit = [None if st_s[1] is None or st_r[0] is None else max(st_s[0], st_r[0]) - st_s[1]
            for st_s, st_r in zip(sender, receiver, strict=True)]
    timed = crit[1 + n_warm:]
    return LoopResult(cold_ms=crit[0], warmup_ms=[w for w in crit[1:1 + n_warm] if w is not None]
                      if alone else [],
                      samples=Measurement([c for c in timed if c is not None]),
                      iters=len(timed),
                      rounds=[rd for rd, c in zip(rounds, timed, strict=True) if c is not None])


def reduce_pairs(comm, rounds: list[list[Pair]], loops: list[LocalLoop],
                 offsets: list[float] | None) -> dict[Pair, LoopResult] | None:
    """Each pair's result computed on its receiver from its own and its sender's stamps
    (one Allreduce of the rounds' first starts, one exchange between the two ranks of each
    pair), then gathered: rank 0 holds pairs x samples, never ranks x rounds x samples.
    Collective; {pair: LoopResult} on rank 0, None elsewhere. The values are critical_paths'
    then pair_loop's, to the bit (tests/matrix/test_matrix_reduce.py)."""
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()
    offset = (offsets or [0.0] * n)[rank]
    mine = round_starts(loops, offset)
    starts = np.empty_like(mine)
    comm.Allreduce(mine, starts, op=MPI.MIN)
    return gather_pairs(comm, rounds, loops, relative_pairs(comm, rounds, loops, offset, starts))


def relative_pairs(comm, rounds, loops, offset, starts) -> list[tuple]:
    """This rank's pairs as receiver: (round, pair, sender's and own relative stamps)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    rel = [relative_stamps(lp, offset, starts[j]) for j, lp in enumerate(loops)]
    out_to: list[list] = [[] for _ in range(n)]
    for k, rnd in enumerate(rounds):
        for s, r in rnd:
            if s == rank:
                out_to[r].append((k, rel[k]))
    got = {(s, k): stamps for s, part in enumerate(comm.alltoall(out_to)) for k, stamps in part}
    return [(k, (s, r), got[(s, k)], rel[k]) for k, rnd in enumerate(rounds)
            for s, r in rnd if r == rank]


def gather_pairs(comm, rounds, loops, mine: list[tuple]) -> dict[Pair, LoopResult] | None:
    results = [(pair, pair_result(snd, rcv, len(loops[k].warm), loops[k].rounds,
                                  len(rounds[k]) == 1)) for k, pair, snd, rcv in mine]
    every = comm.gather(results, root=0)
    if comm.Get_rank() != 0:
        return None
    return {pair: res for part in every for pair, res in part}


@register
class Matrix(Pattern):
    name = "matrix"
    description = "every ordered pair of ranks, in rounds of pairs that share no rank"
    per_pair = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.n = ctx.comm.Get_size()
        self.kind = getattr(ctx.args, "schedule", "rounds")
        self.rounds = schedule(self.n, self.kind)
        self.wireup_ms: dict[Pair, float | None] = {}
        self._wired = False

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("matrix pattern (kvbench matrix)")
        g.add_argument("--schedule", choices=SCHEDULES, default="rounds",
                       help="rounds (default): round-robin rounds of pairs that share no rank, "
                            "run at the same time (2(N-1) rounds); serial: one pair at a time "
                            "(N(N-1) rounds)")

    @classmethod
    def layout_error(cls, args, world_size, model) -> str | None:
        if world_size < 2:
            return "pattern matrix needs at least 2 ranks"
        if getattr(args, "nixl_shape", "link") == "engine":
            return "pattern matrix measures links: --nixl-engine-profile (the engine shape) is not supported with it"
        if getattr(args, "baseline", False):
            return ("pattern matrix: --baseline times ranks 0 and 1 only, a yardstick for no "
                    "other pair; leave it out")
        return None

    def pairs(self) -> list[Pair]:
        return ordered_pairs(self.n)

    def roles(self) -> tuple[list[int], list[int]]:
        return list(range(self.n)), list(range(self.n))

    def bytes_per_rank(self, point: Point) -> int:
        """One send and one receive buffer, whatever N is (links share them)."""
        return 2 * estimate_bytes(self.ctx, point, self.ctx.args.granularity) + 2 * WIREUP_BYTES

    def _hosts(self) -> list[str]:
        return list(self.ctx.transport.ctx.hosts) or ["?"] * self.n

    # -- links and handoffs ----------------------------------------------------

    def _links(self, send, recv, send_plan, recv_plan) -> dict[Pair, object]:
        """This rank's end of every pair it is in (created in the one global order), the
        transport told which peer each set-up was with."""
        eng, rank, out = self.ctx.engine, self.ctx.rank, {}
        for s, r in ordered_pairs(self.n):
            if rank == s:
                out[(s, r)] = eng.link(s, r, send, send_plan)
            elif rank == r:
                out[(s, r)] = eng.link(s, r, FromPeer(recv, s), recv_plan)
            else:
                continue
            self.ctx.transport.note_peer(r if rank == s else s)
        return out

    def _handoffs(self, links: dict[Pair, object], label: str) -> list[Handoff]:
        eng, out = self.ctx.engine, []
        for k, rnd in enumerate(self.rounds):
            mine = [links[p] for p in rnd if p in links]
            out.append(Handoff(eng, mine, idle_sleep=not mine, name=f"{label} round {k}"))
        return out

    def _peer_in(self, rnd: list[Pair]) -> int | None:
        rank = self.ctx.rank
        return next((r if s == rank else s for s, r in rnd if rank in (s, r)), None)

    def _wireup(self) -> None:
        """One small handoff per round before anything is timed: every connection made, each
        round's UCX (or other) log noted against its peer, each pair's first handoff kept."""
        from kvbench.p2p.engine import close_links

        ctx = self.ctx
        pt = Point(raw_bytes=WIREUP_BYTES)
        send = make_data(ctx, pt, origin=ctx.rank)
        recv = make_data(ctx, pt)
        links = self._links(send, recv, plan_messages(send, "whole"), plan_messages(recv, "whole"))
        ctx.engine.settle()
        handoffs = self._handoffs(links, "wire-up")
        try:
            stamps = []
            for h, rnd in zip(handoffs, self.rounds, strict=True):
                stamps.append(_Once(h))
                peer = self._peer_in(rnd)
                if peer is not None:
                    ctx.transport.note_peer(peer)
            pairs = reduce_pairs(ctx.comm, self.rounds, [s.local for s in stamps],
                                 ctx.clock.offset_s if ctx.clock else None)
        finally:
            close_links(list(links.values()))
        for pair, loop in (pairs or {}).items():
            self.wireup_ms[pair] = loop.cold_ms
        self._wired = True

    def setup(self, point: Point) -> PointRun:
        ctx = self.ctx
        if not self._wired:
            self._wireup()
        gran = ctx.args.granularity
        send = make_data(ctx, point, table_seed=ctx.rank, origin=ctx.rank)
        recv = make_data(ctx, point, table_seed=ctx.rank + self.n)
        send_plan, recv_plan = plan_messages(send, gran), plan_messages(recv, gran)
        links = self._links(send, recv, send_plan, recv_plan)
        ctx.engine.settle()
        handoffs = self._handoffs(links, point.label)

        def records(loops, wrong) -> list[Measured]:
            return self._records(point, links, send_plan, send, loops, wrong)

        def reduce(comm, loops, offsets) -> dict[Pair, LoopResult] | None:
            return reduce_pairs(comm, self.rounds, loops, offsets)

        return PointRun(point, handoffs, handoffs, list(links.values()), records,
                        points=len(handoffs), reduce=reduce)

    # -- records -----------------------------------------------------------------

    def _records(self, point, links, plan, data, loops, wrong) -> list[Measured]:
        """One record per pair (collective; rank 0 gets them; `loops`: reduce_pairs' result
        on rank 0): its own samples, its data check
        (the wrong elements its receiver counted in its round), its channels' breakdown, the
        pieces one of its handoffs posted (`descriptors`)."""
        comm, order = self.ctx.comm, ordered_pairs(self.n)
        counts = posted_counts(self.ctx, [links.get(p) for p in order])
        parts = comm.gather({f"{lk.src}->{lk.dst}": lk.channel.breakdown()
                             for lk in links.values()}, root=0)
        checks = comm.gather(wrong, root=0)
        rss = comm.gather(peak_rss_bytes(), root=0)
        gpu = comm.gather(peak_device_bytes(), root=0)
        if self.ctx.rank != 0:
            return []
        hosts = self._hosts()
        at = {p: k for k, p in enumerate(order)}  # a pair's place, by index (not list.index)
        out = []
        for k, rnd in enumerate(self.rounds):
            in_round = [list(p) for p in rnd]  # one list per round, shared by its records
            for s, r in rnd:
                key = f"{s}->{r}"
                breakdown = {n: v for rank in (s, r) for n, v in parts[rank].get(key, {}).items()}
                out.append(Measured(loops[(s, r)], {  # reduced on its receiver (reduce_pairs)
                    "variant": key, "pair": [s, r],
                    "sender": {"rank": s, "host": hosts[s]},
                    "receiver": {"rank": r, "host": hosts[r]},
                    "granularity": self.ctx.args.granularity, "bytes": plan.nbytes,
                    "messages": plan.n, "packed": plan.packed,
                    "stored_tokens": (data.spec.tensor_tokens(0) if isinstance(data, KVCache)
                                      else None),
                    "fit_as_link": True, "not_link_reason": None,
                    "wrong": None if checks[r] is None else checks[r][k],
                    "schedule": {"name": self.kind, "round": k, "rounds": len(self.rounds),
                                 "pairs_in_round": in_round},
                    "wireup_ms": self.wireup_ms.get((s, r)),
                    "breakdown_ms": breakdown,  # every rank's peaks: the point's first record
                    "peak_rss_bytes": rss if not out else None,
                    "peak_device_bytes": per_rank_or_none(gpu) if not out else None,
                    **descriptors_of(counts[at[(s, r)]]),
                }, self.entries(self.ctx.args.granularity, variant=key, packed=plan.packed,
                                pair=(s, r))))
        return out


class _Once:
    """A handoff run once, its stamp kept the way the harness keeps a loop's (as a cold run)."""

    def __init__(self, handoff: Handoff):
        from kvbench.p2p.harness import LocalLoop

        st = handoff()
        self.local = LocalLoop(None if st is None else (st.t0, st.t1), [], [], [])

