"""A `kvbench.fit/1` document (and `/2`, which may add joint bootstrap draws), typed.

`plan.links_from_fit` can read a fit through `load_fit_document` instead of raw JSON: every
field `Link` uses is typed and finite, intervals are two ordered numbers (or an upper bound
of null, "unbounded"), a two-regime break point is a byte count, warnings are
{code, message} objects. Unknown keys are kept (a newer fit may add some).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from kvbench.schema.read import MiB, load_json
from kvbench.schema.types import (
    MAX_TEXT,
    AnyText,
    Bytes,
    Count,
    Finite,
    GBps,
    Open,
    Strict,
    Text,
    TimeMs,
    parse,
    refuse,
)

MAX_FIT_BYTES = 256 * MiB
SCHEMAS = ("kvbench.fit/1", "kvbench.fit/2")


def _ordered(pair: list) -> list:
    lo, hi = pair
    if lo is not None and hi is not None and lo > hi:
        raise refuse(f"interval [{lo}, {hi}] has its lower end above its upper end")
    return pair


Interval = Annotated[list[Finite | None], Field(min_length=2, max_length=2), AfterValidator(_ordered)]
GroupValue = Annotated[str, Field(max_length=MAX_TEXT)] | bool | int | Finite | None | list[Any]


class Warning_(Open):
    code: Text
    message: AnyText


class SizeRow(Open):
    bytes: Bytes
    n: Count
    p50_ms: TimeMs | None = None
    p95_ms: TimeMs | None = None
    p99_ms: TimeMs | None = None
    mean_ms: TimeMs | None = None


class Regime(Open):
    setup_ms: Finite | None = None
    setup_ms_ci95: Interval | None = None
    effective_gb_s: GBps | None = None
    effective_gb_s_ci95: Interval | None = None
    bytes_min: Bytes
    bytes_max: Bytes


class TwoRegimes(Open):
    break_bytes: Bytes
    small: Regime
    large: Regime


Pair = Annotated[list[Finite], Field(min_length=2, max_length=2)]


class Draws(Strict):
    """kvbench.fit/2's joint bootstrap draws: one (setup_ms, ms_per_gb) pair per draw."""

    columns: list[Text]
    values: list[Pair]

    @model_validator(mode="after")
    def _two_named_columns(self):
        if list(self.columns) != ["setup_ms", "ms_per_gb"]:
            raise refuse(f"draws columns must be ['setup_ms', 'ms_per_gb'], got {self.columns!r}")
        return self


class FitGroup(Open):
    group: dict[str, GroupValue]
    label: Text
    setup_ms: Finite | None = None
    setup_ms_ci95: Interval | None = None
    effective_gb_s: GBps | None = None
    effective_gb_s_ci95: Interval | None = None
    n_samples: Count
    n_sizes: Count
    sizes: list[SizeRow] = Field(min_length=1)
    two_regimes: TwoRegimes | None = None
    warnings: list[Warning_] = []
    draws: Draws | list[Pair] | None = None  # /2 writes Draws; a bare list of pairs is read too


class FitDocument(Open):
    schema_: Literal["kvbench.fit/1", "kvbench.fit/2"] = Field(alias="schema")
    line_rate_gb_s: GBps | None = None
    inputs: list[AnyText] = []
    groups: list[FitGroup]


def load_fit_document(path: str | Path) -> FitDocument:
    """A fit file, bounded and typed; any problem is one line naming the key path."""
    raw = load_json(path, MAX_FIT_BYTES, "fit file", missing="no such file")
    return parse(FitDocument, raw, str(path))
