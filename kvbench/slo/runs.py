"""One run (cache state, deployment, offered rate) as compact columns, filled one record at a time.

Why: `slo analyze` must read a file of 10^6 requests with bounded memory. A record object
with its chunk times as Python floats costs ~2 KB; the analysis needs far less: per request
a few times and counts (8 bytes each) and, for the pooled inter-chunk latency percentiles,
every chunk gap (8 bytes each). Records are turned into these columns as they stream in and
then dropped. The per-request numbers follow kvbench.slo.metrics' definitions exactly.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from kvbench.records.requests import STATUSES, RequestRecord

STATUS_CODE = {s: i for i, s in enumerate(STATUSES)}
OK = STATUS_CODE["ok"]
NAN = math.nan
_FLOAT_COLUMNS = ("send", "sched", "finish", "ttft", "tpot", "max_itl", "e2e")


@dataclass
class Run:
    """Columns of one run's requests in file order; NaN where a value is undefined."""

    cache_state: str | None
    deployment: str
    offered_rate_rps: float
    cols: dict[str, array] = field(default_factory=lambda: {
        **{k: array("d") for k in _FLOAT_COLUMNS}, "status": array("b"), "tokens": array("q"),
        "n_gaps": array("q"), "gaps": array("d"), "gaps_unknown": array("b")})

    def add(self, r: RequestRecord) -> None:
        c = self.cols
        c["send"].append(r.actual_send_ms)
        c["sched"].append(NAN if r.scheduled_send_ms is None else r.scheduled_send_ms)
        c["finish"].append(r.finish_ms)
        c["status"].append(STATUS_CODE[r.status])
        c["tokens"].append(r.output_tokens)
        ttft = tpot = max_itl = e2e = NAN
        gaps: list[float] = []
        if r.status == "ok":  # plain Python: a request has tens of chunks, too few for numpy
            chunks = r.chunk_times_ms
            gaps = [b - a for a, b in pairwise(chunks)] if r.chunk_gaps_recorded else []
            ttft = chunks[0] - r.actual_send_ms
            if r.output_tokens >= 2:
                tpot = (chunks[-1] - chunks[0]) / (r.output_tokens - 1)
            max_itl = max(gaps) if gaps else NAN
            e2e = r.finish_ms - r.actual_send_ms
        c["ttft"].append(ttft)
        c["tpot"].append(tpot)
        c["max_itl"].append(max_itl)
        c["e2e"].append(e2e)
        c["gaps"].extend(gaps)
        c["n_gaps"].append(len(gaps))
        c["gaps_unknown"].append(r.status == "ok" and not r.chunk_gaps_recorded)

    def __len__(self) -> int:
        return len(self.cols["send"])

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.frombuffer(v, dtype=v.typecode if v.typecode != "b" else "i1") if len(v)
                else np.array([], dtype=float if v.typecode == "d" else np.int64)
                for k, v in self.cols.items()}


def to_runs(records: Iterable[RequestRecord]) -> tuple[list[Run], int]:
    """Runs sorted by (cache state or '', deployment, rate), and the number of records read."""
    runs: dict[tuple, Run] = {}
    n = 0
    for r in records:
        key = (r.cache_state or "", r.deployment, r.offered_rate_rps)
        run = runs.get(key)
        if run is None:
            run = runs[key] = Run(r.cache_state, r.deployment, r.offered_rate_rps)
        run.add(r)
        n += 1
    return [runs[k] for k in sorted(runs)], n
