"""Typed models of the SLO inputs: request records, vLLM results, metric scrapes, mapping files.

Field types say what a value may be; the `after` checks say how values must agree (a first
token after the send, chunk times in order, token counts that add up). Messages keep the
record's own words (FILE:LINE: what is wrong), since a user fixes the file from them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from kvbench.records.schema.types import (
    MAX_SECONDS,
    MAX_TEXT,
    AnyText,
    Count,
    Open,
    PositiveTokens,
    RateRps,
    Seconds,
    Strict,
    Text,
    TimeMs,
    Tokens,
    refuse,
    show,
)

SCHEMA_REQUEST = "kvbench.slo.request/1"
SCHEMA_METRICS = "kvbench.slo.metrics/1"
SCHEMA_REPORT = "kvbench.slo.report/1"
STATUSES = ("ok", "error", "rejected", "timeout")
Status = Literal["ok", "error", "rejected", "timeout"]


# ---------------------------------------------------------------------------
# request records (kvbench.slo.request/1)


def _monotonic(times: list[float]) -> list[float]:
    for i in range(1, len(times)):
        if times[i] < times[i - 1]:
            raise refuse(f"not monotonic: [{i}]={times[i]!r} < "
                         f"[{i - 1}]={times[i - 1]!r}")
    return times


class RequestIn(Strict):
    """One line of a request-records file, as the load generator wrote it."""

    schema_: Literal["kvbench.slo.request/1"] = Field(alias="schema")
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_TEXT)] | Count
    deployment: Text
    offered_rate_rps: RateRps
    actual_send_ms: TimeMs
    output_tokens: Tokens
    status: Status
    scheduled_send_ms: TimeMs | None = None
    first_token_ms: TimeMs | None = None
    chunk_times_ms: Annotated[list[TimeMs], AfterValidator(_monotonic)] | None = None
    chunk_tokens: list[PositiveTokens] | None = None
    end_ms: TimeMs | None = None
    input_tokens: Tokens | None = None
    error: AnyText | None = None
    meta: dict[str, Any] | None = None
    cache_state: Text | None = None
    chunk_gaps_recorded: bool = True  # false: the client kept the first and last chunk only


    @model_validator(mode="after")
    def _agree(self):
        chunks = self.chunks
        send = self.actual_send_ms
        if self.first_token_ms is not None and self.chunk_times_ms and \
                self.chunk_times_ms[0] != self.first_token_ms:
            raise refuse(f"first_token_ms={self.first_token_ms!r} differs from "
                         f"chunk_times_ms[0]={self.chunk_times_ms[0]!r}")
        if chunks and chunks[0] < send:
            raise refuse(f"first token at {chunks[0]!r} ms is before the send at {send!r} ms")
        if self.end_ms is not None and (self.end_ms < send or (chunks and self.end_ms < chunks[-1])):
            raise refuse(f"end_ms={self.end_ms!r} is before the send or the last chunk")
        counts = self.chunk_tokens
        if counts is not None:
            if len(counts) != len(chunks):
                raise refuse(f"chunk_tokens must list a positive token count for each of the "
                             f"{len(chunks)} chunk_times_ms")
            if self.status == "ok" and sum(counts) != self.output_tokens:
                raise refuse(f"chunk_tokens add up to {sum(counts)}, output_tokens is {self.output_tokens}")
        if not self.chunk_gaps_recorded and (len(chunks) > 2 or counts is not None):
            raise refuse("chunk_gaps_recorded false: chunk_times_ms holds the first and last chunk "
                         "only (at most 2 times) and chunk_tokens must be null")
        if self.status == "ok" and (self.output_tokens < 1 or not chunks):
            raise refuse("status ok needs output_tokens >= 1 and the time of the first token")
        return self

    @property
    def chunks(self) -> list[float]:
        """Chunk arrival times; a lone first_token_ms is the first chunk."""
        if self.chunk_times_ms:
            return self.chunk_times_ms
        return [self.first_token_ms] if self.first_token_ms is not None else []


# ---------------------------------------------------------------------------
# vLLM `bench serve --save-result --save-detailed` (another tool's file: unread keys kept)

VllmSeconds = Annotated[float, Field(ge=-MAX_SECONDS * 1e3, le=MAX_SECONDS * 1e3, allow_inf_nan=False)]


class VllmResult(Open):
    """The per-request lists kvbench converts (seconds, in request order)."""

    start_times: list[VllmSeconds]
    ttfts: list[Seconds] = Field(min_length=1)
    itls: list[list[Seconds]]
    output_lens: list[Count]
    errors: list[AnyText | None]
    latencies: list[Seconds] | None = None
    input_lens: list[Count | None] | None = None
    request_rate: float | str | None = None  # vLLM writes "inf" for an unpaced run
    ramp_up_strategy: AnyText | None = None
    max_concurrency: Count | None = None

    @model_validator(mode="after")
    def _one_entry_per_request(self):
        n = len(self.ttfts)
        for key in ("start_times", "itls", "output_lens", "errors", "latencies", "input_lens"):
            values = getattr(self, key)
            if values is not None and len(values) != n:
                raise refuse(f"{key} must be a list of {n} entries, one per request")
        return self


# ---------------------------------------------------------------------------
# metric scrapes (kvbench.slo.metrics/1) and mapping files

NON_FINITE = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}  # Prometheus' own spelling


def _sample_row(row: list) -> list:
    """[labels, value]: labels a str -> str mapping, value a finite number or NaN/+Inf/-Inf."""
    if len(row) != 2 or not isinstance(row[0], dict) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in row[0].items()):
        raise refuse(f"a sample must be [labels, value], got {show(row)}")
    value = row[1]
    if isinstance(value, str) and value in NON_FINITE:
        return [row[0], NON_FINITE[value]]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise refuse(f"a sample value must be a number (or \"NaN\", \"+Inf\", \"-Inf\"), got {show(value)}")
    return row


class ScrapeHeader(Open):
    kind: Literal["header"]
    schema_: Literal["kvbench.slo.metrics/1"] = Field(alias="schema")


class ScrapeSample(Open):
    kind: Literal["sample"]
    role: Text
    t_s: Seconds
    samples: dict[str, list[Annotated[list[Any], AfterValidator(_sample_row)]]]


class ScrapeGap(Open):
    kind: Literal["gap"]
    role: Text
    t_s: Seconds


class ScrapeEnd(Open):
    kind: Literal["end"]


SCRAPE_LINES = {"sample": ScrapeSample, "gap": ScrapeGap, "end": ScrapeEnd}


class MappingEntry(Strict):
    name: Text
    kind: Literal["gauge", "counter", "histogram"] | None = None
    scale: Annotated[float, Field(gt=0, le=1e30, allow_inf_nan=False)] = 1.0
    note: AnyText = ""


class MappingFile(Strict):
    engine: Text
    metrics: dict[str, MappingEntry]


# ---------------------------------------------------------------------------
# `kvbench slo analyze` reports (kvbench.slo.report/1): the per-group numbers results.load reads

Pct = Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]
PerSecond = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]


class ReportCounts(Open):
    records: Count
    offered_after_warmup: Count
    ok: Count
    meeting_limits: Count


class ReportAttainment(Open):
    of_all_offered_pct: Pct | None = None
    of_successful_pct: Pct | None = None


class ReportThroughput(Open):
    throughput_rps: PerSecond | None = None
    goodput_rps: PerSecond | None = None
    output_tokens_per_s: PerSecond | None = None


class LatencySummary(Open):
    n: Count
    p50_ms: TimeMs | None = None
    p95_ms: TimeMs | None = None
    p99_ms: TimeMs | None = None
    max_ms: TimeMs | None = None


class ReportGroup(Open):
    """One (deployment, offered rate, cache state) of a report."""

    deployment: Text
    offered_rate_rps: RateRps
    cache_state: Text | None = None
    counts: ReportCounts
    attainment: ReportAttainment
    throughput: ReportThroughput
    latency_ms: dict[str, LatencySummary] = {}
    error_rate_pct: Pct | None = None
    passed: bool | None = None
    failed_gates: list[Text] = []


class SloReport(Open):
    """A `kvbench slo analyze` report: the command, its inputs, the per-group numbers (absent
    from an engine-metrics-only report), the engine-metrics analysis and the notes. The
    writer validates it here before anything is written."""

    schema_: Literal["kvbench.slo.report/1"] = Field(alias="schema")
    command: list[AnyText]
    inputs: dict[str, Any]
    groups: list[ReportGroup] | None = None
    engine_metrics: Any = None
    notes: list[AnyText] = []
