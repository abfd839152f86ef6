"""The matrix report's per-pair fit, batched (kvbench.fit.batch) against one fit_group per pair
(issue 44 item 3), in one run on the same groups.

    .venv/bin/python benchmarks/fit_batch.py --ranks 128        # 16,256 pairs

The groups are benchmarks/matrix_scale.py's synthetic N-rank matrix (two sizes, 20 rounds, one
sample per round and size, planted slow pairs), folded as `kvbench matrix report` folds them.
`kvbench.matrix.analyze.fit_pairs` runs on every pair (the batched path); fit_group runs on an
evenly spread sample of --baseline-pairs of them (fit_group at ~5 ms a pair would take minutes
on all); the sample's records must be equal (draws to the last bit) or the run fails. Prints
CPU and wall microseconds per pair for both and their ratio, and the load average: on a shared
machine compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _scale_module():
    spec = importlib.util.spec_from_file_location("matrix_scale", ROOT / "benchmarks" /
                                                  "matrix_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def same(a, b) -> bool:
    """Records equal, numpy arrays equal to the last bit (dtype and shape included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return a == b


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=128, help="N: N (N - 1) pairs (default 128)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--baseline-pairs", type=int, default=300,
                   help="pairs fitted one by one with fit_group (default 300)")
    args = p.parse_args(argv)
    from kvbench.fit.data import group_records
    from kvbench.fit.fitting import fit_group
    from kvbench.matrix.analyze import _pair_of_spec, fit_pairs

    groups = group_records(_scale_module().records(args.ranks, 8, args.rounds, 0))
    run = SimpleNamespace(groups={_pair_of_spec(g.spec): g for g in groups})
    load0 = os.getloadavg()[0]
    fits, cpu_b, wall_b = timed(lambda: fit_pairs(run, args.bootstrap, 0, raw_draws=True))
    keys = sorted(run.groups)
    sample = keys[:: max(1, len(keys) // args.baseline_pairs)][: args.baseline_pairs]
    old, cpu_o, wall_o = timed(lambda: [fit_group(run.groups[k], args.bootstrap, 0, None, True)
                                        .record for k in sample])
    load1 = os.getloadavg()[0]
    bad = [k for k, rec in zip(sample, old, strict=True) if not same(fits[k], rec)]
    P, S = len(keys), len(sample)
    print(f"fit_pairs, N = {args.ranks}: {P:,} pairs, {args.bootstrap} resamples, "
          f"{args.rounds} rounds, 2 sizes; load average {load0:.1f} -> {load1:.1f} "
          f"({os.cpu_count()} CPUs)")
    print(f"  batched (all {P:,} pairs):      {cpu_b / P * 1e6:8.0f} us CPU a pair, "
          f"{wall_b / P * 1e6:8.0f} us wall ({wall_b:.1f} s)")
    print(f"  fit_group (sample of {S}):    {cpu_o / S * 1e6:8.0f} us CPU a pair, "
          f"{wall_o / S * 1e6:8.0f} us wall")
    print(f"  ratio (CPU a pair):           {cpu_o / S / (cpu_b / P):8.1f}x")
    print(f"  records of the sample equal:  {'yes' if not bad else f'NO, {len(bad)} differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
