"""Intervals for `kvbench lab agree`: ratios of positive times, and feature costs.

What is compared: per rate, the engine's mean transfer time (an engine run's exact mean over
its transfers) and kvbench's (a p2p job's mean over its handoffs). The quantity of interest
is the ratio of their long-run means, engine / kvbench. Why the interval is built this way:

- The unit is the **run**. Runs of one side differ from each other by more than their
  requests' spread explains (the share of posts that lose a scheduler tick moves from run to
  run), so requests pooled across runs give intervals far too narrow; a run mean already
  carries its requests' noise. Engine runs and p2p jobs are independent (taken minutes
  apart): they are not paired.
- A ratio of positive times is positive and skewed: the interval is built for log(ratio) =
  log(engine mean) - log(kvbench mean), each term's standard error by the delta method
  (relative standard error of a mean of run means), Welch-Satterthwaite degrees of freedom,
  Student t; then exponentiated. It never contains a value <= 0.
- Too few runs: with fewer than MIN_RUNS on a side no interval is printed, and the reason
  is. Two runs give one degree of freedom (t = 12.7): an interval that says nothing in the
  form of a number. A bootstrap over runs is no cure at 3 runs (a handful of distinct
  resamples, too narrow), which is why a t interval is used.
- A prediction that is one number from a fit (the plain link fit) enters with the fit's own
  95% band as a known log-scale standard error, and the engine runs' degrees of freedom
  (Welch-Satterthwaite's larger df undercovers there: ~92% in the simulation).

Coverage is checked by simulation (kvbench.lab.agree.sim, tests/lab/test_agree_coverage.py,
benchmarks/agree_coverage.py). Feature costs are differences (they can be negative): a paired
Student t over repeats (the factorial's cells of one repeat share its MPI job), with the
same minimum.
"""

from __future__ import annotations

import math
import statistics

from scipy import stats

MIN_RUNS = 3
LEVEL = 0.95
RATIO_METHOD = ("engine mean / kvbench mean of run means; 95% interval on the log scale "
                f"(delta method, Welch t), unit of resampling: the run; none from fewer than "
                f"{MIN_RUNS} runs a side")
DIFF_METHOD = (f"95% Student t over repeats (paired within a p2p job); none from fewer than "
               f"{MIN_RUNS} repeats")


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def _rel_var(xs: list[float]) -> float:
    """Squared relative standard error of the mean of xs (delta method for its log)."""
    m = statistics.fmean(xs)
    return statistics.variance(xs) / (len(xs) * m * m)


def ratio_interval(num, den, den_band: list[float] | None = None) -> dict:
    """Ratio of means num / den with its 95% log-scale interval.

    num: run means of the engine (positive). den: run means of kvbench (a list), or one
    predicted value (a number) whose 95% band `den_band` [lo, hi] is its uncertainty.
    Returns mean, ci95 ([lo, hi] or None), n, n_den, df and `why` when there is no interval.
    """
    a = [x for x in _finite(num) if x > 0]
    one = not isinstance(den, (list, tuple))
    b = [] if one else [x for x in _finite(den) if x > 0]
    if one:
        d = float(den) if den is not None and den > 0 else None
    else:
        d = statistics.fmean(b) if b else None
    out = {"mean": None, "ci95": None, "n": len(a), "n_den": 1 if one else len(b), "df": None,
           "why": None}
    if not a or d is None:
        out["why"] = "no engine runs" if not a else "no prediction"
        return out
    r = statistics.fmean(a) / d
    out["mean"] = r
    if len(a) < MIN_RUNS or (not one and len(b) < MIN_RUNS):
        short = (f"{len(a)} engine run(s)" if len(a) < MIN_RUNS else f"{len(b)} p2p job(s)")
        out["why"] = f"{short}: an interval needs at least {MIN_RUNS} runs a side"
        return out
    va = _rel_var(a)
    if one:
        vb = ((math.log(den_band[1] / den_band[0]) / (2 * stats.norm.ppf(0.5 + LEVEL / 2))) ** 2
              if den_band and den_band[0] > 0 else 0.0)
        df = len(a) - 1  # not Welch's larger df: with one side known it undercovers (~92%)
    else:
        vb = _rel_var(b)
        denom = va * va / (len(a) - 1) + vb * vb / (len(b) - 1)
        df = (va + vb) ** 2 / denom if denom > 0 else math.inf
    if va + vb <= 0:
        out["why"] = "no spread between runs: no interval"
        return out
    half = stats.t.ppf(0.5 + LEVEL / 2, df) * math.sqrt(va + vb)
    out.update(ci95=[r * math.exp(-half), r * math.exp(half)], df=df if math.isfinite(df) else None)
    return out


def diff_interval(xs) -> dict:
    """Mean of per-repeat differences and its 95% Student t interval (none from fewer than
    MIN_RUNS repeats, the reason in `why`)."""
    xs = _finite(xs)
    out = {"mean": statistics.fmean(xs) if xs else None, "ci95": None, "n": len(xs), "why": None}
    if len(xs) < MIN_RUNS:
        out["why"] = f"{len(xs)} repeat(s): an interval needs at least {MIN_RUNS}"
        return out
    half = stats.t.ppf(0.5 + LEVEL / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    out["ci95"] = [out["mean"] - half, out["mean"] + half]
    return out
