"""Read a vLLM /metrics body into the few numbers the lab needs, with prometheus-client.

One small function on purpose: `kvbench slo scrape` (issue 13) owns metric scraping
for analysis; the lab only needs point snapshots (before/after a fault, idle values)
and the NIXL histograms' sums and counts. Labels other than the bucket bound are
summed over (one engine per instance here).
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# name in the snapshot -> (sample name, label filter)
WANTED = {
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", {}),
    "num_requests_running": ("vllm:num_requests_running", {}),
    "num_requests_waiting": ("vllm:num_requests_waiting", {}),
    "nixl_num_kv_expired_reqs": ("vllm:nixl_num_kv_expired_reqs_total", {}),
    "nixl_num_failed_transfers": ("vllm:nixl_num_failed_transfers_total", {}),
    "nixl_xfer_count": ("vllm:nixl_xfer_time_seconds_count", {}),
    "nixl_xfer_sum_s": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "nixl_bytes_count": ("vllm:nixl_bytes_transferred_count", {}),
    "nixl_bytes_sum": ("vllm:nixl_bytes_transferred_sum", {}),
    "prompt_tokens_local_compute": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "prompt_tokens_external_kv": ("vllm:prompt_tokens_by_source_total",
                                  {"source": "external_kv_transfer"}),
    "request_success": ("vllm:request_success_total", {}),
}


def snapshot(text: str) -> dict[str, float]:
    """The WANTED values of one /metrics body; a metric the engine does not export is absent."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, labels) in WANTED.items():
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def fetch(url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """snapshot() of one endpoint, or None when it does not answer (recorded as a gap)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return snapshot(resp.read().decode())
    except OSError:
        return None
