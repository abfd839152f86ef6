"""Read a benchmark plan for the lab: slo's one BenchmarkPlan, and the lab's own `lab:` section.

The plan format belongs to `kvbench.slo` (docs/contracts.md section 4): `kvbench.slo.benchplan.
load_benchmark_plan` reads and checks it (the tutorial's form or the nested one, bounded YAML,
duplicate keys, placeholders, equal budget) into one `BenchmarkPlan`, whose `deployment_specs`
carry each deployment's `endpoint` and `metrics_endpoints`, `cache_states` the states to
run and `runs()` every (state, deployment, rate). slo passes the `lab:` mapping through
unread; kvbench.lab.config checks it here.
"""

from __future__ import annotations

from pathlib import Path

from kvbench.errors import UsageError
from kvbench.lab.config import LabConfig, parse_lab
from kvbench.slo.benchplan import BenchmarkPlan, load_benchmark_plan


def load_lab_section(path: str | Path | None) -> LabConfig:
    """The plan's `lab:` section (defaults without a plan or a section): for `lab up/down`."""
    if path is None:
        return parse_lab({})
    return parse_lab(load_benchmark_plan(path).lab or {}, str(path))


def load_lab_plan(path: str | Path) -> tuple[BenchmarkPlan, LabConfig | None]:
    """(slo BenchmarkPlan, lab config or None) for a sweep; every problem is one UsageError line.

    A deployment without an `endpoint` is started locally, which needs the `lab:` section.
    """
    plan = load_benchmark_plan(path)
    lab = parse_lab(plan.lab, str(path)) if plan.lab is not None else None
    missing = [n for n, d in plan.deployment_specs.items() if d.endpoint is None]
    if lab is None and missing:
        raise UsageError(f"{path}: deployments {', '.join(missing)} have no endpoint and the plan has "
                         "no lab: section to start them locally")
    for name in missing:
        _agrees(plan, lab, name, str(path))
    return plan, lab


def _agrees(plan: BenchmarkPlan, lab: LabConfig, name: str, where: str) -> None:
    """What the lab starts for a deployment must be what the plan says it compares."""
    instances = {"aggregated": lab.aggregated_instances, "prefill": lab.prefill_instances,
                 "decode": lab.decode_instances}
    for role, (replicas, tp, pp) in plan.deployment_specs[name].roles.items():
        if (tp, pp) != (1, 1):
            raise UsageError(f"{where}: deployments.{name}: the lab runs one vLLM instance per core "
                             f"(TP 1, PP 1), the plan says {role} TP{tp} x PP{pp}")
        if replicas != instances[role]:
            raise UsageError(f"{where}: the plan's {name} {role} replicas ({replicas}) differ from the "
                             f"lab's {role} instances ({instances[role]}): make lab: start what the plan compares")
    if len(lab.cores) != plan.total_gpus:
        raise UsageError(f"{where}: lab.cores lists {len(lab.cores)} core(s), the plan's "
                         f"comparison.total_gpus is {plan.total_gpus} (one core stands in for one GPU)")
