"""Which Prometheus metric of which serving engine means what: the one table, and mapping files.

kvbench reads a handful of *quantities* from an engine's `/metrics`:

    waiting        gauge      requests in the scheduler's waiting queue (prefill queue on a
                              prefill instance, decode queue on a decode instance)
    running        gauge      requests being executed
    kv_usage       gauge      fraction of the KV cache in use (0..1)
    rejected       counter    requests the engine refused
    xfer_time      histogram  duration of one KV transfer (seconds)
    xfer_post_time histogram  time to post (submit) one KV transfer (seconds)
    xfer_bytes     histogram  bytes of one KV transfer
    xfer_failures  counter    failed KV transfers
    kv_expired     counter    requests whose KV expired before decode read it
    xfer_time_last gauge      the latest transfer's duration only (seconds; no distribution)

Names are checked against each engine's sources (docs/slo.md cites the files). An engine
not in the table, or a build that renamed a metric, passes a mapping file:

    engine: my-engine
    metrics:
      waiting: {name: "my_engine:queue_len", kind: gauge}
      xfer_time: {name: "my_engine:kv_xfer_ms", kind: histogram, scale: 0.001}

`scale` turns the metric's unit into seconds / bytes / a fraction (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.schema.read import MiB, load_json, load_yaml
from kvbench.records.schema.slo import MappingEntry, MappingFile
from kvbench.records.schema.types import parse

KINDS = ("gauge", "counter", "histogram")
MAX_MAPPING_BYTES = MiB
QUANTITIES = {  # name -> (kind, unit after scale, how label sets are combined)
    "waiting": ("gauge", "requests", "sum"),
    "running": ("gauge", "requests", "sum"),
    "kv_usage": ("gauge", "fraction", "max"),
    "rejected": ("counter", "requests", "sum"),
    "xfer_time": ("histogram", "s", "sum"),
    "xfer_post_time": ("histogram", "s", "sum"),
    "xfer_bytes": ("histogram", "B", "sum"),
    "xfer_failures": ("counter", "transfers", "sum"),
    "kv_expired": ("counter", "requests", "sum"),
    "xfer_time_last": ("gauge", "s", "max"),
}


@dataclass(frozen=True)
class Metric:
    name: str  # the metric family as the engine exports it (counters without _total)
    kind: str
    scale: float = 1.0  # multiply to get the quantity's unit
    note: str = ""


_NIXL = {  # vLLM's NixlConnector (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py)
    "xfer_time": Metric("vllm:nixl_xfer_time_seconds", "histogram"),
    "xfer_post_time": Metric("vllm:nixl_post_time_seconds", "histogram"),
    "xfer_bytes": Metric("vllm:nixl_bytes_transferred", "histogram"),
    "xfer_failures": Metric("vllm:nixl_num_failed_transfers", "counter"),
    "kv_expired": Metric("vllm:nixl_num_kv_expired_reqs", "counter",
                         note="counted on the prefill instance"),
}

ENGINES: dict[str, dict[str, Metric]] = {
    "vllm": {
        "waiting": Metric("vllm:num_requests_waiting", "gauge"),
        "running": Metric("vllm:num_requests_running", "gauge"),
        "kv_usage": Metric("vllm:kv_cache_usage_perc", "gauge", note="a fraction 0..1 despite its name"),
        **_NIXL,
    },
    "sglang": {
        "waiting": Metric("sglang:num_queue_reqs", "gauge"),
        "running": Metric("sglang:num_running_reqs", "gauge"),
        "kv_usage": Metric("sglang:token_usage", "gauge"),
        "xfer_failures": Metric("sglang:num_transfer_failed_reqs", "counter"),
        "xfer_time_last": Metric("sglang:kv_transfer_latency_ms", "gauge", 1e-3,
                                 note="the latest transfer only: sampled, not every transfer"),
    },
    "dynamo": {
        "waiting": Metric("dynamo_frontend_queued_requests", "gauge",
                          note="the HTTP frontend's queue (requests awaiting a first token)"),
        "running": Metric("dynamo_frontend_inflight_requests", "gauge"),
        "kv_usage": Metric("dynamo_component_kvstats_gpu_cache_usage_percent", "gauge"),
        **{k: Metric(m.name, m.kind, m.scale, "exported by Dynamo's vLLM workers (NixlConnector)")
           for k, m in _NIXL.items()},
    },
}
NOT_EXPORTED = {  # quantities an engine has no metric for, and where to get them instead
    ("vllm", "rejected"): "vLLM exports no rejection counter: refused requests are the client's "
                          "status 'rejected' (HTTP 429/503)",
    ("sglang", "rejected"): "no rejection counter: use the client's status 'rejected'",
    ("dynamo", "rejected"): "no rejection counter: use the client's status 'rejected'",
    ("sglang", "xfer_time"): "SGLang exports the latest transfer's latency as a gauge, not a "
                             "histogram: only sampled values (xfer_time_last)",
}


def detect_engine(sample_names: set[str]) -> str | None:
    """The engine whose metric prefix the samples carry (vllm:, sglang:, dynamo_)."""
    for engine, prefix in (("dynamo", "dynamo_"), ("sglang", "sglang:"), ("vllm", "vllm:")):
        if any(n.startswith(prefix) for n in sample_names):
            return engine
    return None


def family_names(table: dict[str, Metric]) -> set[str]:
    return {m.name for m in table.values()}


def all_known_families() -> set[str]:
    return set().union(*(family_names(t) for t in ENGINES.values()))


def _mapping_entry(q: str, spec: MappingEntry, where: str) -> Metric:
    if q not in QUANTITIES:
        raise UsageError(f"{where}: unknown quantity {q!r} (known: {', '.join(QUANTITIES)})")
    kind = spec.kind or QUANTITIES[q][0]
    if kind != QUANTITIES[q][0]:
        raise UsageError(f"{where}: {q}.kind must be {QUANTITIES[q][0]}, got {kind!r}")
    return Metric(spec.name, kind, float(spec.scale), spec.note)


def load_mapping(path: str | Path) -> tuple[str, dict[str, Metric]]:
    """An engine's name and its quantity -> Metric table, from a YAML or JSON mapping file."""
    p = Path(path)
    if p.suffix == ".json":
        doc = load_json(p, MAX_MAPPING_BYTES, "mapping file", missing="no such mapping file")
    else:
        doc = load_yaml(p, MAX_MAPPING_BYTES, "mapping file", missing="no such mapping file")
    m = parse(MappingFile, doc, str(p))
    return m.engine, {q: _mapping_entry(q, s, str(p)) for q, s in m.metrics.items()}
