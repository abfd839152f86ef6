"""One reading of one vLLM instance's /metrics: for the fault audit, the stall watch, the tests.

The sweep's metrics over time come from `kvbench slo scrape`; the lab also needs single
readings (an instance idle, after a fault, after drain). The fetch and the parse are
slo's (`kvbench.slo.scrape.scrape_once`: bounded in time and size, prometheus-client's
text parser), the quantities slo knows are read with slo's engine table
(`kvbench.slo.engines.ENGINES["vllm"]`); only the counters the lab alone reads (prompt
tokens by source, generated tokens, finished requests) are named here.
"""

from __future__ import annotations

import time

from kvbench.slo.engine_metrics import histogram, scalar
from kvbench.slo.engines import ENGINES, QUANTITIES
from kvbench.slo.scrape import Endpoint, family_of, parse_metrics_text, scrape_once

VLLM = ENGINES["vllm"]
FROM_SLO = {  # key in a snapshot -> slo's quantity
    "kv_cache_usage_perc": "kv_usage", "num_requests_running": "running",
    "num_requests_waiting": "waiting", "nixl_num_kv_expired_reqs": "kv_expired",
    "nixl_num_failed_transfers": "xfer_failures",
}
HISTOGRAMS = {"xfer_time": ("nixl_xfer_count", "nixl_xfer_sum_s"),  # slo's quantity -> (count, sum)
              "xfer_bytes": ("nixl_bytes_count", "nixl_bytes_sum")}
LAB_ONLY = {  # key -> (sample name, labels that must match); other label sets are summed
    "prompt_tokens_local_compute": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "prompt_tokens_external_kv": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "request_success": ("vllm:request_success_total", {}),
    "generation_tokens": ("vllm:generation_tokens_total", {}),
}
_FAMILIES = {m.name for m in VLLM.values()} | {
    name.removesuffix("_total") for name, _ in LAB_ONLY.values()}


def _keep(sample_name: str) -> bool:
    return family_of(sample_name, _FAMILIES) is not None


def values(samples: dict) -> dict[str, float]:
    """The snapshot's numbers from parsed samples; a metric the engine does not export is absent."""
    out: dict[str, float] = {}
    for key, q in FROM_SLO.items():
        v = scalar(samples, VLLM[q], QUANTITIES[q][2])
        if v is not None:
            out[key] = v
    for q, (count, total) in HISTOGRAMS.items():
        h = histogram(samples, VLLM[q])
        if h is not None:
            out[count], out[total] = h[2], h[1]
    for key, (name, labels) in LAB_ONLY.items():
        rows = [float(v) for lab, v in samples.get(name, [])
                if all(lab.get(k) == want for k, want in labels.items())]
        if rows:
            out[key] = sum(rows)
    return out


def of_text(text: str) -> dict[str, float]:
    """values() of one /metrics body (e.g. a captured file)."""
    return values(parse_metrics_text(text, _keep))


def fetch(url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """values() of one endpoint now, or None when it does not answer."""
    line = scrape_once(Endpoint("instance", url), time.monotonic(), timeout_s, _keep)
    return values(line["samples"]) if line["kind"] == "sample" else None
