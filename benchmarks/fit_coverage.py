#!/usr/bin/env python3
"""How often do kvbench fit's 95% intervals contain the truth under correlated load?

Simulates p2p runs of a link with known setup and rate (kvbench/fit/sim.py: per-round and
per-size shifts, stalled samples and rounds, a slow drift), fits each with kvbench fit and with
the per-sample bootstrap kvbench used before (tests/fit/per_sample_bootstrap.py), and prints, per
scenario, the share of runs whose setup and rate intervals contain the truth, with the median
relative width of the rate interval. docs/fit-and-plan.md quotes its output.

    .venv/bin/python benchmarks/fit_coverage.py [--trials 200] [--quick]

A run of 200 trials per scenario takes a few minutes on two cores (the old method dominates).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvbench.cli import ArgumentParser  # noqa: E402
from kvbench.fit.sim import SIZES, Load, coverage, kvbench_method  # noqa: E402
from tests.fit.per_sample_bootstrap import Samples, fit_line  # noqa: E402

SCENARIOS = [
    ("rounds: 20 rounds, default load (the CI test)", dict(rounds=20)),
    ("rounds: 10 rounds (the minimum for an interval)", dict(rounds=10)),
    ("rounds: 40 rounds", dict(rounds=40)),
    ("rounds: 20 rounds, no per-size shift", dict(rounds=20, load=Load(size_shift=0.0))),
    ("rounds: 20 rounds, 5% per-size shift", dict(rounds=20, load=Load(size_shift=0.05))),
    ("rounds: 20 rounds, 8% round shift and drift",
     dict(rounds=20, load=Load(round_shift=0.08, drift=0.08))),
    ("rounds: 20 rounds, 8 sizes 4 KiB .. 64 MiB",
     dict(rounds=20, sizes=tuple(1 << k for k in range(12, 27, 2)))),
    ("rounds: 3 runs of 10 rounds", dict(rounds=10, runs=3)),
    ("blocks: 1 run of 20 (no interval by design)", dict(rounds=20, order="blocks")),
    ("blocks: 3 runs of 20 (the minimum)", dict(rounds=20, order="blocks", runs=3)),
    ("blocks: 5 runs of 20", dict(rounds=20, order="blocks", runs=5)),
]


def per_sample_bootstrap(records):
    b = np.concatenate([[r["bytes"]] * len(r["samples_ms"]) for r in records]).astype(np.int64)
    y = np.concatenate([r["samples_ms"] for r in records])
    res = fit_line(Samples(b, y), n_boot=200, seed=0)
    return res.setup_ci, res.rate_ci()


def widths(method, trials: int, **kw) -> float:
    """Median width of the rate interval relative to the true rate (a few trials)."""
    from kvbench.fit.sim import simulate

    out = []
    for t in range(min(trials, 40)):
        _, rci = method(simulate(np.random.default_rng([7, t]), setup_ms=0.5, effective_gb_s=2.0, **kw))
        if rci is not None and None not in rci:
            out.append((rci[1] - rci[0]) / 2.0)
    return float(np.median(out)) if out else float("nan")


def _width(method, trials: int, kw: dict) -> str:
    w = widths(method, trials, **kw)
    return "-" if np.isnan(w) else f"{100 * w:.1f}%"


def _cell(res: dict) -> str:
    if not res["with_interval"]:
        return "no interval"
    return f"{res['setup']:.3f} / {res['rate']:.3f}"


def main(argv=None) -> int:
    p = ArgumentParser(prog="fit_coverage.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200, help="simulated runs per scenario")
    p.add_argument("--quick", action="store_true", help="only the first two scenarios")
    args = p.parse_args(argv)
    new = kvbench_method(1000)
    print(f"truth: setup 0.5 ms, 2.0 GB/s; sizes {', '.join(f'{s:,}' for s in SIZES)} B unless "
          f"stated; {args.trials} simulated runs per scenario; default load {Load()}")
    print("| scenario | kvbench fit: setup / rate covered | rate CI width | "
          "per-sample bootstrap (old) | old width |")
    print("|---|---|---|---|---|")
    t0 = time.monotonic()
    for name, kw in SCENARIOS[:2] if args.quick else SCENARIOS:
        a = coverage(new, trials=args.trials, **kw)
        b = coverage(per_sample_bootstrap, trials=args.trials, **kw)
        print(f"| {name} | {_cell(a)} | {_width(new, args.trials, kw)} | "
              f"{_cell(b)} | {_width(per_sample_bootstrap, args.trials, kw)} |", flush=True)
    print(f"({time.monotonic() - t0:.0f} s)")
    for rounds in (20, 40):
        print(lack_of_fit_false_alarms(args.trials, rounds))
    return 0


def lack_of_fit_false_alarms(trials: int, rounds: int) -> str:
    """How often the lack-of-fit test fires on a line that is right (no per-size shift)."""
    from kvbench.fit.fitting import fit_records
    from kvbench.fit.sim import simulate

    ps = []
    for t in range(trials):
        recs = simulate(np.random.default_rng([11, t]), setup_ms=0.5, effective_gb_s=2.0, rounds=rounds,
                        load=Load(size_shift=0.0))
        (gf,), _ = fit_records(recs, n_boot=1000)
        ps.append(gf.record["lack_of_fit"]["p_value"])
    ps = np.array(ps)
    return (f"lack of fit on a correct line, {rounds} rounds, {trials} runs: p < 0.05 in "
            f"{100 * np.mean(ps < 0.05):.1f}%, p < 0.01 in {100 * np.mean(ps < 0.01):.1f}%")


if __name__ == "__main__":
    sys.exit(main())
