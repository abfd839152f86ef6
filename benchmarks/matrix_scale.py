#!/usr/bin/env python3
"""How `kvbench matrix report` grows with the number of ranks N (issue 44).

For each N it writes the records of one synthetic N-rank matrix run through the project's
own writer (kvbench.records.write.write_records: the .jsonl and its .csv, as `kvbench p2p`
writes them), shaped as a real job's records (spec with every host, the pair, sender,
receiver, schedule, transport_info with the pair's path, rank 0's environment), then runs the
real `python -m kvbench.matrix report` on them in a child process and prints its wall time,
its own peak RSS (VmHWM, benchmarks/peak_child.py) and the growth exponent between
successive N (log time ratio / log pairs ratio: 1.0 is linear in pairs).

Planted faults, checked in the child's output: two slow pairs (5% of the others' rate,
one of them across nodes and one inside a node when there are several ranks per node) and one
pair on an odd path (another interface). A run passes only when exactly these three pairs are
named (`slow`, `slow`, `path_differs`) and `kvbench plan --fit DOC --pair I,J` plans with a
planted pair (band included, from its draws); anything else is printed and exits 1.

    .venv/bin/python benchmarks/matrix_scale.py                     # N = 8, 16, 32, 64
    .venv/bin/python benchmarks/matrix_scale.py --ranks 32,64,128 --bootstrap 1000
    .venv/bin/python benchmarks/matrix_scale.py --big               # adds 256, 512, 1024

Beyond 240 pairs the report is the streamed one (kvbench.matrix.stream: the pairs file, the
float32 draws file, a row of numbers per pair held). N = 512 and 1,024 (--big): beyond
--lazy-above ranks the records are made anew for each of the writer's passes (never held),
each N's folder is removed once measured (without --dir), and an N whose records and
report would not fit the disk is refused in one line before anything is written (records
that carry the job's N hosts twice, as today's do, are ~30 KB each at N = 1,024: with
their CSV ~125 GB).

Shape (deterministic, --seed): --ranks-per-node ranks per host (host names node-000, ...),
two payload sizes (1 MiB and 8 MiB), --rounds timing rounds per record, every pair at
1 GB/s and 1 ms setup with 2% noise and a load shared by each round, the planted ones apart.
Numbers from a busy machine say so (--note); `uptime` is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.p2p.patterns.matrix import schedule  # noqa: E402
from kvbench.records.schema.job import first_of_job, lean, spec_id_with_hosts  # noqa: E402
from kvbench.records.schema.p2p import HandoffSpec, canonical_json  # noqa: E402
from kvbench.records.write import environment, write_records  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bigfile import measured  # noqa: E402

SIZES = (1 << 20, 8 << 20)
ETH0 = "UCX RMA write: tcp/eth0 (zero-copy); notifications (AM): tcp/eth0"
ETH1 = "UCX RMA write: tcp/eth1 (zero-copy); notifications (AM): tcp/eth1"
SHM = "UCX RMA write: sysv/memory (zero-copy); notifications (AM): posix/memory"
DEFAULT_RANKS = (8, 16, 32, 64)
BIG_RANKS = (256, 512, 1024)


def planted(n: int, per_node: int) -> dict[tuple[int, int], str]:
    """{pair: code} of the faults planted in an n-rank matrix."""
    across = (n - 1, 0) if per_node < n else (1, 0)
    inside = (1, 0) if per_node > 1 else (n // 2, 1)
    odd = (0, n - 1) if per_node < n else (0, 1)
    out = {across: "slow", inside: "slow"}
    out[odd if odd not in out else (0, n // 2 + 1)] = "path_differs"
    return out


def _pct(v: list[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values, without numpy's per-call cost
    (three np.percentile calls a record were most of the writer's time at N = 1,024)."""
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def _stats(samples: list[float]) -> dict:
    v = sorted(samples)
    return {"p50_ms": _pct(v, 0.5), "p95_ms": None, "p99_ms": None,
            "mean_ms": sum(v) / len(v), "min_ms": v[0], "max_ms": v[-1],
            "iqr_ms": _pct(v, 0.75) - _pct(v, 0.25)}


def records(n: int, per_node: int, rounds: int, seed: int, whole: bool = False):
    """The records of one n-rank run, pair by pair and size by size (a generator: memory
    stays one record whatever n is), as a real job writes them (kvbench.p2p.report.finish):
    the first whole (every rank's environment, the schedule's every round), the later ones
    lean (kvbench.records.schema.job); `whole`: every record whole, as jobs wrote them
    before."""
    first = True
    for rec in _records(n, per_node, rounds, seed):
        if whole:
            yield rec
        elif first:
            yield first_of_job({**rec, "env": {**rec["env"], "ranks": rec["env"]["ranks"] * n}},
                               [[list(p) for p in rnd] for rnd in schedule(n, "rounds")])
        else:
            yield lean(rec)
        first = False


def _records(n: int, per_node: int, rounds: int, seed: int):
    rng = np.random.default_rng(seed)
    hosts = [f"node-{r // per_node:03d}" for r in range(n)]
    faults = planted(n, per_node)
    one = environment()
    env = {"ranks": [one], **{k: one.get(k) for k in ("torch", "mpi4py", "mpi_library", "nccl",
                                                       "nixl", "gpu", "cpu")}}
    rounds_of = schedule(n, "rounds")
    round_of = {p: k for k, rnd in enumerate(rounds_of) for p in rnd}
    shift = rng.normal(0, 0.02, rounds)
    base = {"schema": "kvbench.p2p/1", "transport": "nixl", "layout": "raw", "dtype": None,
            "device": "cpu", "model": None, "block_size": None, "world_size": n, "hosts": hosts,
            "gpus": None, "argv": ["python", "-m", "kvbench.p2p", "--pattern", "matrix"],
            "run_id": f"synthetic-{n}", "order": "rounds", "pattern": "matrix",
            "prompt_tokens": None, "granularity": "whole", "messages": 1, "packed": False,
            "stored_tokens": None, "fit_as_link": True, "not_link_reason": None, "wrong": 0,
            "descriptors": 1, "iters": rounds, "n_samples": rounds,
            "sample_rounds": list(range(rounds)), "warmup_ms": [], "notice_ms": 0.005,
            "env": env, "timestamp": "2026-12-06T00:00:00Z"}
    # one spec checked by its model, the others made from it (the same keys in the same order,
    # the pair's own world and variant), their ids hashed with the N hosts' text once
    # (spec_id_with_hosts, as the reader checks them): the spec and its id were O(N) a pair
    template = HandoffSpec(transport="nixl", pattern="matrix", granularity="whole",
                           layout="raw", device="cpu", hosts=hosts, variant="0->1",
                           world={"size": n, "prefill_ranks": [0], "decode_ranks": [1]}).as_dict()
    hosts_json = canonical_json(hosts)
    in_round = [[list(p) for p in rnd] for rnd in rounds_of]  # (shared: N/2 pairs a round)
    for s in range(n):
        for r in range(n):
            if s == r:
                continue
            same = hosts[s] == hosts[r]
            rate = 0.05 if faults.get((s, r)) == "slow" else 1.0
            path = ETH1 if faults.get((s, r)) == "path_differs" else (SHM if same else ETH0)
            spec = {**template, "variant": f"{s}->{r}",
                    "world": {"size": n, "prefill_ranks": [s], "decode_ranks": [r]}}
            k = round_of[(s, r)]
            pair = {"variant": f"{s}->{r}", "pair": [s, r],
                    "sender": {"rank": s, "host": hosts[s]},
                    "receiver": {"rank": r, "host": hosts[r]},
                    "schedule": {"name": "rounds", "round": k, "rounds": len(rounds_of),
                                 "pairs_in_round": in_round[k]},
                    "wireup_ms": 2.0, "spec": spec,
                    "spec_id": spec_id_with_hosts({x: v for x, v in spec.items() if x != "hosts"},
                                                  hosts_json),
                    "transport_info": {"path": path, "path_source": "synthetic"}}
            for b in SIZES:
                t = 1.0 + b / (rate * 1e9) * 1e3
                samples = (t * np.exp(shift + rng.normal(0, 0.02, rounds))).tolist()
                st = _stats(samples)
                yield {**base, **pair, "bytes": b, "samples_ms": [round(v, 5)
                                                                   for v in samples],
                       **st, "gbps": b / 1e9 / (st["p50_ms"] / 1e3),
                       "gbps_best": b / 1e9 / (st["min_ms"] / 1e3), "cold_ms": 2 * t}


def run_report(jsonl: Path, out: Path, boot: int) -> tuple[float, float, str, int]:
    """`python -m kvbench.matrix report` in a child: (wall s, its own peak RSS MiB, stdout,
    status); the peak as benchmarks/peak_child.py takes it (not ru_maxrss: this process's
    memory at the fork, the records of N <= --lazy-above among it, would count)."""
    wall, peak, res = measured(["-m", "kvbench.matrix", "report", str(jsonl), "--out", str(out),
                                "--bootstrap", str(boot)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    return wall, peak, res.stdout, res.returncode


def plan_pair(doc: Path, pair: tuple[int, int]) -> tuple[float, bool]:
    """`kvbench plan --fit DOC --pair I,J` on a planted pair: (wall s, it planned with that
    pair and a band from its draws)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvbench.plan", "--fit", str(doc), "--pair",
                        f"{pair[0]},{pair[1]}", "--format", "json"], cwd=ROOT,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ok = r.returncode == 0 and json.loads(r.stdout)["rows"][0].get("handoff_floor_ms_band95")
    if not ok:
        print(r.stderr[-2000:], file=sys.stderr)
    return wall, bool(ok)


def named_in(out: Path) -> dict[tuple[int, int], list[str]]:
    doc = json.loads(next(out.glob("kvbench-matrix-*.csv")).with_suffix(".json").read_text())
    return {tuple(p["pair"]): [f["code"] for f in p["findings"]] for p in doc["pairs"]
            if p["findings"]}


class Regenerated:
    """The records of one n-rank run as a sequence made anew on each pass (the writer reads
    them twice: the CSV's columns, then the lines), so a big N is never held in memory."""

    def __init__(self, n: int, args):
        self.n, self.args = n, args

    def __len__(self) -> int:
        return self.n * (self.n - 1) * len(SIZES)

    def __iter__(self):
        return iter(records(self.n, self.args.ranks_per_node, self.args.rounds, self.args.seed))


def record_bytes(n: int, args) -> tuple[int, int]:
    """The bytes of a job's first record and of a later one as the writer writes them (.jsonl
    + .csv twin, about the same again): the first holds the job's hosts, environments and
    rounds, the later ones are lean (kvbench.records.schema.job)."""
    from kvbench.records.write import dumps_json

    it = iter(Regenerated(n, args))
    first, later = next(it), next(it)
    return tuple(2 * (len(dumps_json(r, indent=None)) + 1) for r in (first, later))


def check_disk(n: int, args, folder: Path) -> None:
    """Refuse, in one line, an N whose records and report would not fit the disk: the records
    (measured on the first and the second), the pairs file (~3 KB a pair) and the float32
    draws."""
    pairs = n * (n - 1)
    first, later = record_bytes(n, args)
    need = first + (len(Regenerated(n, args)) - 1) * later + pairs * (3000 + 8 * args.bootstrap)
    free = shutil.disk_usage(folder).free
    if need > 0.9 * free:
        print(f"matrix_scale.py: N = {n} needs about {need / 1e9:.1f} GB in {folder} (records "
              f"and report), {free / 1e9:.1f} GB free: not run", file=sys.stderr)
        raise SystemExit(2)


def one(n: int, args, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    check_disk(n, args, work)
    folder = work / f"n{n}"
    folder.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    recs = Regenerated(n, args) if n > args.lazy_above else \
        list(records(n, args.ranks_per_node, args.rounds, args.seed))
    jsonl, _ = write_records(folder, recs, "kvbench-p2p")
    del recs
    write_s = time.perf_counter() - t0
    wall, peak, text, code = run_report(jsonl, folder, args.bootstrap)
    want = {p: [c] for p, c in planted(n, args.ranks_per_node).items()}
    got = named_in(folder) if code in (0, 1) else None
    ok = got == want
    if not ok:
        print(text[-3000:], file=sys.stderr)
    doc = next(folder.glob("kvbench-matrix-*.json"), None)
    draws = next(folder.glob("kvbench-matrix-*.draws.npy"), None)
    side = next(folder.glob("kvbench-matrix-*.pairs.jsonl"), None)
    plan_s, plan_ok = plan_pair(doc, next(iter(want))) if doc else (float("nan"), False)
    ok = ok and plan_ok
    return {"n": n, "pairs": n * (n - 1), "records": n * (n - 1) * len(SIZES),
            "doc_mb": doc.stat().st_size / 1e6 if doc else float("nan"), "plan_s": plan_s,
            "draws_mb": draws.stat().st_size / 1e6 if draws else 0.0,
            "pairs_mb": side.stat().st_size / 1e6 if side else 0.0,
            "file_mb": jsonl.stat().st_size / 1e6, "write_s": write_s, "report_s": wall,
            "peak_mib": peak, "status": code, "named_ok": ok, "named": got,
            "stdout_lines": len(text.splitlines())}


def simulate_rank0(n: int, args, work: Path) -> dict:
    """benchmarks/matrix_rank0.py in a child (rank 0's work in a real n-rank job): its phases'
    seconds, wall time and its own peak RSS (peak_child.py)."""
    cmd = [str(ROOT / "benchmarks" / "matrix_rank0.py"), "--ranks", str(n),
           "--iters", str(args.rounds), "--sizes", args.sim_sizes]
    if not args.sim_no_write:
        cmd += ["--out", str(work / f"rank0-n{n}")]
    wall, peak, res = measured(cmd, stdout=subprocess.PIPE)
    text = res.stdout
    if res.returncode != 0:
        return {"n": n, "pairs": n * (n - 1), "failed": text[-2000:]}
    r = json.loads(text.strip().splitlines()[-1])
    work = r["reduce_s"] + r["records_s"] + r["assemble_s"] + r["write_s"]
    return {**r, "work_s": work, "wall_s": wall, "peak_mib": peak}


def print_rank0(ns: list[int], args, work: Path) -> int:
    sizes = len(args.sim_sizes.split(","))
    print(f"rank 0 of a real job, simulated (benchmarks/matrix_rank0.py): {sizes} sizes, "
          f"{args.rounds} samples per pair and size; "
          + ("records' fields only, not assembled nor written (--sim-no-write)"
             if args.sim_no_write else
             "records written (.jsonl, .csv, the table)"))
    print(f"{'N':>5} {'pairs':>8} {'records':>8} {'reduce s':>9} {'records s':>9} "
          f"{'assemble s':>10} {'write s':>8} {'work s':>7} {'wall s':>7} {'peak MiB':>9} "
          f"{'exp':>5} "
          f"{'jsonl MB':>9}")
    prev, bad = None, 0
    for n in ns:
        r = simulate_rank0(n, args, work)
        if "failed" in r:
            print(f"{n:>5} FAILED: {r['failed']}")
            bad += 1
            continue
        exp = (math.log(r["work_s"] / prev["work_s"]) / math.log(r["pairs"] / prev["pairs"])
               if prev else float("nan"))
        print(f"{n:>5} {r['pairs']:>8} {r['records']:>8} {r['reduce_s']:>9.1f} "
              f"{r['records_s']:>9.1f} {r['assemble_s']:>10.1f} {r['write_s']:>8.1f} "
              f"{r['work_s']:>7.1f} {r['wall_s']:>7.1f} {r['peak_mib']:>9.0f} {exp:>5.2f} "
              f"{r['jsonl_mb']:>9.1f}", flush=True)
        prev = r
        subprocess.run(["rm", "-rf", str(work / f"rank0-n{n}")], check=False)
    return bad


def rank0_main(args) -> int:
    work = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-matrix-rank0-", dir="/tmp"))
    bad = print_rank0(sorted(int(x) for x in args.simulate_rank0.split(",")), args, work)
    if not args.dir:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("work s: rank 0's four phases (reduce + records + assemble + write); wall s adds the "
          "child's start (imports) and the making of the receivers' parts; peak MiB: the "
          "child's peak RSS, parts included; exp: growth exponent of work s against pairs "
          "since the previous N (1.0 = linear in pairs)")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                   help="world sizes N, comma-separated (default %(default)s)")
    p.add_argument("--big", action="store_true", help=f"also N = {BIG_RANKS}")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="work folder (kept); default a temporary one, each N's part "
                   "removed once measured")
    p.add_argument("--lazy-above", type=int, default=256, metavar="N",
                   help="beyond N ranks the records are made anew for each of the writer's "
                        "passes instead of held in a list (default %(default)s)")

    p.add_argument("--note", default="", help="printed with the results (e.g. 'busy machine')")
    p.add_argument("--simulate-rank0", metavar="N,...",
                   help="instead: rank 0's work in a real job of each N (reduction, records, "
                        "writing; benchmarks/matrix_rank0.py), e.g. 128,256,512,1024")
    p.add_argument("--sim-sizes", default="1048576,8388608,67108864",
                   help="payload sizes of the simulated job (default three: 1, 8, 64 MiB)")
    p.add_argument("--sim-no-write", action="store_true",
                   help="simulate the reduction and the records' fields only (no assemble, "
                        "no writing)")
    args = p.parse_args(argv)
    ns = sorted({int(x) for x in args.ranks.split(",")} | (set(BIG_RANKS) if args.big else set()))
    print(f"uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} cpus; "
          f"{args.ranks_per_node} ranks per node, sizes 1 MiB and 8 MiB, {args.rounds} rounds, "
          f"{args.bootstrap} bootstrap resamples per pair. {args.note}")
    if args.simulate_rank0:
        return rank0_main(args)
    print(f"{'N':>5} {'pairs':>8} {'records':>8} {'file MB':>9} {'write s':>8} {'report s':>9} "
          f"{'peak MiB':>9} {'exp':>5} {'doc MB':>7} {'pairs MB':>8} {'draws MB':>8} "
          f"{'plan s':>6}  named")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvbench-matrix-scale-"))
    prev, bad = None, 0
    for n in ns:
        r = one(n, args, work)
        exp = (math.log(r["report_s"] / prev["report_s"]) / math.log(r["pairs"] / prev["pairs"])
               if prev else float("nan"))
        bad += not r["named_ok"]
        print(f"{n:>5} {r['pairs']:>8} {r['records']:>8} {r['file_mb']:>9.1f} "
              f"{r['write_s']:>8.1f} {r['report_s']:>9.1f} {r['peak_mib']:>9.0f} {exp:>5.2f} "
              f"{r['doc_mb']:>7.1f} {r['pairs_mb']:>8.1f} {r['draws_mb']:>8.1f} "
              f"{r['plan_s']:>6.1f}  "
              f"{'exactly the planted pairs, plan --pair read' if r['named_ok'] else 'WRONG: ' + str(r['named'])}"
              f" (exit {r['status']}, {r['stdout_lines']} stdout lines)", flush=True)
        prev = r
        if not args.dir:  # the disk holds one N at a time (N = 1,024: tens of GB)
            subprocess.run(["rm", "-rf", str(work / f"n{n}")], check=False)
    if not args.dir:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("exp: growth exponent of the report's time against pairs since the previous N "
          "(1.0 = linear in pairs)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
