"""Measure the two stack findings of docs/lab.md section 3 with each workaround on and off.

    python -m kvbench.lab.stack.findings PLAN.yaml --out DIR [--rate 4] [--seconds 20]

For each configuration (both workarounds on; NIXL's own busy-poll; vLLM's re-pinning)
the disaggregated deployment is started, then measured:
- idle CPU: CPU seconds of every process in each instance's group over --seconds of no
  traffic, as cores (1.0 = one core busy);
- where the model thread may run: the CPU affinity list of each worker thread
  (/proc/PID/task/*/status) - the re-pinning shows as prefill's thread on decode's core;
- TTFT at --rate requests/s: one bounded `vllm bench serve` run (vLLM's own mean/p99).
Results go to DIR/findings.json and DIR/findings.md. A busy machine blurs the TTFT part;
the report records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvbench.cli import arg_float
from kvbench.lab.config import Workarounds
from kvbench.lab.load import bench
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.procs import stop_on_exit

CONFIGS = {
    "workarounds on": Workarounds(1000, True),
    "NIXL busy-poll (pthrDelay 0)": Workarounds(0, True),
    "vLLM re-pinning kept": Workarounds(1000, False),
}
TICKS = os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(int(d.name))
    return out


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def idle_cores(services, seconds: float) -> dict[str, float]:
    pids = {s.name: group_pids(s.pid) for s in services}
    before = {n: cpu_ticks(p) for n, p in pids.items()}
    time.sleep(seconds)
    return {n: round((cpu_ticks(p) - before[n]) / TICKS / seconds, 3) for n, p in pids.items()}


def worker_affinity(service) -> list[str]:
    """Cpus_allowed_list of the threads of the instance's VLLM::Worker process."""
    out = set()
    for pid in group_pids(service.pid):
        try:
            if "Worker" not in Path(f"/proc/{pid}/comm").read_text():
                continue
            for task in Path(f"/proc/{pid}/task").iterdir():
                status = (task / "status").read_text()
                out.add(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")))
        except (OSError, StopIteration):
            continue
    return sorted(out)


def ttft(st, model_dir: Path, rate: float, seconds: float, folder: Path) -> dict:
    run = bench.BenchRun(st.endpoint, deploy.SERVED_NAME, str(model_dir), rate,
                         bench.num_prompts(rate, seconds, 0), 256, 32, 0)
    out = folder / "vllm-bench.json"
    ok, why = bench.run_bounded(bench.bench_cmd(str(labenv.lab_bin("vllm")), run, out),
                                folder / "vllm-bench.log", bench.wall_bound_s(run, 60))
    if not ok:
        return {"error": why}
    r = json.loads(out.read_text())
    return {k: r.get(k) for k in ("completed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                  "mean_tpot_ms", "request_throughput")}


def measure(cfg, name: str, w: Workarounds, out: Path, rate: float, seconds: float) -> dict:
    from kvbench.lab.stack.deploy import model_for

    cfg = replace(cfg, workarounds=w)
    folder = out / name.split(" (")[0].replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    started: list = []
    with stop_on_exit(started):
        model = model_for(cfg)
        st = deploy.bring_up(cfg, "disaggregated", model, folder / "logs", started)
        time.sleep(5)
        inst = [s for s in st.services if s.role != "proxy"]
        res = {"config": name, "workarounds": vars(w), "idle_cores": idle_cores(inst, seconds),
               "worker_thread_affinity": {s.name: worker_affinity(s) for s in inst},
               "pinned_core": {s.name: s.cores for s in inst}, "load_before": os.getloadavg()[0]}
        res["ttft"] = ttft(st, model, rate, seconds, folder)
        res["load_after"] = os.getloadavg()[0]
    return res


def markdown(results: list[dict], rate: float) -> str:
    lines = ["| configuration | idle cores prefill / decode | worker thread CPUs prefill / decode | "
             f"TTFT mean / p99 ms at {rate:g} req/s | load avg |", "|---|---|---|---|---|"]
    for r in results:
        ic, aff, t = r["idle_cores"], r["worker_thread_affinity"], r["ttft"]
        lines.append(f"| {r['config']} | {ic.get('prefill0')} / {ic.get('decode0')} | "
                     f"{','.join(aff.get('prefill0', []))} / {','.join(aff.get('decode0', []))} | "
                     f"{t.get('mean_ttft_ms', float('nan')):.0f} / {t.get('p99_ttft_ms', float('nan')):.0f} | "
                     f"{r['load_before']:.1f}-{r['load_after']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from kvbench.lab.planfile import load_lab_section

    p = argparse.ArgumentParser(prog="python -m kvbench.lab.stack.findings")
    p.add_argument("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--rate", type=arg_float(0, 1e6, lo_open=True), default=4.0)
    p.add_argument("--seconds", type=arg_float(0, 1e7, lo_open=True), default=20.0)
    args = p.parse_args(argv)
    cfg = load_lab_section(args.plan)
    out = Path(args.out)
    results = []
    for name, w in CONFIGS.items():
        print(f"findings: {name} ...", file=sys.stderr, flush=True)
        results.append(measure(cfg, name, w, out, args.rate, args.seconds))
    (out / "findings.json").write_text(json.dumps({"command": sys.argv, "results": results}, indent=2) + "\n")
    (out / "findings.md").write_text(markdown(results, args.rate))
    print(markdown(results, args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
