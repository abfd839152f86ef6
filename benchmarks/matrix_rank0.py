#!/usr/bin/env python3
"""Rank 0's work in a real N-rank `kvbench matrix` job, without the other N - 1 ranks
(issue 44): what rank 0 receives is made up, what it does with it is kvbench's own code.

Per size, every receiver's reduced pairs (each pair's LoopResult, computed on its receiver
by kvbench.p2p.patterns.matrix.pair_result from planted stamps) are pickled as MPI's gather
would carry them; then, timed, rank 0 does what a job's rank 0 does with them:

  reduce   gather_pairs: the N pickled parts read back into {pair: LoopResult}
  records  Matrix._records (the breakdowns, data checks, posted counts and peaks gathered
           from every rank are stand-ins of the real shapes, 1 descriptor per handoff)
  assemble kvbench.p2p.cli.assemble: each record's spec and p2p record (make_spec,
           make_record)
  write    kvbench.p2p.cli.report: the environment once per job, the table (to a file),
           the .jsonl and .csv streamed to --out (without --out: neither assemble nor
           write, only the reduction and the records' fields in memory)

What it does not prove: the wire (MPI's gather of the parts, the alltoall between pairs, the
Allreduce of the rounds' starts) and the other ranks' own work; the receivers' reduction is
run here once per pair, outside the timing. Prints one JSON line: the phases' seconds, the
records written and their bytes; the parent (matrix_scale.py --simulate-rank0) measures the
peak RSS of this process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.p2p.patterns.base import Point  # noqa: E402
from kvbench.p2p.patterns.matrix import (  # noqa: E402
    Matrix,
    gather_pairs,
    ordered_pairs,
    pair_result,
    schedule,
)
from kvbench.records.write import environment  # noqa: E402


class Rank0Comm:
    """Rank 0's communicator: each gather returns the next of the parts queued for it."""

    def __init__(self, n: int):
        self.n, self.replies = n, []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return self.n

    def gather(self, mine, root=0):
        return self.replies.pop(0)()


def _pair_stamps(iters: int, ms: float, rng) -> tuple[list, list]:
    """A sender's and a receiver's relative (end, start) stamps: cold run and samples."""
    start = rng.uniform(0, 0.01, iters + 1)
    end_s = start + ms * (1 + rng.normal(0, 0.02, iters + 1))
    end_r = end_s + rng.uniform(0, 0.005, iters + 1)
    return (list(zip(end_s.tolist(), start.tolist(), strict=True)),
            list(zip(end_r.tolist(), [None] * (iters + 1), strict=True)))


def receivers_parts(n: int, rounds, iters: int, nbytes: int, seed: int) -> list[bytes]:
    """What every receiver sends rank 0 for one size: its pairs' results, pickled."""
    rng = np.random.default_rng(seed)
    by_rank: list[list] = [[] for _ in range(n)]
    ms = 1.0 + nbytes / 1e9 * 1e3
    for rnd in rounds:
        for s, r in rnd:
            snd, rcv = _pair_stamps(iters, ms, rng)
            by_rank[r].append(((s, r), pair_result(snd, rcv, 0, list(range(iters)), False)))
    return [pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL) for part in by_rank]


class _Channel:
    def __init__(self, handoffs: int):
        self.posted_per_handoff = [1] * handoffs

    def breakdown(self) -> dict:
        return {}


def _link(s: int, r: int, handoffs: int):
    return SimpleNamespace(src=s, dst=r, channel=_Channel(handoffs))


def matrix_of(n: int, comm: Rank0Comm) -> Matrix:
    ctx = SimpleNamespace(comm=comm, rank=0, args=SimpleNamespace(
        schedule="rounds", granularity="whole", pack_kernel=None),
        transport=SimpleNamespace(ctx=SimpleNamespace(hosts=hosts_of(n))))
    m = Matrix.__new__(Matrix)
    m.ctx, m.n, m.kind, m.rounds = ctx, n, "rounds", schedule(n, "rounds")
    m.wireup_ms, m._wired = {}, True
    return m


def hosts_of(n: int, per_node: int = 8) -> list[str]:
    return [f"node-{r // per_node:03d}" for r in range(n)]


def queue_gathers(comm: Rank0Comm, n: int, rounds, parts: list[bytes], handoffs: int) -> None:
    """The gathers rank 0 takes part in, in order: the reduced pairs (unpickled when
    gathered: rank 0's work), then _records' five (made here, before the timing)."""
    posted: list[list] = [[] for _ in range(n)]
    for k, (s, _r) in enumerate(ordered_pairs(n)):
        posted[s].append((k, [1] * handoffs))
    checks: list[list] = [[None] * len(rounds) for _ in range(n)]
    for k, rnd in enumerate(rounds):
        for _s, r in rnd:
            checks[r][k] = 0
    ready = [posted, [{} for _ in range(n)], checks, [1 << 30] * n, [None] * n]
    comm.replies = [lambda: [pickle.loads(p) for p in parts],
                    *((lambda v=v: v) for v in ready)]


def one_size(m: Matrix, nbytes: int, iters: int, seed: int, t: dict) -> tuple:
    """(pattern, point, record fields) of one size, each phase's seconds added to t."""
    n, comm = m.n, m.ctx.comm
    parts = receivers_parts(n, m.rounds, iters, nbytes, seed)
    links = {(s, r): _link(s, r, iters + 1) for s, r in ordered_pairs(n) if 0 in (s, r)}
    queue_gathers(comm, n, m.rounds, parts, iters + 1)
    t0 = time.perf_counter()
    loops = gather_pairs(comm, m.rounds, [SimpleNamespace(warm=[], rounds=[])] * len(m.rounds),
                         [])
    del parts
    t1 = time.perf_counter()
    plan = SimpleNamespace(nbytes=nbytes, n=1, packed=False)
    wrong = [0] * len(m.rounds)
    fields = m._records(Point(raw_bytes=nbytes), links, plan, None, loops, wrong)
    t["reduce_s"] += t1 - t0
    t["records_s"] += time.perf_counter() - t1
    return (m, Point(raw_bytes=nbytes), fields)


def common(n: int, iters: int) -> tuple[dict, dict, dict]:
    hosts = hosts_of(n)
    spec = {"transport": "nixl", "transport_options": {}, "layout": "raw", "device": "cpu",
            "hosts": hosts, "block_size": None, "dtype": None, "model": None}
    base = {"transport": "nixl", "layout": "raw", "dtype": None, "device": "cpu", "model": None,
            "block_size": None, "world_size": n, "hosts": hosts, "gpus": None,
            "argv": ["python", "-m", "kvbench.p2p", "--pattern", "matrix"],
            "run_id": f"simulated-{n}", "order": "rounds", "transport_open_ms": 1.0,
            "clock": {"method": "pingpong", "offset_ms": [0.0] * n,
                      "uncertainty_ms": [0.001] * n}}
    info = {"path": "UCX RMA write: tcp/eth0 (zero-copy)", "path_source": "simulated"}
    return spec, base, info


def run(n: int, sizes: list[int], iters: int, out: Path | None) -> dict:
    from kvbench.p2p.assemble import assemble
    from kvbench.p2p.report import report

    t = {"reduce_s": 0.0, "records_s": 0.0, "assemble_s": 0.0, "write_s": 0.0}
    m = matrix_of(n, Rank0Comm(n))
    measured = [one_size(m, b, iters, k, t) for k, b in enumerate(sizes)]
    if out is None:  # the reduction and the records' fields only
        return {**t, "n": n, "pairs": n * (n - 1),
                "records": sum(len(f) for _m, _p, f in measured), "jsonl_mb": 0.0}
    spec, base, info = common(n, iters)
    args = SimpleNamespace(baseline=False, no_write=False, out=str(out))
    t0 = time.perf_counter()
    records, notes = assemble(args, m.ctx.comm, "cpu", measured, spec, base, 0.005)
    del measured
    t["assemble_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    written: dict = {}
    with open(out / "table.txt", "w") as table, contextlib.redirect_stdout(table):
        report(args, records, info, [environment()] * n, 0.005, written)
    t["write_s"] = time.perf_counter() - t0
    path = written.get("records")
    return {**t, "n": n, "pairs": n * (n - 1), "records": len(records),
            "jsonl_mb": path.stat().st_size / 1e6 if path else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--sizes", default="1048576,8388608,67108864")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", help="folder for the records (default: not assembled, not written)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(args.ranks, [int(x) for x in args.sizes.split(",")], args.iters, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
