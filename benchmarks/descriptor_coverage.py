#!/usr/bin/env python3
"""How often does the three-term fit's 95% interval of us_per_desc contain the truth?

Simulated descriptor sweeps (kvbench/fit/sim.py simulate_cut_run: one link, several cuts of
the KV timed in the same interleaved rounds, time = setup + bytes / rate + descriptors x us,
under the fit's usual correlated load) with a planted per-descriptor cost, each fitted by
`kvbench fit`; per scenario the share of runs whose intervals of us_per_desc, setup and rate
contain the truth, and the median width of the us_per_desc interval relative to the truth.
docs/descriptors.md quotes its output; tests/fit/test_descriptor_fit.py runs the first
scenario with 100 runs.

    .venv/bin/python benchmarks/descriptor_coverage.py [--trials 200]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvbench.cli import ArgumentParser  # noqa: E402
from kvbench.fit.fitting import fit_records  # noqa: E402
from kvbench.fit.sim import CUT_POINTS, JOINED_POINTS, Load, simulate_cut_run  # noqa: E402

TRUTH = {"setup_ms": 0.5, "effective_gb_s": 2.0, "us_per_desc": 1.0, "us_per_merged_desc": 0.0}
THREE_BS = tuple(p for p in CUT_POINTS if p[1] in (1, 4, 16))
SMALL_COST = {"us_per_desc": 0.1}
SCENARIOS = [
    ("2 sizes x 5 block sizes, 20 rounds (the CI test)", {}),
    ("10 rounds (the minimum for an interval)", dict(rounds=10)),
    ("40 rounds", dict(rounds=40)),
    ("2 sizes x 3 block sizes", dict(points=THREE_BS)),
    ("5% per-point shift", dict(load=Load(size_shift=0.05))),
    ("8% round shift and drift", dict(load=Load(round_shift=0.08, drift=0.08))),
    ("a small cost: 0.1 us per descriptor", SMALL_COST),
    ("3 runs of 10 rounds", dict(rounds=10, runs=3)),
    ("blocks: 3 runs of 20", dict(order="blocks", runs=3)),
    ("blocks: 5 runs of 20", dict(order="blocks", runs=5)),
    ("blocks: 3 runs of 20, no drift", dict(order="blocks", runs=3, load=Load(drift=0.0))),
    ("a transport that joins: scattered and contiguous ids, 1.25 + 1.85 us (NIXL-like)",
     dict(points=JOINED_POINTS, us_per_desc=1.25, us_per_merged_desc=1.85)),
]


def run(trials: int, kw: dict) -> dict:
    kw = dict(kw)
    runs, truth = kw.pop("runs", 1), {**TRUTH, **{k: kw.pop(k) for k in list(kw) if k in TRUTH}}
    kw.setdefault("rounds", 20)
    hits, widths, merged = np.zeros(3), [], []
    for t in range(trials):
        rng = np.random.default_rng([11, t])
        recs = [r for i in range(runs)
                for r in simulate_cut_run(rng, run_id=f"sim-{i}", **truth, **kw)]
        (gf,), _ = fit_records(recs, n_boot=1000, seed=0)
        g = gf.record
        cis = (g["us_per_desc_ci95"], g["setup_ms_ci95"], g["effective_gb_s_ci95"])
        want = (truth["us_per_desc"], truth["setup_ms"], truth["effective_gb_s"])
        hits += [ci is not None and (ci[0] is None or ci[0] <= w) and (ci[1] is None or w <= ci[1])
                 for ci, w in zip(cis, want, strict=True)]
        if truth["us_per_merged_desc"]:  # the second term, where there is one
            ci = g.get("us_per_merged_desc_ci95")
            merged.append(ci is not None and ci[0] <= truth["us_per_merged_desc"] <= ci[1])
        if cis[0] is not None:
            widths.append((cis[0][1] - cis[0][0]) / truth["us_per_desc"])
    return {"us": hits[0] / trials, "setup": hits[1] / trials, "rate": hits[2] / trials,
            "width": float(np.median(widths)) if widths else float("nan"),
            "merged": float(np.mean(merged)) if merged else None}


def main(argv=None) -> int:
    p = ArgumentParser(prog="descriptor_coverage.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200, help="simulated sweeps per scenario")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    print(f"{args.trials} simulated sweeps per scenario; truth {TRUTH}")
    print("| scenario | us_per_desc covered | setup / rate covered | us_per_desc CI width |")
    print("|---|---|---|---|")
    for name, kw in SCENARIOS:
        r = run(args.trials, kw)
        second = "" if r["merged"] is None else f" (us_per_merged_desc {r['merged']:.3f})"
        print(f"| {name} | {r['us']:.3f}{second} | {r['setup']:.3f} / {r['rate']:.3f} | "
              f"{100 * r['width']:.1f}% |", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
