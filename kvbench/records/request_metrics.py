"""Per-request latency metrics and pooled percentiles, defined once so every report agrees.

    TTFT_ms  = first chunk - actual send                          (one sample per successful request)
    TPOT_ms  = (last chunk - first chunk) / (output_tokens - 1)   (one sample per successful request
                                                                   with enough output tokens)
    ITL_ms   = gap between successive chunks                      (one sample per chunk gap)
    max ITL  = the largest chunk gap of one request               (one sample per request)
    E2E_ms   = finish - actual send

A record whose client kept only the first and last chunk (chunk_gaps_recorded false) has
TTFT, TPOT and E2E but no chunk gap: its ITL samples are absent and its max ITL unknown.

TTFT starts at the *actual* send, as vLLM and AIPerf measure it; a client that falls behind
its schedule shows up as send lag (scheduled -> actual), reported beside it, not hidden in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from kvbench.records.requests import RequestRecord
from kvbench.records.stats import percentile

PERCENTILES = (50, 95, 99)
PERCENTILE_METHOD = ("linear interpolation between closest ranks (numpy.percentile default, "
                     "Hyndman-Fan type 7) over pooled samples of all requests in the group")


@dataclass(frozen=True)
class RequestMetrics:
    """What one request contributes to the latency statistics (ms; None where undefined)."""

    record: RequestRecord
    ttft_ms: float | None
    tpot_ms: float | None  # None for < 2 output tokens
    itls_ms: tuple[float, ...]
    max_itl_ms: float | None  # None for a single chunk
    e2e_ms: float | None
    send_lag_ms: float | None  # actual - scheduled; None without a schedule


def request_metrics(rec: RequestRecord) -> RequestMetrics:
    lag = None if rec.scheduled_send_ms is None else rec.actual_send_ms - rec.scheduled_send_ms
    if rec.status != "ok":
        return RequestMetrics(rec, None, None, (), None, None, lag)
    chunks = rec.chunk_times_ms
    ttft = chunks[0] - rec.actual_send_ms
    tpot = (chunks[-1] - chunks[0]) / (rec.output_tokens - 1) if rec.output_tokens >= 2 else None
    # without the gaps between first and last chunk (GuideLLM) no gap is known, only TPOT
    itls = tuple(b - a for a, b in pairwise(chunks)) if rec.chunk_gaps_recorded else ()
    return RequestMetrics(rec, ttft, tpot, itls, max(itls) if itls else None,
                          rec.finish_ms - rec.actual_send_ms, lag)


def summarize(samples: Sequence[float]) -> dict:
    """{n, p50, p95, p99, max} of samples in ms; percentiles None when there are no samples."""
    if len(samples) == 0:
        return {"n": 0, "p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    out: dict = {"n": len(samples)}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = percentile(samples, q)
    out["max_ms"] = float(np.max(samples))
    return out
