"""Read a benchmark plan for the lab: the `lab:` section, endpoints, and the slo Plan.

The plan format belongs to `kvbench.slo` (CONTRACTS.md section 4). This module is the
one place that adapts it for the lab, so that when the slo checker learns the
tutorial's full shape (cache_state lists, per-deployment `endpoint` and
`metrics_endpoints`, a passed-through `lab:`), only `_slo_view` changes:
today it hands the slo checker the plan without the keys it does not know yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvbench.cli import UsageError, read_text
from kvbench.lab.config import LabConfig, LabConfigError, parse_lab

ENDPOINT_KEYS = ("endpoint", "metrics_endpoints")


@dataclass(frozen=True)
class Target:
    """Where one deployment answers: an OpenAI-compatible base URL and its /metrics URLs."""

    endpoint: str | None
    metrics_endpoints: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class LabPlan:
    path: str
    data: dict  # the whole decoded YAML
    lab: LabConfig | None  # None when the plan has no `lab:` section
    targets: dict[str, Target]  # per deployment, from the plan (endpoint None: start locally)
    cache_states: tuple[str, ...]


def _decode(path: str | Path) -> dict:
    from kvbench.slo.plan import _UniqueKeyLoader  # the slo checker's duplicate-key refusal

    p = Path(path)
    text = read_text(p, missing="no such plan")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UsageError(f"{p}{':' + str(mark.line + 1) if mark else ''}: not valid YAML") from None
    if not isinstance(data, dict):
        raise UsageError(f"{p}: a plan is a mapping (comparison, deployments, metrics, acceptance)")
    return data


def _metrics_endpoints(value, where: str) -> dict[str, list[str]]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: must map a role (prefill, decode, aggregated) to URL(s)")
    out = {}
    for role, urls in value.items():
        urls = [urls] if isinstance(urls, str) else urls
        if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
            raise UsageError(f"{where}.{role}: must be a URL or a list of URLs")
        out[str(role)] = list(urls)
    return out


def _targets(data: dict, path: str) -> dict[str, Target]:
    out = {}
    for name, dep in (data.get("deployments") or {}).items():
        dep = dep if isinstance(dep, dict) else {}
        where = f"{path}: deployments.{name}"
        endpoint = dep.get("endpoint")
        if endpoint is not None and not (isinstance(endpoint, str) and endpoint.startswith("http")):
            raise UsageError(f"{where}.endpoint: must be an http(s) base URL, got {endpoint!r}")
        out[name] = Target(endpoint, _metrics_endpoints(dep.get("metrics_endpoints"),
                                                        f"{where}.metrics_endpoints"))
    return out


def cache_states(data: dict) -> tuple[str, ...]:
    value = (data.get("comparison") or {}).get("cache_state")
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return (value,) if isinstance(value, str) and value else ("default",)


def _slo_view(data: dict) -> dict:
    """The plan as today's slo checker accepts it (see the module docstring)."""
    view = {k: v for k, v in data.items() if k != "lab"}
    deps = {}
    for name, dep in (view.get("deployments") or {}).items():
        deps[name] = ({k: v for k, v in dep.items() if k not in ENDPOINT_KEYS}
                      if isinstance(dep, dict) else dep)
    view["deployments"] = deps
    comparison = dict(view.get("comparison") or {})
    if isinstance(comparison.get("cache_state"), list):
        comparison["cache_state"] = ", ".join(map(str, comparison["cache_state"]))
    view["comparison"] = comparison
    return view


def load_lab_section(path: str | Path | None) -> LabConfig:
    """Only the `lab:` section (defaults when no plan or no section): for `lab up/down`."""
    if path is None:
        return parse_lab({})
    data = _decode(path)
    try:
        return parse_lab(data.get("lab") or {})
    except LabConfigError as exc:
        raise UsageError(f"{path}: {exc}") from None


def load_lab_plan(path: str | Path):
    """(slo Plan, LabPlan) for a sweep or a fault run; every problem is one UsageError line."""
    from kvbench.slo.plan import check_plan, load_plan

    data = _decode(path)
    fields, problems = check_plan(_slo_view(data))
    if problems:
        raise UsageError(f"{path}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if problems[1:] else ""))
    try:
        lab = parse_lab(data["lab"]) if "lab" in data else None
    except LabConfigError as exc:
        raise UsageError(f"{path}: {exc}") from None
    plan = _plan_from_view(path, data, load_plan)
    targets = _targets(data, str(path))
    if lab is None and any(t.endpoint is None for t in targets.values()):
        missing = [n for n, t in targets.items() if t.endpoint is None]
        raise UsageError(f"{path}: deployments {', '.join(missing)} have no endpoint and the plan has "
                         "no lab: section to start them locally")
    return plan, LabPlan(str(path), data, lab, targets, cache_states(data))


def _plan_from_view(path, data, load_plan):
    """Build the slo Plan object through slo's own loader, from the adapted view."""
    import dataclasses
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(_slo_view(data), fh, sort_keys=False)
    try:
        plan = load_plan(fh.name)
    finally:
        Path(fh.name).unlink()
    return dataclasses.replace(plan, path=str(path))
