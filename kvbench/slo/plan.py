"""The equal-budget benchmark plan: a YAML file checked before anyone spends GPU hours on it.

A plan is refused, with the path of the offending field, when it is not equal-budget
(the GPUs of the two deployments differ from each other or from total_gpus), when a
placeholder `<...>` is left unfilled, when a key is unknown or missing, or when a value
has the wrong type or unit. See examples/pd-benchmark-plan.yaml and its template.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvbench.cli import UsageError, read_text
from kvbench.slo.gates import DENOMINATORS, NUMERATORS, Criteria

PLACEHOLDER = re.compile(r"<[^<>]*>")
METRIC_NAMES = ("ttft", "tpot", "itl", "max_itl_per_request", "e2e", "throughput", "goodput",
                "slo_attainment", "error_rate", "queue_stability", "send_lag")


class PlanError(Exception):
    """One problem in a plan, with the dotted path of the field."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


# ---------------------------------------------------------------------------
# scalar checks: each returns the cleaned value or raises PlanError


def _text(v, path):
    if not isinstance(v, str) or not v.strip():
        raise PlanError(path, f"must be a non-empty string, got {v!r}")
    return v


def _pos_int(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise PlanError(path, f"must be a positive integer, got {v!r}")
    return v


def _nonneg_int(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PlanError(path, f"must be an integer >= 0, got {v!r}")
    return v


def _min_tokens(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise PlanError(path, f"must be an integer >= 2 (TPOT needs two tokens), got {v!r}")
    return v


def _pos_num(v, path):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise PlanError(path, f"must be a positive number, got {v!r}")
    return float(v)


def _fraction(v, path):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise PlanError(path, f"must be a fraction in 0..1 (0.95 means 95%), got {v!r}")
    return float(v)


def _flag(v, path):
    if not isinstance(v, bool):
        raise PlanError(path, f"must be true or false, got {v!r}")
    return v


def _choice(options: dict | tuple) -> Callable:
    def check(v, path):
        if v not in options:
            raise PlanError(path, f"must be one of {', '.join(options)}, got {v!r}")
        return v
    return check


def _rates(v, path):
    if not isinstance(v, list) or not v:
        raise PlanError(path, "must be a non-empty list of offered rates in requests/s")
    out = [_pos_num(x, f"{path}[{i}]") for i, x in enumerate(v)]
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise PlanError(f"{path}[{i}]", f"rates must increase, {out[i]:g} follows {out[i - 1]:g}")
    return out


def _metric_list(v, path):
    if not isinstance(v, list) or not v:
        raise PlanError(path, f"must be a non-empty list of metric names ({', '.join(METRIC_NAMES)})")
    return [_choice(METRIC_NAMES)(x, f"{path}[{i}]") for i, x in enumerate(v)]


_SHAPE = {"replicas": _pos_int, "tensor_parallel": _pos_int, "pipeline_parallel": _pos_int}
SPEC: dict = {
    "comparison": {
        "model_revision": _text, "engine_version": _text, "total_gpus": _pos_int, "gpu_type": _text,
        "network_and_host_budget": _text, "warmup_requests": _nonneg_int,
        "offered_rates_rps": _rates, "output_tokens_minimum_for_tpot": _min_tokens,
        "request_deadline_seconds": _pos_num, "precision": _text, "workload_trace": _text,
        "cache_state": _text, "duration_seconds": _pos_num,
    },
    "deployments": {
        "aggregated": dict(_SHAPE),
        "disaggregated": {"prefill": dict(_SHAPE), "decode": dict(_SHAPE), "kv_transport": _text},
    },
    "metrics": _metric_list,
    "acceptance": {
        "ttft_max_ms": _pos_num, "tpot_max_ms": _pos_num, "max_itl_per_request_ms": _pos_num,
        "numerator": _choice(NUMERATORS), "denominator": _choice(DENOMINATORS),
        "slo_attainment_min": _fraction, "error_rate_max": _fraction,
        "require_no_sustained_queue_growth": _flag,
    },
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
        if _placeholders(value, path, []):
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
    for key in value:
        if key not in spec:
            close = difflib.get_close_matches(str(key), list(spec), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(PlanError(f"{path}.{key}" if path else str(key), f"unknown key{hint}"))
    for key, sub in spec.items():
        where = f"{path}.{key}" if path else key
        if key not in value:
            problems.append(PlanError(where, "missing"))
        else:
            _walk(sub, value[key], where, problems, out)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice instead of keeping the last one."""


def _mapping(loader, node, deep=False):
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        keys.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


@dataclass(frozen=True)
class Plan:
    path: str
    total_gpus: int
    gpus: dict[str, int]  # per deployment, from replicas x TP x PP
    shapes: dict[str, str]  # human form of each deployment's shape
    offered_rates_rps: tuple[float, ...]
    criteria: Criteria
    fields: dict  # every checked leaf by dotted path

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(self.gpus)

    def summary(self) -> str:
        rates = ", ".join(f"{r:g}" for r in self.offered_rates_rps)
        c = self.criteria
        return (f"equal budget: {self.total_gpus} GPUs each "
                f"(aggregated {self.shapes['aggregated']}; disaggregated {self.shapes['disaggregated']}); "
                f"offered rates {rates} rps; limits TTFT <= {c.ttft_max_ms:g} ms, TPOT <= {c.tpot_max_ms:g} ms, "
                f"max ITL/request <= {c.max_itl_per_request_ms:g} ms; attainment >= "
                f"{100 * c.slo_attainment_min:g}% ({c.numerator} / {c.denominator}); "
                f"error rate <= {100 * c.error_rate_max:g}%")


def _gpus(f: dict, prefix: str) -> tuple[int, str]:
    r, tp, pp = (f[f"{prefix}.{k}"] for k in ("replicas", "tensor_parallel", "pipeline_parallel"))
    return r * tp * pp, f"{r} x TP{tp} x PP{pp}"


def check_plan(data: object) -> tuple[dict, list[PlanError]]:
    """All problems of a decoded plan (empty list: valid) and its cleaned fields."""
    problems: list[PlanError] = []
    fields: dict = {}
    _placeholders(data, "", problems)
    _walk(SPEC, data, "", problems, fields)
    need = [f"deployments.aggregated.{k}" for k in _SHAPE] + \
           [f"deployments.disaggregated.{s}.{k}" for s in ("prefill", "decode") for k in _SHAPE] + \
           ["comparison.total_gpus"]
    if all(k in fields for k in need):
        agg, _ = _gpus(fields, "deployments.aggregated")
        pre, _ = _gpus(fields, "deployments.disaggregated.prefill")
        dec, _ = _gpus(fields, "deployments.disaggregated.decode")
        total = fields["comparison.total_gpus"]
        if not agg == pre + dec == total:
            problems.append(PlanError(
                "deployments", f"not equal-budget: aggregated uses {agg} GPUs, disaggregated uses "
                f"{pre + dec} (prefill {pre} + decode {dec}), comparison.total_gpus is {total}"))
    return fields, problems


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan; any problem is one UsageError line naming the field paths."""
    p = Path(path)
    text = read_text(p, missing="no such plan")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{p}{line}: not valid YAML ({what})") from None
    fields, problems = check_plan(data)
    if problems:
        first, rest = str(problems[0]), problems[1:]
        extra = ""
        if rest:
            shown = "; ".join(str(e) for e in rest[:3])
            extra = f" (+{len(rest)} more: {shown}{'; ...' if len(rest) > 3 else ''})"
        raise UsageError(f"{p}: {first}{extra}")
    agg, agg_shape = _gpus(fields, "deployments.aggregated")
    pre, pre_shape = _gpus(fields, "deployments.disaggregated.prefill")
    dec, dec_shape = _gpus(fields, "deployments.disaggregated.decode")
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
    return Plan(str(p), fields["comparison.total_gpus"], {"aggregated": agg, "disaggregated": pre + dec},
                {"aggregated": f"{agg_shape} = {agg}",
                 "disaggregated": f"prefill {pre_shape} + decode {dec_shape} = {pre + dec}"},
                tuple(fields["comparison.offered_rates_rps"]), criteria, fields)
