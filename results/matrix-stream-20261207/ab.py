"""main (6ece984, exported to /tmp/bigreport/main-src) and branch bigreport alternately on the
same records: `python -m kvbench.matrix report` in a child, wall s and peak RSS (wait4)."""
import os, subprocess, sys, time
from pathlib import Path
TREES = {"main": "/tmp/bigreport/main-src", "branch": "/work/wt/bigreport"}
PY = "/work/wt/bigreport/.venv/bin/python"
def one(tree, src, out):
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.Popen([PY, "-m", "kvbench.matrix", "report", str(src), "--out", str(out)],
                         cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, st, ru = os.wait4(p.pid, 0)
    return time.perf_counter() - t0, ru.ru_maxrss / 1024, os.waitstatus_to_exitcode(st), err[-300:]
print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
for n in [int(x) for x in sys.argv[1].split(",")]:
    src = next(Path(f"/tmp/bigreport/before/n{n}").glob("kvbench-p2p-*.jsonl"))
    for k, name in enumerate(["main", "branch", "main", "branch"][: int(sys.argv[2])]):
        wall, peak, code, err = one(TREES[name], src, Path(f"/tmp/bigreport/ab/n{n}-{name}-{k}"))
        print(f"N={n:>4} {name:>6}: {wall:7.1f} s  peak RSS {peak:6.0f} MiB  exit {code} {err.decode()[:200] if code else ''}", flush=True)
print("uptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
