"""The contract of a fit file: `kvbench.fit/2` (and `/1`, without joint bootstrap draws).

kvbench fit writes it through `FitDocument` (kvbench.records.write.contract_dump) and
plan, report and results.load read it back into the same class: every field the planner's
`FittedLink` uses is typed and finite, intervals are two ordered numbers (or an upper bound
of null, "unbounded"), a two-regime break point is a byte count, warnings are
{code, message} objects. Unknown keys are kept (a newer fit may add some).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from kvbench.errors import UsageError
from kvbench.records.schema.read import MiB, load_json
from kvbench.records.schema.types import (
    MAX_TEXT,
    AnyText,
    Bytes,
    Count,
    ExactInt,
    Finite,
    GBps,
    Open,
    SignedMs,
    Text,
    TimeMs,
    UsPerDesc,
    parse,
    refuse,
    show,
)

MAX_FIT_BYTES = 256 * MiB
SCHEMA_FIT = "kvbench.fit/2"  # what kvbench fit writes: /1 plus joint bootstrap draws
SCHEMA_FIT_V1 = "kvbench.fit/1"  # no draws; kvbench plan still reads it
SCHEMAS = (SCHEMA_FIT_V1, SCHEMA_FIT)


def _ordered(pair: list) -> list:
    lo, hi = pair
    if lo is not None and hi is not None and lo > hi:
        raise refuse(f"interval [{lo}, {hi}] has its lower end above its upper end")
    return pair


Interval = Annotated[list[Finite | None], Field(min_length=2, max_length=2), AfterValidator(_ordered)]
GroupValue = (Annotated[str, Field(max_length=MAX_TEXT)] | bool | ExactInt | Finite | None | list[Any]
              | dict[str, Any])


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
    end_to_end_gb_s: Finite | None = None  # bytes over the median time, setup included
    fitted_ms: Finite | None = None  # the line at this size, and the median's distance from it
    residual_ms: Finite | None = None
    residual_rel: Finite | None = None


Pair = Annotated[list[Finite], Field(min_length=2, max_length=2)]


DRAW_COLUMNS = ["setup_ms", "ms_per_gb"]


class Draws(Open):
    """Joint bootstrap draws as kvbench fit writes them: {"columns": [...], "values": [[a, b]]}.

    The columns are (setup_ms, ms_per_gb) in that order (no columns: that order); a bare list
    of pairs is read as the same (see _one_form), so every reader sees one form.
    """

    columns: list[Text] = []
    values: list[Pair]

    @model_validator(mode="after")
    def _known_columns(self):
        if self.columns and self.columns != DRAW_COLUMNS:
            raise refuse(f"draw columns must be {DRAW_COLUMNS}, got {show(self.columns)}")
        return self


def _one_form(v):
    """A bare list of pairs is the values of a Draws: readers see {"columns", "values"} only."""
    return {"columns": list(DRAW_COLUMNS), "values": v} if isinstance(v, list) else v


WRITTEN_DIGITS = 6  # kvbench fit writes estimates and draws to 6 significant digits


def _slack(values: list[float], scale: float) -> float:
    """How far apart two numbers kvbench fit wrote may be and still be one number: each was
    rounded to WRITTEN_DIGITS significant digits (half a unit in the last digit each side), and
    a setup computed next to a fitted time of `scale` ms carries that time's float error."""
    return 10.0 ** (1 - WRITTEN_DIGITS) * max(scale, *(abs(v) for v in values))


def check_draws_hold(draws: Draws | None, setup_ms: float | None, effective_gb_s: float | None,
                     bytes_max: int | None = None) -> None:
    """Draws must surround their point estimate, slope positive at the middle: a band of 1000 ms
    beside a 13.5 ms floor (draws from another fit, columns swapped, a sign lost) is refused.

    "Surround" is up to the precision kvbench fit writes: a noise-free fit's draws all equal its
    estimate, and the estimate's slope (1000 / a rounded GB/s) differs from a rounded draw's in
    the sixth digit; that is the same number, not another fit's draws."""
    if draws is None or not draws.values or setup_ms is None or effective_gb_s is None:
        return
    setups = sorted(v[0] for v in draws.values)
    slopes = sorted(v[1] for v in draws.values)
    slope = 1000.0 / effective_gb_s
    largest_ms = abs(slope) * (bytes_max or 0) / 1e9  # the line's time at the largest size
    s_slack = _slack([setups[0], setups[-1], setup_ms], largest_ms)
    b_slack = _slack([slopes[0], slopes[-1], slope], 0.0)
    if (not setups[0] - s_slack <= setup_ms <= setups[-1] + s_slack
            or not slopes[0] - b_slack <= slope <= slopes[-1] + b_slack):
        raise refuse(f"the draws (setup_ms {setups[0]:.6g}..{setups[-1]:.6g}, ms_per_gb "
                     f"{slopes[0]:.6g}..{slopes[-1]:.6g}) do not surround the point estimate "
                     f"(setup_ms {setup_ms:.6g}, ms_per_gb {slope:.6g}): not this fit's draws")
    if slopes[len(slopes) // 2] <= 0:
        raise refuse("the draws' median ms_per_gb is not positive: time must grow with bytes")


def check_term_draws(name: str, estimate: float | None, draws: list[float] | None,
                     n_joint: int | None) -> None:
    """A drawn term (us_per_desc, us_per_merged_desc) is held to the rules of setup and rate:
    its draws surround its estimate (to the six digits fit writes), it has an estimate if it
    has draws, and it has as many draws as the joint (setup, rate) draws, which plan stacks
    column by column into one band: 3 draws beside 200, or draws 100x the estimate (a band
    of 365 ms beside an 8 ms floor), are another fit's."""
    if not draws:
        return
    if estimate is None:
        raise refuse(f"{name}_draws without {name}: draws of a term the fit did not estimate")
    if n_joint is not None and len(draws) != n_joint:
        raise refuse(f"{len(draws)} {name}_draws beside {n_joint} joint draws: one draw of each "
                     "term per bootstrap resample")
    lo, hi = min(draws), max(draws)
    slack = _slack([lo, hi, estimate], 0.0)
    if not lo - slack <= estimate <= hi + slack:
        raise refuse(f"the {name} draws ({lo:.6g}..{hi:.6g}) do not surround the estimate "
                     f"{name} {estimate:.6g}: not this fit's draws")


DrawsIn = Annotated[Draws | None, BeforeValidator(_one_form)]


class Regime(Open):
    setup_ms: SignedMs | None = None
    setup_ms_ci95: Interval | None = None
    effective_gb_s: GBps | None = None
    effective_gb_s_ci95: Interval | None = None
    bytes_min: Bytes
    bytes_max: Bytes
    draws: DrawsIn = None

    @model_validator(mode="after")
    def _draws_hold(self):
        check_draws_hold(self.draws, self.setup_ms, self.effective_gb_s, self.bytes_max)
        return self


class TwoRegimes(Open):
    break_bytes: Bytes
    small: Regime
    large: Regime



class LackOfFitIn(Open):
    q: Finite | None = None
    df: Count | None = None
    p_value: Annotated[float, Field(ge=0, le=1)] | None = None
    size_scatter_rel: Finite | None = None
    scatter_from: AnyText | None = None


class ResamplingIn(Open):
    n_draws: Count | None = None
    none_because: AnyText | None = None


class DescriptorTerm(Open):
    """Whether the fit could separate a per-descriptor cost from bytes (kvbench.fit.descriptors)."""

    separable: bool
    reason: AnyText | None = None


class FitGroup(Open):
    group: dict[str, GroupValue]
    label: Text
    spec: dict[str, Any] | None = None  # the frozen spec of the records (absent before specs)
    spec_id: Text | None = None
    ms_per_gb: Finite | None = None
    n_records: Count | None = None
    bytes_min: Bytes | None = None
    bytes_max: Bytes | None = None
    setup_ms: SignedMs | None = None
    setup_ms_ci95: Interval | None = None
    effective_gb_s: GBps | None = None
    effective_gb_s_ci95: Interval | None = None
    n_samples: Count
    n_sizes: Count
    sizes: list[SizeRow] = Field(min_length=1)
    two_regimes: TwoRegimes | None = None
    warnings: list[Warning_] = []
    draws: DrawsIn = None  # /2 writes Draws; a bare list of pairs is read as the same
    # read by report and results.load: typed so another type is one line, not a traceback
    lack_of_fit: LackOfFitIn | None = None
    resampling: ResamplingIn | None = None
    no_interval: AnyText | None = None
    fit_as_link: bool | None = None
    # the per-descriptor term: a link's cuts fitted together (docs/descriptors.md)
    descriptor_term: DescriptorTerm | None = None
    descriptor_field: Text | None = None
    us_per_desc: UsPerDesc | None = None
    us_per_desc_draws: list[UsPerDesc] | None = None
    us_per_merged_desc: UsPerDesc | None = None
    us_per_merged_desc_draws: list[UsPerDesc] | None = None
    # a store link's mounted pool (absent in fits of direct links and in fits before it)
    store_pool_bytes: Bytes | None = None

    @model_validator(mode="after")
    def _draws_hold(self):
        check_draws_hold(self.draws, self.setup_ms, self.effective_gb_s,
                         max(row.bytes for row in self.sizes))
        n = len(self.draws.values) if self.draws and self.draws.values else None
        for name in ("us_per_desc", "us_per_merged_desc"):
            check_term_draws(name, getattr(self, name), getattr(self, f"{name}_draws"), n)
        return self


class SkippedGroup(Open):
    """A group fit left out (not a link), named by plan's note."""

    label: AnyText
    reason: AnyText
    group: dict[str, GroupValue] = {}


class FitDocument(Open):
    schema_: Literal["kvbench.fit/1", "kvbench.fit/2"] = Field(alias="schema")
    line_rate_gb_s: GBps | None = None
    inputs: list[AnyText] = []
    groups: list[FitGroup]
    skipped: list[SkippedGroup] = []


def load_fit_document(path: str | Path, raw: object = None) -> FitDocument:
    """A fit file, bounded and typed; any problem is one line naming the key path. `raw`: the
    file's JSON when the caller has read it already (kvbench.records.schema.matrix)."""
    if raw is None:
        raw = load_json(path, MAX_FIT_BYTES, "fit file", missing="no such file")
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a JSON object written by kvbench fit")
    if raw.get("schema") not in SCHEMAS:
        raise UsageError(f"{path}: unknown fit schema {show(raw.get('schema'))} (this kvbench "
                         f"reads {' and '.join(SCHEMAS)}; expected the output of kvbench fit)")
    return parse(FitDocument, raw, str(path))
