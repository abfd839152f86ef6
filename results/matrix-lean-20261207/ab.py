"""A/B: per-record cost of `kvbench matrix report`'s read (analyze.read_run) on N-rank records:
main's reader on whole records (main's generator) vs this branch's on lean ones, alternately."""
import subprocess, sys, time, os
PY = "/work/wt/leanread/.venv/bin/python"
TREES = {"main": "/work/main", "branch": "/work/wt/leanread"}
GEN = '''
import sys; sys.path.insert(0, TREE); sys.path.insert(0, TREE + "/benchmarks")
from pathlib import Path
import matrix_scale
from kvbench.records.write import write_records
folder = Path(OUT); folder.mkdir(parents=True, exist_ok=True)
j, _ = write_records(folder, list(matrix_scale.records(N, 8, 20, 0)), "kvbench-p2p")
print(j)
'''
READ = '''
import sys, time; sys.path.insert(0, TREE)
import kvbench; assert kvbench.__file__.startswith(TREE), kvbench.__file__
from kvbench.matrix.analyze import read_run
n = sum(1 for _ in open(SRC))
t = time.process_time(); w = time.perf_counter(); run = read_run([SRC])
cpu, wall = time.process_time() - t, time.perf_counter() - w
assert len(run.pairs) == N * (N - 1)
print(f"{cpu / n * 1e6:.1f} {wall / n * 1e6:.1f} {n}")
'''
def py(code, **kw):
    pre = "".join(f"{k} = {v!r}\n" for k, v in kw.items())
    r = subprocess.run([PY, "-c", pre + code], capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-2000:]); sys.exit(1)
    return r.stdout.strip().splitlines()[-1]
uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
print("uptime before:", uptime(), flush=True)
for n in map(int, sys.argv[1].split(",")):
    files = {}
    for name, tree in TREES.items():
        out = f"/tmp/lr/ab/{name}-n{n}"
        subprocess.run(["rm", "-rf", out])
        files[name] = py(GEN, TREE=tree, OUT=out, N=n)
        print(f"N={n} {name} records: {os.path.getsize(files[name]) / 1e6:.1f} MB", flush=True)
    for rep in range(2):
        for label, tree, src in (("main reader, whole records", TREES["main"], files["main"]),
                                 ("branch reader, lean records", TREES["branch"], files["branch"]),
                                 ("branch reader, whole records", TREES["branch"], files["main"])):
            cpu, wall, nrec = py(READ, TREE=tree, SRC=src, N=n).split()
            print(f"N={n} rep {rep} {label:30s} {cpu:>7s} us/record cpu  {wall:>7s} us/record wall  ({nrec} records)", flush=True)
print("uptime after:", uptime())
