"""SLO files as rows: request records (one per request, or one per streamed chunk), `slo analyze`
reports (one per deployment, rate and cache state) and metric scrapes (one per metric sample).

Requests go through the typed record (kvbench.records.schema.slo.RequestIn) and the per-request
definitions of kvbench.slo.metrics, so a TTFT here is the TTFT of `kvbench slo analyze`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.frames.files import MAX_JSON_DOC, json_document
from kvbench.records.schema.read import iter_jsonl, iter_lines
from kvbench.records.schema.slo import SCRAPE_LINES, ScrapeHeader
from kvbench.records.schema.types import parse, show

REQUEST_DTYPES = {
    "source": "category", "line": "Int64", "request_id": "string", "deployment": "category",
    "cache_state": "category", "offered_rate_rps": "float64", "status": "category",
    "scheduled_send_ms": "float64", "send_ms": "float64", "send_lag_ms": "float64",
    "ttft_ms": "float64", "tpot_ms": "float64", "max_itl_ms": "float64", "e2e_ms": "float64",
    "output_tokens": "Int64", "input_tokens": "Int64", "n_chunks": "Int64", "error": "string",
    "chunk": "Int64", "chunk_ms": "float64", "chunk_tokens": "Int64", "itl_ms": "float64",
}
REPORT_DTYPES = {
    "source": "category", "deployment": "category", "cache_state": "category",
    "offered_rate_rps": "float64", "records": "Int64", "offered_after_warmup": "Int64",
    "ok": "Int64", "meeting_limits": "Int64", "attainment_of_all_pct": "float64",
    "attainment_of_successful_pct": "float64", "error_rate_pct": "float64",
    "throughput_rps": "float64", "goodput_rps": "float64", "output_tokens_per_s": "float64",
    "queue_growing": "boolean", "passed": "boolean", "failed_gates": "category",
}
METRIC_DTYPES = {"source": "category", "line": "Int64", "role": "category", "t_s": "float64",
                 "metric": "category", "labels": "category", "value": "float64"}
LATENCIES = ("ttft", "tpot", "itl_per_chunk", "max_itl_per_request", "e2e")


def _request_row(m, source: str, line: int) -> dict:
    r = m.record
    return {"source": source, "line": line, "request_id": r.request_id,
            "deployment": r.deployment, "cache_state": r.cache_state,
            "offered_rate_rps": r.offered_rate_rps, "status": r.status,
            "scheduled_send_ms": r.scheduled_send_ms, "send_ms": r.actual_send_ms,
            "send_lag_ms": m.send_lag_ms, "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
            "max_itl_ms": m.max_itl_ms, "e2e_ms": m.e2e_ms, "output_tokens": r.output_tokens,
            "input_tokens": r.input_tokens, "n_chunks": len(r.chunk_times_ms), "error": r.error}


def request_rows(path: Path, samples: bool) -> Iterator[list[dict]]:
    """Per line: the request's row, or (samples) one row per chunk with its gap to the last."""
    from kvbench.records.request_metrics import request_metrics
    from kvbench.records.requests import parse_record_line

    for where, raw in iter_lines(path, "records file", missing="no such file"):
        line = int(where.rsplit(":", 1)[1])
        m = request_metrics(parse_record_line(raw, where))
        row = _request_row(m, str(path), line)
        if not samples:
            yield [row]
            continue
        r = m.record
        tokens = r.chunk_tokens or (None,) * len(r.chunk_times_ms)
        yield [{**row, "chunk": i, "chunk_ms": t - r.actual_send_ms, "chunk_tokens": k,
                "itl_ms": t - r.chunk_times_ms[i - 1] if i else None}
               for i, (t, k) in enumerate(zip(r.chunk_times_ms, tokens, strict=True))]


def _report_row(g: dict, source: str) -> dict:
    c, a, t = g["counts"], g["attainment"], g["throughput"]
    row = {"source": source, "deployment": g["deployment"], "cache_state": g.get("cache_state"),
           "offered_rate_rps": g["offered_rate_rps"], "records": c["records"],
           "offered_after_warmup": c["offered_after_warmup"], "ok": c["ok"],
           "meeting_limits": c["meeting_limits"],
           "attainment_of_all_pct": a.get("of_all_offered_pct"),
           "attainment_of_successful_pct": a.get("of_successful_pct"),
           "error_rate_pct": g.get("error_rate_pct"), "throughput_rps": t.get("throughput_rps"),
           "goodput_rps": t.get("goodput_rps"), "output_tokens_per_s": t.get("output_tokens_per_s"),
           "queue_growing": (g.get("queue") or {}).get("growing"), "passed": g.get("passed"),
           "failed_gates": ",".join(g.get("failed_gates") or []) or None}
    for name in LATENCIES:
        s = (g.get("latency_ms") or {}).get(name) or {}
        row[f"{name}_n"] = s.get("n")
        for q in ("p50", "p95", "p99", "max"):
            row[f"{name}_{q}_ms"] = s.get(f"{q}_ms")
    return row


def report_rows(path: Path) -> Iterator[list[dict]]:
    """One row per group of a `kvbench slo analyze` JSON report (kvbench.slo.report/1)."""
    from kvbench.records.schema.slo import SCHEMA_REPORT, ReportGroup

    doc = json_document(path, MAX_JSON_DOC, "SLO report")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_REPORT:
        raise UsageError(f"{path}: not a {SCHEMA_REPORT} report")
    groups = doc.get("groups")
    if not isinstance(groups, list):
        raise UsageError(f"{path}: groups: must be a list (an engine-metrics-only report has none)")
    for i, g in enumerate(groups):
        checked = parse(ReportGroup, g, str(path), prefix=f"groups[{i}]")
        yield [_report_row(checked.model_dump(by_alias=True), str(path))]


def metric_rows(path: Path) -> Iterator[list[dict]]:
    """One row per sample of each scrape line (header, gap and end lines give none)."""
    seen_header = False
    for where, rec in iter_jsonl(path, "scrape file", missing="no such file"):
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if not seen_header:
            parse(ScrapeHeader, rec, where)
            seen_header = True
            continue
        if kind not in SCRAPE_LINES:
            raise UsageError(f"{where}: unknown line kind {show(kind)}")
        line = parse(SCRAPE_LINES[kind], rec, where)
        if kind != "sample":
            continue
        n = int(where.rsplit(":", 1)[1])
        yield [{"source": str(path), "line": n, "role": line.role, "t_s": line.t_s, "metric": name,
                "labels": ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or None,
                "value": float(value)}
               for name, samples in line.samples.items() for labels, value in samples]
