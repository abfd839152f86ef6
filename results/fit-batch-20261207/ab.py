"""A/B: main (6ece984, exported to /tmp/bf_main) and branch batchfit, alternately, on the same
records; `python -m kvbench.matrix report` in a child each: wall, CPU (user+sys), peak RSS."""
import importlib.util, json, os, subprocess, sys, time, filecmp
from pathlib import Path
PY = "/work/wt/batchfit/.venv/bin/python"
TREES = {"main": "/tmp/bf_main", "branch": "/work/wt/batchfit"}
spec = importlib.util.spec_from_file_location("ms", "/work/wt/batchfit/benchmarks/matrix_scale.py")
ms = importlib.util.module_from_spec(spec); spec.loader.exec_module(ms)
from kvbench.records.write import write_records
ns = [int(x) for x in sys.argv[1].split(",")]
reps = int(sys.argv[2])
first = int(sys.argv[3]) if len(sys.argv) > 3 else 0
work = Path("/tmp/bf_ab")
def load():
    return open("/proc/loadavg").read().split()[0]
for n in ns:
    folder = work / f"n{n}"
    folder.mkdir(exist_ok=True)
    jsonl = next(folder.glob("kvbench-p2p-*.jsonl"), None)
    if jsonl is None:
        jsonl, _ = write_records(folder, list(ms.records(n, 8, 20, 0)), "kvbench-p2p")
    for rep in range(first, first + reps):
        order = ["main", "branch"] if rep % 2 == 0 else ["branch", "main"]
        for which in order:
            out = folder / f"{which}-{rep}"
            out.mkdir(exist_ok=True)
            l0 = load(); t0 = time.perf_counter()
            p = subprocess.Popen([PY, "-m", "kvbench.matrix", "report", str(jsonl), "--out", str(out),
                                  "--bootstrap", "1000"], cwd=TREES[which], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            text = p.stdout.read()
            _, status, ru = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t0
            print(json.dumps({"n": n, "pairs": n * (n - 1), "which": which, "rep": rep, "wall_s": round(wall, 1),
                              "cpu_s": round(ru.ru_utime + ru.ru_stime, 1), "peak_mib": round(ru.ru_maxrss / 1024),
                              "status": os.waitstatus_to_exitcode(status), "load_before": l0, "load_after": load(),
                              "stdout_lines": len(text.splitlines())}), flush=True)
        # the outputs of main and branch: the same bytes (but the document's creation time)
        a, b = folder / f"main-{rep}", folder / f"branch-{rep}"
        def by_kind(d):
            return {f.name.split(".", 1)[1]: f for f in d.iterdir()}
        fa, fb = by_kind(a), by_kind(b)
        same = {}
        for kind, f in sorted(fa.items()):
            g = fb.get(kind)
            if g is None:
                same[kind] = "missing"
            elif kind == "json":
                ja, jb = json.loads(f.read_text()), json.loads(g.read_text())
                for j in (ja, jb):
                    j.pop("created", None)
                same[kind] = ja == jb
            elif kind != "png":
                same[kind] = filecmp.cmp(f, g, shallow=False)
        print(json.dumps({"n": n, "rep": rep, "identical": same}), flush=True)
