"""The contracts of what `kvbench plan` writes: the plan (`kvbench.plan/1`), the routing
decision (`kvbench.route/1`) and the tool-neutral handoff model of `kvbench plan export`
(`kvbench.kv-transfer-model/1`, the source of every planning tool's fragment).

Each writer builds its document as one of these classes and dumps it
(kvbench.records.write.contract_dump); a reader validates a file back into the same class.
Times are plain finite numbers here, not bounded like measured ones: a plan may be asked
about a payload that takes longer than any clock measures (an extreme --prompt-tokens at
a slow --gbps), and that answer is still a number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kvbench.errors import UsageError
from kvbench.records.schema.fit import Interval
from kvbench.records.schema.read import MiB, load_json
from kvbench.records.schema.types import (
    AnyText,
    Bytes,
    Count,
    Finite,
    GBps,
    Open,
    PositiveTokens,
    Text,
    Tokens,
    parse,
    show,
)

SCHEMA_PLAN = "kvbench.plan/1"
SCHEMA_ROUTE = "kvbench.route/1"
SCHEMA_KV_MODEL = "kvbench.kv-transfer-model/1"
MAX_PLAN_BYTES = 64 * MiB
Band = list[Finite | None]


class PlanRow(Open):
    """One link at one prompt length: the floor, its band and the budget verdict."""

    link: AnyText
    source: Literal["fit", "user"]
    shape: Text | None = None
    group: dict[str, Any] | None = None
    prompt_tokens: Tokens
    kv_bytes: Bytes
    effective_gb_s: GBps
    includes_setup: bool
    setup_ms: Finite | None = None
    bandwidth_floor_ms: Finite | None = None
    handoff_floor_ms: Finite | None = None
    handoff_floor_ms_band95: Band | None = None
    budget_ms: Finite
    within_budget: bool
    measured_p50_ms: Finite | None = None
    measured_p99_ms: Finite | None = None
    measured_n: Count | None = None
    regime: Text
    fit_warnings: list[Text] = []
    notes: list[AnyText] = []
    # a store link (kvbench p2p --pattern store): its mounted pool, and the whole requests of
    # this prompt's KV it holds (one replica each, before any eviction)
    store_pool_bytes: Bytes | None = None
    store_capacity_requests: Count | None = None


class PlanDocument(Open):
    schema_: Literal["kvbench.plan/1"] = Field(alias="schema")
    scope: AnyText
    source: AnyText
    model: Text
    dtype: Text
    budget_ms: Finite
    rows: list[PlanRow]
    not_measured: list[AnyText] = []  # inputs kvbench did not measure (kvbench.tutorial)


class RouteDocument(Open):
    schema_: Literal["kvbench.route/1"] = Field(alias="schema")
    source: AnyText
    model: Text
    dtype: Text
    handoff: Text
    local_interference_ms: Finite
    interference_at_tokens: PositiveTokens | None = None
    itl_p95_ms: Finite
    itl_target_ms: Finite
    decisions: list[dict[str, Any]]
    breakeven: list[dict[str, Any]]
    not_measured: list[AnyText] = []  # inputs kvbench did not measure (kvbench.tutorial)


class Fold(Open):
    """Setup folded into one rate, exact at one prompt length (for tools with no setup term)."""

    prompt_tokens: PositiveTokens
    effective_gb_s_with_setup: Finite


class DescriptorPart(Open):
    """The per-descriptor term at the planned cut, split the way a two-term tool takes it."""

    us_per_desc: Finite
    us_per_merged_desc: Finite | None = None
    cut: dict[str, Any]
    ms_constant: Finite
    ms_per_token: Finite
    base_ms: Finite
    rate_gb_s: Finite
    descriptors: dict[str, Count]
    descriptors_merged: dict[str, Count | None]
    note: AnyText


class KVTransferModel(Open):
    """setup_ms + prompt_tokens x bytes_per_token_per_rank / (effective_gb_s x 1e9) x 1000
    [+ the descriptor term]: what every planning tool's parameters are computed from."""

    schema_: Literal["kvbench.kv-transfer-model/1"] = Field(alias="schema")
    formula: AnyText
    setup_ms: Finite
    setup_ms_ci95: Interval | None = None
    effective_gb_s: GBps
    effective_gb_s_ci95: Interval | None = None
    units: AnyText
    bytes_per_token_per_rank: Bytes
    bytes_per_token_all_ranks: Bytes
    tp: PositiveTokens
    tp_note: AnyText
    model: Text
    dtype: Text
    transport: AnyText | None = None
    link: AnyText
    shape: Text | None = None
    context: dict[str, Any]
    fold: Fold
    handoff_ms: dict[str, Finite]  # prompt tokens (as text) -> the model's handoff ms
    descriptor: DescriptorPart | None = None


def load_plan_file(path: str | Path, model: type[PlanDocument | RouteDocument | KVTransferModel]):
    """A file kvbench plan wrote, read back through its contract; one line on any problem."""
    raw = load_json(path, MAX_PLAN_BYTES, "plan file", missing="no such file")
    want = model.model_fields["schema_"].annotation.__args__[0]
    if not isinstance(raw, dict) or raw.get("schema") != want:
        got = raw.get("schema") if isinstance(raw, dict) else None
        raise UsageError(f"{path}: expected a {want} document, got schema {show(got)}")
    return parse(model, raw, str(path))
