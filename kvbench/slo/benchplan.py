"""The equal-budget benchmark plan: a YAML file checked before anyone spends GPU hours on it.

Two spellings of one plan are accepted and read into one `BenchmarkPlan`:

- the tutorial's `pd-benchmark-plan.yaml`, key for key: `comparison.cache_state` as a list,
  `deployments.disaggregated.{prefill_replicas, decode_replicas, tensor_parallel_per_replica,
  pipeline_parallel_per_replica}`, `metrics` as groups `client` / `scheduler` / `kv_transfer`,
  and the tutorial's wording of the attainment numerator and denominator;
- the project's nested form (`disaggregated.prefill.{replicas, ...}`, `metrics` as one list).

A plan is refused, with the path of the offending field, when it is not equal-budget
(the GPUs of the two deployments differ from each other or from total_gpus), when a
placeholder `<...>` is left unfilled, when a key is unknown, missing or given twice, or
when a value has the wrong type or unit. Deployments may name their `endpoint` and
`metrics_endpoints` (for `kvbench sweep`); a top-level `lab:` mapping is passed through
unread, for `kvbench.lab` to check. See examples/ and docs/slo.md.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from kvbench.errors import UsageError
from kvbench.records.schema.read import MiB, load_yaml
from kvbench.records.schema.types import (
    MAX_RATE_RPS,
    MAX_SECONDS,
    MAX_TEXT,
    MAX_TOKENS,
    Fraction,
    Text,
    show,
)
from kvbench.slo.gates import (
    DENOMINATOR_SYNONYMS,
    DENOMINATORS,
    NUMERATOR_SYNONYMS,
    NUMERATORS,
    Criteria,
)

PLACEHOLDER = re.compile(r"<[^<>]*>")
METRIC_NAMES = ("ttft", "tpot", "itl", "max_itl_per_request", "e2e", "throughput", "goodput",
                "slo_attainment", "error_rate", "queue_stability", "send_lag")
# `metrics` as the tutorial's groups; the client group also takes the names of the list form
METRIC_GROUPS = {
    "client": ("ttft", "tpot", "itl", "e2e", "errors", "goodput") + tuple(
        n for n in METRIC_NAMES if n not in ("ttft", "tpot", "itl", "e2e", "goodput")),
    "scheduler": ("prefill_queue", "decode_queue", "running", "rejected", "kv_cache_usage"),
    "kv_transfer": ("bytes", "setup_ms", "transfer_ms", "failures", "count"),
}
ROLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_PLAN_BYTES = MiB  # a plan is a page of YAML
MAX_GPUS = 10**6  # GPUs, replicas and parallel degrees
MAX_RATES = 1000  # offered rates in one sweep
MAX_LIMIT_MS = 1e9  # per-request latency limits
MAX_CACHE_STATES = 100


class PlanError(Exception):
    """One problem in a plan, with the dotted path of the field."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


# ---------------------------------------------------------------------------
# scalar checks: each returns the cleaned value or raises PlanError. The types and bounds
# are kvbench.records.schema's (strict: no bool for a number, no "8" for 8; finite; bounded).


def _leaf(tp, expected: str, upper: str | None = None) -> Callable:
    """A check of one value against a bounded type; upper names the bound when it is exceeded."""
    adapter = TypeAdapter(tp, config=ConfigDict(strict=True))

    def check(v, path):
        try:
            out = adapter.validate_python(v)
        except ValidationError as exc:
            too_big = exc.errors()[0]["type"] in ("less_than_equal", "too_long")
            raise PlanError(path, f"must be {upper if (upper and too_big) else expected}, "
                                  f"got {show(v)}") from None
        return float(out) if isinstance(out, float) else out
    return check


_text = _leaf(Text, "a non-empty string", f"at most {MAX_TEXT} characters")
_pos_int = _leaf(Annotated[int, Field(ge=1, le=MAX_GPUS)], "a positive integer",
                 f"at most {MAX_GPUS:,}")
_nonneg_int = _leaf(Annotated[int, Field(ge=0, le=MAX_TOKENS)], "an integer >= 0",
                    f"at most {MAX_TOKENS:,}")
_min_tokens = _leaf(Annotated[int, Field(ge=2, le=MAX_TOKENS)],
                    "an integer >= 2 (TPOT needs two tokens)", f"at most {MAX_TOKENS:,}")
_fraction = _leaf(Fraction, "a fraction in 0..1 (0.95 means 95%)")
_flag = _leaf(bool, "true or false")


def _positive(hi: float, unit: str) -> Callable:
    return _leaf(Annotated[float, Field(gt=0, le=hi, allow_inf_nan=False)], "a positive number",
                 f"at most {hi:g} {unit}")


_rate = _positive(MAX_RATE_RPS, "requests/s")
_seconds = _positive(MAX_SECONDS, "s")
_limit_ms = _positive(MAX_LIMIT_MS, "ms")


def _choice(options: dict | tuple, synonyms: dict | None = None) -> Callable:
    """One of options; a synonym (e.g. the tutorial's wording) is read as its canonical name."""
    synonyms = synonyms or {}

    def check(v, path):
        if isinstance(v, str) and v in synonyms:
            return synonyms[v]
        if not isinstance(v, str) or v not in options:
            also = f" (or the synonym{'s' if len(synonyms) > 1 else ''} {', '.join(synonyms)})" if synonyms else ""
            raise PlanError(path, f"must be one of {', '.join(options)}{also}, got {show(v)}")
        return v
    return check


RATE_REL_TOL = 1e-9  # two rates this close are the same rate: a record at one matches both


def same_rate(a: float, b: float) -> bool:
    """The one rule matching a record's offered rate to a plan's (and keeping a plan's apart)."""
    return abs(a - b) <= RATE_REL_TOL * max(1.0, abs(a), abs(b))


def _rates(v, path):
    if not isinstance(v, list) or not v:
        raise PlanError(path, "must be a non-empty list of offered rates in requests/s")
    if len(v) > MAX_RATES:
        raise PlanError(path, f"must list at most {MAX_RATES} rates, got {len(v)}")
    out = [_rate(x, f"{path}[{i}]") for i, x in enumerate(v)]
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise PlanError(f"{path}[{i}]", f"rates must increase, {out[i]:g} follows {out[i - 1]:g}")
        if same_rate(out[i], out[i - 1]):
            raise PlanError(f"{path}[{i}]", f"{out[i]!r} is the same rate as {out[i - 1]!r} (within "
                            f"{RATE_REL_TOL:g} relative, the tolerance records are matched with)")
    return out


def _names(v, path, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not v:
        raise PlanError(path, f"must be a non-empty list of {what} ({', '.join(allowed)})")
    out = tuple(_choice(allowed)(x, f"{path}[{i}]") for i, x in enumerate(v))
    for i, x in enumerate(out):
        if x in out[:i]:
            raise PlanError(f"{path}[{i}]", f"{show(x)} is listed twice")
    return out


def _metrics(v, path) -> dict[str, tuple[str, ...]]:
    """The list form (client-side names) or the tutorial's groups client/scheduler/kv_transfer."""
    if isinstance(v, list):
        return {"client": _names(v, path, METRIC_NAMES, "metric names")}
    if not isinstance(v, dict) or not v:
        raise PlanError(path, "must be a list of metric names or a mapping of groups "
                              f"({', '.join(METRIC_GROUPS)}) to lists of names")
    out = {}
    for group, names in v.items():
        if group not in METRIC_GROUPS:
            close = difflib.get_close_matches(str(group), list(METRIC_GROUPS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlanError(f"{path}.{group}", f"unknown metrics group{hint}; groups are "
                                               f"{', '.join(METRIC_GROUPS)}")
        out[group] = _names(names, f"{path}.{group}", METRIC_GROUPS[group], f"{group} metrics")
    return out


def _cache_states(v, path) -> tuple[str, ...]:
    """One state as text, or the tutorial's list: every run is required once per state."""
    if isinstance(v, str):
        return (_text(v, path),)
    if not isinstance(v, list) or not v or len(v) > MAX_CACHE_STATES:
        raise PlanError(path, "must be a cache state (text) or a non-empty list of them "
                              f"(at most {MAX_CACHE_STATES}), got {show(v)}")
    out = tuple(_text(x, f"{path}[{i}]") for i, x in enumerate(v))
    for i, x in enumerate(out):
        if x in out[:i]:
            raise PlanError(f"{path}[{i}]", f"cache state {show(x)} is listed twice")
    return out


def _url(v, path) -> str:
    try:
        parts = urlsplit(v) if isinstance(v, str) and len(v) <= MAX_TEXT else None
    except ValueError:  # e.g. an unclosed [IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise PlanError(path, f"must be an http:// or https:// URL, got {show(v)}")
    return v


def _metrics_endpoints(v, path) -> dict[str, tuple[str, ...]]:
    """role -> URL (or a list of URLs, one per replica) of Prometheus /metrics endpoints."""
    if not isinstance(v, dict) or not v:
        raise PlanError(path, "must map a role (e.g. prefill, decode, aggregated) to a /metrics URL")
    out = {}
    for role, urls in v.items():
        if not isinstance(role, str) or not ROLE_NAME.match(role):
            raise PlanError(f"{path}.{role}", "role names are letters, digits, '_', '-', '.'")
        listed = urls if isinstance(urls, list) and urls else [urls]
        out[role] = tuple(_url(u, f"{path}.{role}") for u in listed)
    return out


def _passthrough(v, path):
    if not isinstance(v, dict):
        raise PlanError(path, "must be a mapping (read by kvbench lab, not by kvbench slo)")
    return v


class Opt:
    """An optional key: checked by `spec` when present, absent otherwise."""

    def __init__(self, spec):
        self.spec = spec


class Variant:
    """A mapping whose spec depends on its keys: pick(value, path) returns the spec to use."""

    def __init__(self, pick: Callable):
        self.pick = pick


_SHAPE = {"replicas": _pos_int, "tensor_parallel": _pos_int, "pipeline_parallel": _pos_int}
_TUTORIAL_DISAGG = ("prefill_replicas", "decode_replicas", "tensor_parallel_per_replica",
                    "pipeline_parallel_per_replica")
_ENDPOINTS = {"endpoint": Opt(_url), "metrics_endpoints": Opt(_metrics_endpoints)}
_AGGREGATED = {"description": Opt(_text), **_SHAPE, **_ENDPOINTS}
# the tutorial's flat form: GPUs = (prefill + decode replicas) x TP x PP
_DISAGG_TUTORIAL = {"description": Opt(_text), **{k: _pos_int for k in _TUTORIAL_DISAGG},
                    "kv_transport": _text, **_ENDPOINTS}
# the project's nested form: GPUs = prefill replicas x TP x PP + decode replicas x TP x PP
_DISAGG_NESTED = {"description": Opt(_text), "prefill": dict(_SHAPE), "decode": dict(_SHAPE),
                  "kv_transport": _text, **_ENDPOINTS}


def _disaggregated_form(value, path):
    """Which of the two disaggregated forms a mapping uses (the tutorial's unless nested)."""
    flat = [k for k in _TUTORIAL_DISAGG if k in value]
    nested = [k for k in ("prefill", "decode") if k in value]
    if flat and nested:
        raise PlanError(path, f"mixes the tutorial's keys ({', '.join(flat)}) with the nested form "
                              f"({', '.join(nested)}); use one of the two")
    return _DISAGG_NESTED if nested else _DISAGG_TUTORIAL


SPEC: dict = {
    "comparison": {
        "model_revision": _text, "engine_version": _text, "total_gpus": _pos_int, "gpu_type": _text,
        "network_and_host_budget": _text, "warmup_requests": _nonneg_int,
        "offered_rates_rps": _rates, "output_tokens_minimum_for_tpot": _min_tokens,
        "request_deadline_seconds": _seconds, "precision": _text, "workload_trace": _text,
        "cache_state": _cache_states, "duration_seconds": _seconds,
    },
    "deployments": {
        "aggregated": _AGGREGATED,
        "disaggregated": Variant(_disaggregated_form),
    },
    "metrics": _metrics,
    "acceptance": {
        "ttft_max_ms": _limit_ms, "tpot_max_ms": _limit_ms, "max_itl_per_request_ms": _limit_ms,
        "numerator": _choice(NUMERATORS, NUMERATOR_SYNONYMS),
        "denominator": _choice(DENOMINATORS, DENOMINATOR_SYNONYMS),
        "slo_attainment_min": _fraction, "error_rate_max": _fraction,
        "require_no_sustained_queue_growth": _flag,
    },
    "lab": Opt(_passthrough),
}


def _placeholders(value, path: str, problems: list[PlanError]) -> bool:
    """Report every unfilled <...> below value; True when there was one."""
    found = False
    if isinstance(value, str) and PLACEHOLDER.search(value):
        problems.append(PlanError(path, f"placeholder {PLACEHOLDER.search(value).group(0)!r} not filled in"))
        return True
    if isinstance(value, dict):
        for k, v in value.items():
            found |= _placeholders(v, f"{path}.{k}" if path else str(k), problems)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found |= _placeholders(v, f"{path}[{i}]", problems)
    return found


def _walk(spec, value, path: str, problems: list[PlanError], out: dict) -> None:
    """Check value against spec, collecting problems; cleaned leaves go into out[path]."""
    if callable(spec):
        if spec is not _passthrough and _placeholders(value, path, []):
            return  # already reported by the placeholder pass
        try:
            out[path] = spec(value, path)
        except PlanError as exc:
            problems.append(exc)
        return
    if not isinstance(value, dict):
        if not _placeholders(value, path, []):
            problems.append(PlanError(path or "plan", "must be a mapping of keys to values"))
        return
    if isinstance(spec, Variant):
        try:
            spec = spec.pick(value, path)
        except PlanError as exc:
            problems.append(exc)
            return
    for key in value:
        if key not in spec:
            close = difflib.get_close_matches(str(key), list(spec), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(PlanError(f"{path}.{key}" if path else str(key), f"unknown key{hint}"))
    for key, sub in spec.items():
        where = f"{path}.{key}" if path else key
        if isinstance(sub, Opt):
            if key in value:
                _walk(sub.spec, value[key], where, problems, out)
        elif key not in value:
            problems.append(PlanError(where, "missing"))
        else:
            _walk(sub, value[key], where, problems, out)


@dataclass(frozen=True)
class Deployment:
    """One deployment of the comparison, however the plan spelled it."""

    name: str
    roles: dict[str, tuple[int, int, int]]  # role -> (replicas, TP, PP); aggregated has one role
    kv_transport: str | None = None
    description: str | None = None
    endpoint: str | None = None  # base URL of its OpenAI-compatible server
    metrics_endpoints: dict[str, tuple[str, ...]] = field(default_factory=dict)  # role -> URLs

    @property
    def gpus(self) -> int:
        return sum(r * tp * pp for r, tp, pp in self.roles.values())

    @property
    def shape(self) -> str:
        parts = [f"{r} x TP{tp} x PP{pp}" for r, tp, pp in self.roles.values()]
        if len(self.roles) > 1:
            parts = [f"{role} {s}" for role, s in zip(self.roles, parts, strict=True)]
        return f"{' + '.join(parts)} = {self.gpus}"


@dataclass(frozen=True)
class BenchmarkPlan:
    path: str
    total_gpus: int
    deployment_specs: dict[str, Deployment]
    offered_rates_rps: tuple[float, ...]
    cache_states: tuple[str, ...]
    metrics: dict[str, tuple[str, ...]]  # group (client, scheduler, kv_transfer) -> names
    criteria: Criteria
    form: str  # "tutorial" or "nested": how deployments.disaggregated was written
    lab: dict | None  # passed through unread, for kvbench.lab
    fields: dict  # every checked leaf by dotted path

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(self.deployment_specs)

    @property
    def gpus(self) -> dict[str, int]:
        return {n: d.gpus for n, d in self.deployment_specs.items()}

    @property
    def shapes(self) -> dict[str, str]:
        return {n: d.shape for n, d in self.deployment_specs.items()}

    def runs(self) -> list[tuple[str, str, float]]:
        """Every run the plan requires: (cache state, deployment, offered rate)."""
        return [(c, d, r) for c in self.cache_states for d in self.deployments
                for r in self.offered_rates_rps]

    def summary(self) -> str:
        rates = ", ".join(f"{r:g}" for r in self.offered_rates_rps)
        c = self.criteria
        states = ", ".join(self.cache_states)
        groups = "; ".join(f"{g}: {', '.join(n)}" for g, n in self.metrics.items())
        return (f"equal budget: {self.total_gpus} GPUs each "
                f"(aggregated {self.shapes['aggregated']}; disaggregated {self.shapes['disaggregated']}); "
                f"offered rates {rates} rps; cache state{'s' if len(self.cache_states) > 1 else ''} "
                f"{states} ({len(self.runs())} runs); limits TTFT <= {c.ttft_max_ms:g} ms, "
                f"TPOT <= {c.tpot_max_ms:g} ms, max ITL/request <= {c.max_itl_per_request_ms:g} ms; "
                f"attainment >= {100 * c.slo_attainment_min:g}% ({c.numerator} / {c.denominator}); "
                f"error rate <= {100 * c.error_rate_max:g}%; metrics {groups}")


def _roles(f: dict, name: str) -> dict[str, tuple[int, int, int]] | None:
    """role -> (replicas, TP, PP) from the checked fields, None while any is missing."""
    p = f"deployments.{name}."
    keys = ("replicas", "tensor_parallel", "pipeline_parallel")
    if name == "aggregated":
        want = {"aggregated": [p + k for k in keys]}
    elif p + "prefill_replicas" in f or p + "tensor_parallel_per_replica" in f:
        shared = [p + "tensor_parallel_per_replica", p + "pipeline_parallel_per_replica"]
        want = {role: [p + f"{role}_replicas", *shared] for role in ("prefill", "decode")}
    else:
        want = {role: [f"{p}{role}.{k}" for k in keys] for role in ("prefill", "decode")}
    if not all(k in f for ks in want.values() for k in ks):
        return None
    return {role: tuple(f[k] for k in ks) for role, ks in want.items()}


def _deployment(f: dict, name: str) -> Deployment | None:
    roles = _roles(f, name)
    if roles is None:
        return None
    p = f"deployments.{name}."
    return Deployment(name, roles, f.get(p + "kv_transport"), f.get(p + "description"),
                      f.get(p + "endpoint"), f.get(p + "metrics_endpoints") or {})


def _without_lab(data: object) -> object:
    return {k: v for k, v in data.items() if k != "lab"} if isinstance(data, dict) else data


def check_plan(data: object) -> tuple[dict, list[PlanError]]:
    """All problems of a decoded plan (empty list: valid) and its cleaned fields."""
    problems: list[PlanError] = []
    fields: dict = {}
    _placeholders(_without_lab(data), "", problems)  # lab: is checked by kvbench.lab
    _walk(SPEC, data, "", problems, fields)
    deps = [_deployment(fields, n) for n in ("aggregated", "disaggregated")]
    total = fields.get("comparison.total_gpus")
    if total is not None and all(deps):
        agg, dis = deps
        if not agg.gpus == dis.gpus == total:
            split = " + ".join(f"{role} {r * tp * pp}" for role, (r, tp, pp) in dis.roles.items())
            problems.append(PlanError(
                "deployments", f"not equal-budget: aggregated uses {agg.gpus} GPUs, disaggregated uses "
                f"{dis.gpus} ({split}), comparison.total_gpus is {total}"))
    return fields, problems


def load_benchmark_plan(path: str | Path) -> BenchmarkPlan:
    """Read and check a plan; any problem is one UsageError line naming the field paths."""
    p = Path(path)
    data = load_yaml(p, MAX_PLAN_BYTES, "plan", missing="no such plan")
    fields, problems = check_plan(data)
    if problems:
        first, rest = str(problems[0]), problems[1:]
        extra = ""
        if rest:
            shown = "; ".join(str(e) for e in rest[:3])
            extra = f" (+{len(rest)} more: {shown}{'; ...' if len(rest) > 3 else ''})"
        raise UsageError(f"{p}: {first}{extra}")
    a = "acceptance."
    criteria = Criteria(
        denominator=fields[a + "denominator"], numerator=fields[a + "numerator"],
        slo_attainment_min=fields[a + "slo_attainment_min"], ttft_max_ms=fields[a + "ttft_max_ms"],
        tpot_max_ms=fields[a + "tpot_max_ms"], max_itl_per_request_ms=fields[a + "max_itl_per_request_ms"],
        request_deadline_ms=fields["comparison.request_deadline_seconds"] * 1000.0,
        output_tokens_minimum_for_tpot=fields["comparison.output_tokens_minimum_for_tpot"],
        error_rate_max=fields[a + "error_rate_max"],
        require_no_sustained_queue_growth=fields[a + "require_no_sustained_queue_growth"],
        warmup_requests=fields["comparison.warmup_requests"],
        duration_s=fields["comparison.duration_seconds"])
    specs = {n: _deployment(fields, n) for n in ("aggregated", "disaggregated")}
    form = "nested" if "deployments.disaggregated.prefill.replicas" in fields else "tutorial"
    return BenchmarkPlan(str(p), fields["comparison.total_gpus"], specs,
                tuple(fields["comparison.offered_rates_rps"]), fields["comparison.cache_state"],
                fields["metrics"], criteria, form, fields.get("lab"), fields)
