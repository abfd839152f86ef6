"""Typed models of other load generators' per-request exports: AIPerf 0.13 and GuideLLM 0.8.

Only the fields kvbench converts are typed and bounded; everything else in these files is
the tool's own business and kept as it is (Open). Field meanings, units and clock origins
are cited from each tool's source in docs/slo.md (section 3).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from kvbench.records.schema.types import (
    MAX_TIME_MS,
    AnyText,
    Count,
    Finite,
    Open,
    Text,
)

# epoch nanoseconds (time.time_ns()); bounded as kvbench's times are (1e13 ms)
EpochNs = Annotated[int, Field(ge=0, le=int(MAX_TIME_MS * 1e6))]
# a duration or gap as the tool displays it (its unit says which); bounded, finite, not negative
Duration = Annotated[float, Field(ge=0, le=MAX_TIME_MS, allow_inf_nan=False)]
# epoch seconds (time.time()); GuideLLM's RequestTimings
EpochS = Annotated[float, Field(ge=0, le=MAX_TIME_MS / 1e3, allow_inf_nan=False)]


# ---------------------------------------------------------------------------
# AIPerf 0.13 profile_export.jsonl (aiperf/common/models/record_models.py MetricRecordInfo)


class AiperfScalar(Open):
    value: Duration
    unit: Text


class AiperfList(Open):
    value: list[Duration]
    unit: Text


class AiperfMetadata(Open):
    session_num: Count
    turn_index: Count | None = None
    x_request_id: AnyText | None = None
    credit_issued_ns: EpochNs | None = None
    request_start_ns: EpochNs
    request_end_ns: EpochNs
    benchmark_phase: Text
    was_cancelled: bool = False


class AiperfError(Open):
    code: int | None = None
    type: AnyText | None = None
    message: AnyText = ""


class AiperfLine(Open):
    """One line of profile_export.jsonl: a request's metadata, its metrics, its error."""

    metadata: AiperfMetadata
    metrics: dict[str, Any]
    error: AiperfError | None = None


class AiperfPhase(Open):
    kind: Text | None = None
    type: Text | None = None
    rate: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] | None = None


class AiperfInputConfig(Open):
    phases: list[AiperfPhase] = []


class AiperfSummary(Open):
    """profile_export_aiperf.json: read for the offered rate and version only."""

    aiperf_version: AnyText | None = None
    input_config: AiperfInputConfig | None = None


# ---------------------------------------------------------------------------
# GuideLLM 0.8 benchmarks.json (guidellm/benchmark/schemas/report.py and
# guidellm/schemas/base/request_stats.py, info.py)


class GuidellmTimings(Open):
    # documented as a Unix time; GuideLLM 0.8 has written -0.07 (kvbench.slo.guidellm._target)
    targeted_start: Finite | None = None
    resolve_start: EpochS | None = None
    request_start: EpochS | None = None
    first_token_iteration: EpochS | None = None
    last_token_iteration: EpochS | None = None
    token_iterations: Count = 0
    request_end: EpochS | None = None
    resolve_end: EpochS | None = None


class GuidellmInfo(Open):
    timings: GuidellmTimings
    status: AnyText | None = None
    error: AnyText | None = None


class GuidellmRequest(Open):
    request_id: Annotated[str, Field(min_length=1, max_length=4096)]
    info: GuidellmInfo
    prompt_tokens: Count | None = None
    output_tokens: Count | None = None


class GuidellmRequests(Open):
    successful: list[GuidellmRequest] = []
    incomplete: list[GuidellmRequest] = []
    errored: list[GuidellmRequest] = []


class GuidellmStrategy(Open):
    type_: Text
    rate: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] | None = None


class GuidellmConfig(Open):
    strategy: GuidellmStrategy
    sample_size: Count | None = None


class GuidellmTotals(Open):
    successful: Count
    incomplete: Count
    errored: Count


class GuidellmMetrics(Open):
    request_totals: GuidellmTotals


class GuidellmSchedulerState(Open):
    """The scheduler's own counts at the benchmark's end (guidellm/scheduler/schemas.py
    SchedulerState): what it created, and where each request was when the benchmark ended."""

    created_requests: Count | None = None
    queued_requests: Count | None = None
    pending_requests: Count | None = None
    processing_requests: Count | None = None
    processed_requests: Count | None = None
    cancelled_requests: Count | None = None


class GuidellmBenchmark(Open):
    config: GuidellmConfig
    requests: GuidellmRequests
    metrics: GuidellmMetrics
    scheduler_state: GuidellmSchedulerState | None = None


class GuidellmMeta(Open):
    guidellm_version: AnyText | None = None


class GuidellmReport(Open):
    metadata: GuidellmMeta | None = None
    benchmarks: list[GuidellmBenchmark] = Field(min_length=1)
