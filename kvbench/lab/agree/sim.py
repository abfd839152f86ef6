"""Simulated engine runs and p2p jobs with known means, to check agree's intervals' coverage.

A side (the engine, or kvbench's engine shape) runs `runs` runs of `requests` transfers.
Each transfer is built the way the lab's measurements say its time is made (docs/lab.md,
"Where the transfer time goes"):

    post  = a scheduler tick (4 ms, sometimes two) with the run's tick share q, else a short
            post uniform in [0.05, 1] ms;
    xfer  = post + a small look gap, plus, when the READ is still in flight at the posting
            step's look (the run's share f), the wait for a later step (log-normal).

q and f move from run to run (Beta draws around the side's means): that between-run spread
is what makes the run, not the request, the unit. The true long-run means are exact
(`truth`), so the share of simulated runs whose interval contains the true ratio is the
interval's coverage. Used by tests/lab/test_agree_coverage.py (fast) and
benchmarks/agree_coverage.py (more trials and scenarios).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TICK_MS = 4.0  # CONFIG_HZ=250
TWO_TICKS = 0.1  # share of tick-losing posts that lose two
TICK_JITTER_MS = 0.3
SHORT_MS = (0.05, 1.0)
GAP_MS = 0.02
WAIT_SIGMA = 0.5  # log-normal sigma of a late READ's wait for the next step
PLAIN_MS, PLAIN_SIGMA = 0.3, 0.05  # a link fit's prediction and its log-scale error


@dataclass(frozen=True)
class Side:
    """One side's parameters: tick share q and in-flight share f (means and run-to-run sd),
    the median wait of a late READ (ms)."""

    q: float = 0.35
    q_sd: float = 0.08
    f: float = 0.04
    f_sd: float = 0.02
    wait_ms: float = 12.0

    def truth(self) -> dict[str, float]:
        """Exact long-run means (ms) of post and xfer."""
        tick = TICK_MS * (1 + TWO_TICKS) + TICK_JITTER_MS / 2
        post = self.q * tick + (1 - self.q) * sum(SHORT_MS) / 2
        wait = self.wait_ms * math.exp(WAIT_SIGMA ** 2 / 2)
        return {"post": post, "xfer": post + GAP_MS + self.f * wait}


ENGINE = Side()
KVBENCH = Side(q=0.28, q_sd=0.10, f=0.02, f_sd=0.015, wait_ms=10.0)


def _beta(rng: np.random.Generator, mean: float, sd: float) -> float:
    if sd <= 0:
        return mean
    k = mean * (1 - mean) / sd ** 2 - 1
    return float(rng.beta(mean * k, (1 - mean) * k))


def simulate(rng: np.random.Generator, side: Side, runs: int, requests: int) -> dict:
    """Per run: the mean post and xfer (ms) and the per-request values."""
    out: dict = {"post": [], "xfer": [], "requests": []}
    for _ in range(runs):
        q, f = _beta(rng, side.q, side.q_sd), _beta(rng, side.f, side.f_sd)
        ticks = np.where(rng.random(requests) < TWO_TICKS, 2, 1) * TICK_MS
        post = np.where(rng.random(requests) < q, ticks + rng.uniform(0, TICK_JITTER_MS, requests),
                        rng.uniform(*SHORT_MS, requests))
        late = rng.random(requests) < f
        xfer = post + GAP_MS + np.where(late, rng.lognormal(math.log(side.wait_ms), WAIT_SIGMA,
                                                            requests), 0.0)
        out["post"].append(float(post.mean()))
        out["xfer"].append(float(xfer.mean()))
        out["requests"].append({"post": post, "xfer": xfer})
    return out


def coverage(method, trials: int, runs: int, requests: int, p2p_runs: int | None = None,
             p2p_requests: int = 60, engine: Side = ENGINE, kvbench: Side = KVBENCH,
             seed: int = 0) -> dict:
    """Share of trials whose interval for each ratio contains the truth.

    method(engine_sim, kvbench_sim, quantity) -> [lo, hi] or None (refused); quantity is
    post, xfer, or plain (engine xfer over one fitted prediction: kvbench_sim["plain"] is
    (prediction, its 95% band), drawn around PLAIN_MS with the fit's error). Returns per
    quantity the coverage among trials with an interval, how many had one, how many
    intervals contained a value <= 0, and the median relative half-width."""
    p2p_runs = runs if p2p_runs is None else p2p_runs
    te, tk = engine.truth(), kvbench.truth()
    te["plain"], tk["plain"] = te["xfer"], PLAIN_MS
    res = {q: {"covered": 0, "with_interval": 0, "impossible": 0, "half": []} for q in te}
    for t in range(trials):
        rng = np.random.default_rng([seed, t])
        e = simulate(rng, engine, runs, requests)
        k = simulate(rng, kvbench, p2p_runs, p2p_requests)
        pred = PLAIN_MS * math.exp(rng.normal(0.0, PLAIN_SIGMA))
        k["plain"] = (pred, [pred * math.exp(-1.96 * PLAIN_SIGMA), pred * math.exp(1.96 * PLAIN_SIGMA)])
        for q, r in res.items():
            ci = method(e, k, q)
            if ci is None:
                continue
            true = te[q] / tk[q]
            r["with_interval"] += 1
            r["covered"] += ci[0] <= true <= ci[1]
            r["impossible"] += ci[0] <= 0
            r["half"].append((ci[1] - ci[0]) / 2 / true)
    return {q: {"coverage": float(r["covered"] / r["with_interval"]) if r["with_interval"] else None,
                "with_interval": r["with_interval"], "impossible": int(r["impossible"]),
                "trials": trials, "truth": te[q] / tk[q],
                "median_half_width": float(np.median(r["half"])) if r["half"] else None}
            for q, r in res.items()}


def agree_method(e: dict, k: dict, q: str) -> list[float] | None:
    """The interval `kvbench lab agree` prints (kvbench.lab.agree.stats), for `coverage`."""
    from kvbench.lab.agree.stats import ratio_interval

    if q == "plain":
        return ratio_interval(e["xfer"], k["plain"][0], k["plain"][1])["ci95"]
    return ratio_interval(e[q], k[q])["ci95"]
