"""A deliberately wrong interval for agree's ratios, kept so the coverage test can fail:
every request of every run pooled as if independent (what a per-request bootstrap assumes),
so the run-to-run spread is ignored and "95%" covers far less (tests/lab/test_agree_stats.py,
benchmarks/agree_coverage.py)."""

from __future__ import annotations

import math

import numpy as np


def pooled_requests(e: dict, k: dict, q: str) -> list[float] | None:
    if q == "plain":
        return None
    a = np.concatenate([r[q] for r in e["requests"]])
    b = np.concatenate([r[q] for r in k["requests"]])
    se = math.sqrt(a.var(ddof=1) / (len(a) * a.mean() ** 2)
                   + b.var(ddof=1) / (len(b) * b.mean() ** 2))
    r = a.mean() / b.mean()
    return [r * math.exp(-1.96 * se), r * math.exp(1.96 * se)]
