#!/usr/bin/env python3
"""What reading a matrix job's records costs per record, lean against whole (issue 44).

For each N it writes one synthetic N-rank job (benchmarks/matrix_scale.py's records: two
sizes, --rounds samples, planted slow pairs and an odd path) through kvbench's own writer
twice: as a job writes them now (the first record whole, the later ones lean:
kvbench.records.schema.job) and as jobs wrote them before (every record whole: the job's
hosts twice and its round's pairs in each). It then reads each file with `kvbench matrix
report`'s reader (kvbench.matrix.analyze.read_run: the typed check of every line, the fit's
groups, each pair's paths) in a child process, alternately, and prints the bytes per record
(the first one apart) and the CPU microseconds per record of each, and their ratio: the
baseline is the whole records of the same job, read in the same run by the same code. Beside
it, a bare `json.loads` of each line in the same child: a yardstick of the moment's load.

    .venv/bin/python benchmarks/matrix_read.py                 # N = 16, 64
    .venv/bin/python benchmarks/matrix_read.py --ranks 64,128 --repeat 3

Numbers from a busy machine say so (--note); `uptime` is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITE = """
import sys
from pathlib import Path
sys.path[:0] = [{root!r}, {bench!r}]
import matrix_scale
from kvbench.records.write import write_records
j, _ = write_records(Path({out!r}), matrix_scale.records({n}, 8, {rounds}, 0, whole={whole}),
                     "kvbench-p2p")
print(j)
"""
READ = """
import sys, time, json
sys.path.insert(0, {root!r})
from kvbench.matrix.analyze import read_run
t = time.process_time()
run = read_run([{src!r}])
cpu = time.process_time() - t
t = time.process_time()
with open({src!r}, "rb") as fh:
    for line in fh:
        json.loads(line)
print(json.dumps({{"cpu_s": cpu, "pairs": len(run.pairs), "loads_s": time.process_time() - t}}))
"""


def child(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"matrix_read: child failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


def sizes(path: Path) -> tuple[int, float, int]:
    """(first record's bytes, mean bytes of the others, records)."""
    first, rest, n = 0, 0, 0
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if n == 1:
                first = len(line)
            else:
                rest += len(line)
    return first, rest / max(n - 1, 1), n


def one(n: int, args, work: Path) -> None:
    files = {}
    for kind in ("lean", "whole"):
        out = work / f"{kind}-{n}"
        out.mkdir(parents=True, exist_ok=True)
        files[kind] = Path(child(WRITE.format(root=str(ROOT), bench=str(ROOT / "benchmarks"),
                                              out=str(out), n=n, rounds=args.rounds,
                                              whole=kind == "whole")))
    us, loads = {"lean": [], "whole": []}, {"lean": [], "whole": []}
    for _ in range(args.repeat):
        for kind in ("whole", "lean"):
            r = json.loads(child(READ.format(root=str(ROOT), src=str(files[kind]))))
            assert r["pairs"] == n * (n - 1), r
            us[kind].append(r["cpu_s"] / sizes(files[kind])[2] * 1e6)
            loads[kind].append(r["loads_s"] / sizes(files[kind])[2] * 1e6)
    for kind in ("whole", "lean"):
        first, rest, count = sizes(files[kind])
        best = min(us[kind])
        print(f"{n:>5} {kind:>6} {count:>9,} {first:>12,} {rest:>10,.0f} {best:>10.1f} "
              f"{min(loads[kind]):>9.1f}  ({', '.join(f'{x:.1f}' for x in us[kind])})",
              flush=True)
    print(f"{n:>5} lean/whole: bytes per record {sizes(files['lean'])[1] / sizes(files['whole'])[1]:.2f}x, "
          f"read us per record {min(us['lean']) / min(us['whole']):.2f}x", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="16,64", help="world sizes N (default %(default)s)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2, help="reads of each file, alternately")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print(f"uptime before: {up()}\n{args.note}")
    print(f"{'N':>5} {'file':>6} {'records':>9} {'first B':>12} {'later B':>10} {'read us':>10} "
          f"{'loads us':>9}  (read us: CPU time of read_run / records, best of the reads "
          "listed; loads us: a bare json.loads of each line, the same moment's yardstick)")
    with tempfile.TemporaryDirectory(prefix="kvbench-matrix-read-") as work:
        for n in sorted(int(x) for x in args.ranks.split(",")):
            one(n, args, Path(work))
    print(f"uptime after: {up()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
