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
    "generation_tokens": ("vllm:generation_tokens_total", {}),
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


def histogram(text: str, family: str) -> dict:
    """Cumulative buckets, sum and count of one histogram family, summed over label sets.

    {"buckets": [(upper_bound, cumulative_count), ...] sorted, "sum": float, "count": float};
    empty buckets and zeros when the engine does not export the family.
    """
    buckets: dict[float, float] = {}
    total = {"sum": 0.0, "count": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
            elif s.name.endswith("_sum"):
                total["sum"] += float(s.value)
            elif s.name.endswith("_count"):
                total["count"] += float(s.value)
    return {"buckets": sorted(buckets.items()), **total}


def histogram_delta(before: dict, after: dict) -> dict:
    """What happened between two readings of the same histogram (a counter never goes down)."""
    b = dict(before["buckets"])
    return {"buckets": [(le, c - b.get(le, 0.0)) for le, c in after["buckets"]],
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"]}


def bucket_quantile(hist: dict, q: float) -> float | None:
    """Prometheus-style histogram_quantile: linear inside the bucket holding rank q*count.

    An estimate bounded by the bucket edges, not a sample; None without observations,
    and the lower finite edge when the rank falls in the +Inf bucket.
    """
    count = hist["count"]
    if count <= 0 or not hist["buckets"]:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for le, cum in hist["buckets"]:
        if cum >= rank:
            if le == float("inf"):
                return lower
            inside = cum - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, cum
    return lower
