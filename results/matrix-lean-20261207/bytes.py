"""Bytes per record of benchmarks/matrix_scale.py's synthetic job, through kvbench's writer:
the first record and the mean of the next K (a stream: the N = 1,024 job is not written whole)."""
import itertools, subprocess, sys
from pathlib import Path
PY = "/work/wt/leanread/.venv/bin/python"
CODE = '''
import itertools, sys; sys.path.insert(0, TREE); sys.path.insert(0, TREE + "/benchmarks")
from pathlib import Path
import matrix_scale
from kvbench.records.write import write_records
folder = Path(OUT); folder.mkdir(parents=True, exist_ok=True)
j, _ = write_records(folder, list(itertools.islice(matrix_scale.records(N, 8, 20, 0), K)), "kvbench-p2p")
lines = j.read_bytes().splitlines()
import time
from kvbench.fit.data import read_groups
t = time.process_time(); read_groups([j], keep_paths=True); dt = time.process_time() - t
print(len(lines[0]), sum(map(len, lines[1:])) / (len(lines) - 1), len(lines), dt)
'''
K = 2000
print(f"{'N':>5} {'writer':>8} {'first record B':>15} {'later records B (mean of next)':>31}")
for n in (8, 64, 1024):
    for name, tree in (("main", "/work/main"), ("branch", "/work/wt/leanread")):
        out = f"/tmp/lr/bytes/{name}-{n}"
        subprocess.run(["rm", "-rf", out])
        r = subprocess.run([PY, "-c", f"TREE={tree!r}\nOUT={out!r}\nN={n}\nK={K}\n" + CODE],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-1500:]); sys.exit(1)
        first, later, m, dt = r.stdout.split()
        print(f"{n:>5} {name:>8} {int(first):>15,} {float(later):>24,.0f} ({int(m) - 1:,})"
              f"   read_groups of these {int(m):,} lines: {float(dt):.2f} s cpu", flush=True)
        subprocess.run(["rm", "-rf", out])
