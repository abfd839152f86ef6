"""Synthetic request records with known answers, so the analysis can be tried without a GPU.

`cohort`: the tutorial's 100 requests of which 95 succeed and 90 meet both limits
(TTFT <= 2000 ms, TPOT <= 50 ms) -> error rate 5%, 94.7% of successes, 90% of all.

`sweep`: two deployments on a toy queueing model (a FIFO prefill queue with a fixed
service time, decode TPOT that grows with load). Aggregated decode suffers prefill
interference; disaggregated pays a KV handoff on TTFT but keeps TPOT flat until its
prefill queue saturates. It is a model for demonstrating the report, not a measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbench.records.requests import RequestRecord

COHORT_ERRORS = (13, 37, 58, 79, 96)
COHORT_SLOW_TTFT = (7, 29, 44)
COHORT_SLOW_TPOT = (66, 88)


def cohort(deployment: str = "aggregated", offered_rate_rps: float = 1.0) -> list[RequestRecord]:
    """100 requests at a fixed spacing: 5 errors, 3 with TTFT 2500 ms, 2 with TPOT 62 ms."""
    out = []
    for i in range(100):
        sched = i * 1000.0 / offered_rate_rps
        send = sched + 0.4
        if i in COHORT_ERRORS:
            out.append(RequestRecord(f"c{i:03d}", deployment, offered_rate_rps, send, "error", 0,
                                     scheduled_send_ms=sched, end_ms=send + 50.0,
                                     error="HTTP 500 (synthetic)"))
            continue
        ttft = 2500.0 if i in COHORT_SLOW_TTFT else 350.0 + (i % 7) * 20.0
        tpot = 62.0 if i in COHORT_SLOW_TPOT else 30.0 + (i % 5)
        tokens = 64
        chunks = tuple(round(send + ttft + k * tpot, 6) for k in range(tokens))
        out.append(RequestRecord(f"c{i:03d}", deployment, offered_rate_rps, send, "ok", tokens,
                                 scheduled_send_ms=sched, chunk_times_ms=chunks,
                                 chunk_tokens=(1,) * tokens, input_tokens=1000))
    return out


@dataclass(frozen=True)
class ToyServer:
    """A deployment as a FIFO prefill queue plus load-dependent decode speed (all ms)."""

    name: str
    prefill_ms: float  # service time of one prefill in the (single) queue
    handoff_ms: float  # KV transfer added to TTFT (0 when prefill and decode share GPUs)
    tpot_base_ms: float
    tpot_per_rps_ms: float  # decode slowdown per offered request/s (prefill interference)


TOY_SERVERS = (
    ToyServer("aggregated", prefill_ms=125.0, handoff_ms=0.0, tpot_base_ms=25.0, tpot_per_rps_ms=5.0),
    ToyServer("disaggregated", prefill_ms=135.0, handoff_ms=12.0, tpot_base_ms=28.0, tpot_per_rps_ms=1.0),
)


def _arrivals(rate: float, warmup: int, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson schedule (ms): `warmup` arrivals, then every arrival within duration_s after them."""
    times, t = [0.0], 0.0
    while len(times) <= warmup:
        t += rng.exponential(1000.0 / rate)
        times.append(t)
    end = times[warmup] + duration_s * 1000.0
    while True:
        t += rng.exponential(1000.0 / rate)
        if t > end:
            return np.array(times)
        times.append(t)


def _run(server: ToyServer, rate: float, sched: np.ndarray, rng: np.random.Generator,
         rid: str) -> list[RequestRecord]:
    n = len(sched)
    sends = sched + np.abs(rng.normal(0.3, 0.2, n))
    free_at = 0.0
    out = []
    for i in range(n):
        send = float(sends[i])
        if i % 500 == 499:  # one server error in 500 requests, at fixed places
            out.append(RequestRecord(f"{rid}-{i}", server.name, rate, round(send, 6), "error", 0,
                                     scheduled_send_ms=round(float(sched[i]), 6),
                                     end_ms=round(send + 5.0, 6), error="HTTP 500 (synthetic)"))
            continue
        start = max(send + 5.0, free_at)  # 5 ms to reach the server
        free_at = start + server.prefill_ms * rng.uniform(0.8, 1.2)
        first = free_at + server.handoff_ms + 5.0
        tokens = int(rng.integers(32, 97))
        tpot = (server.tpot_base_ms + server.tpot_per_rps_ms * rate) * rng.lognormal(0.0, 0.08)
        gaps = tpot * rng.lognormal(0.0, 0.1, tokens - 1)
        if rng.random() < 0.01:
            gaps[rng.integers(0, tokens - 1)] += 150.0  # an occasional decode stall
        chunks = first + np.concatenate([[0.0], np.cumsum(gaps)])
        out.append(RequestRecord(f"{rid}-{i}", server.name, rate, round(send, 6), "ok", tokens,
                                 scheduled_send_ms=round(float(sched[i]), 6),
                                 chunk_times_ms=tuple(round(float(t), 6) for t in chunks),
                                 chunk_tokens=(1,) * tokens, input_tokens=int(rng.integers(500, 3000))))
    return out


def sweep(rates_rps: Sequence[float], duration_s: float, warmup_requests: int,
          seed: int = 0) -> list[RequestRecord]:
    """Warm-up requests, then duration_s of open-loop Poisson traffic, per deployment and rate.

    The number of measured requests is itself random (Poisson), as with any client that
    offers a rate for a fixed time.
    """
    out = []
    for d, server in enumerate(TOY_SERVERS):
        for rate in rates_rps:
            rng = np.random.default_rng([seed, d, int(rate * 1000)])
            sched = _arrivals(float(rate), warmup_requests, duration_s, rng)
            out += _run(server, float(rate), sched, rng, f"{server.name[:3]}-{rate:g}")
    return out
