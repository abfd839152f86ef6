#!/usr/bin/env python3
"""How often do `kvbench lab agree`'s ratio intervals contain the truth?

Simulates engine runs and p2p jobs whose transfers are made as the lab's are (a post that
sometimes loses a scheduler tick, a READ sometimes still in flight at its step's look and
seen a step later; both shares moving from run to run: kvbench/lab/agree/sim.py), builds
agree's interval for each ratio (post, xfer, xfer over the plain fit's prediction) and, for
comparison, an interval that pools requests as if independent, and prints per scenario the
share of simulated runs whose interval contains the true ratio, how many intervals held a
value <= 0, and the median half-width relative to the truth. docs/lab.md quotes its output.

    .venv/bin/python benchmarks/agree_coverage.py [--trials 2000]

2000 trials per scenario take about a minute on two cores.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvbench.cli import ArgumentParser  # noqa: E402
from kvbench.lab.agree.sim import ENGINE, KVBENCH, agree_method, coverage  # noqa: E402
from tests.lab.pooled_interval import pooled_requests  # noqa: E402

SCENARIOS = [
    ("3 runs a side, 30 transfers a run (1 rps)", dict(runs=3, requests=30)),
    ("3 runs, 120 transfers a run (4 rps)", dict(runs=3, requests=120)),
    ("5 runs, 30 transfers", dict(runs=5, requests=30)),
    ("3 engine runs, 6 p2p jobs", dict(runs=3, requests=30, p2p_runs=6)),
    ("3 runs, rare late READs (engine 2 %)",
     dict(runs=3, requests=30, engine=replace(ENGINE, f=0.02, f_sd=0.015))),
    ("3 runs, frequent late READs (engine 20 %, kvbench 2 %)",
     dict(runs=3, requests=30, engine=replace(ENGINE, f=0.20, f_sd=0.05))),
    ("3 runs, large run-to-run spread",
     dict(runs=3, requests=30, engine=replace(ENGINE, q_sd=0.15, f_sd=0.03),
          kvbench=replace(KVBENCH, q_sd=0.15))),
    ("3 runs, no run-to-run spread",
     dict(runs=3, requests=30, engine=replace(ENGINE, q_sd=0.0, f_sd=0.0),
          kvbench=replace(KVBENCH, q_sd=0.0, f_sd=0.0))),
    ("2 runs a side (no interval by design)", dict(runs=2, requests=30)),
]


def _cell(r: dict) -> str:
    if not r["with_interval"]:
        return "no interval"
    return (f"{r['coverage']:.3f} (w {r['median_half_width']:.2f}"
            + (f", {r['impossible']} <= 0" if r["impossible"] else "") + ")")


def main(argv=None) -> int:
    p = ArgumentParser(prog="agree_coverage.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=2000, help="simulated runs per scenario")
    args = p.parse_args(argv)
    print(f"{args.trials} simulated runs per scenario; engine {ENGINE}; kvbench {KVBENCH}; "
          "p2p jobs of 60 handoffs. Cells: share covering the true ratio (w: median half-width "
          "relative to the truth)")
    print("| scenario | post | xfer | xfer / plain fit | pooled requests (wrong): post | xfer |")
    print("|---|---|---|---|---|---|")
    t0 = time.monotonic()
    for name, kw in SCENARIOS:
        a = coverage(agree_method, args.trials, **kw)
        b = coverage(pooled_requests, args.trials, **kw)
        print(f"| {name} | {_cell(a['post'])} | {_cell(a['xfer'])} | {_cell(a['plain'])} | "
              f"{_cell(b['post'])} | {_cell(b['xfer'])} |", flush=True)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
