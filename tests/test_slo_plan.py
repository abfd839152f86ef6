"""`kvbench slo validate-plan`: the shipped example passes; every kind of bad plan is one line, exit 2."""

from __future__ import annotations

import copy

import pytest
import yaml

import kvbench.slo
from tests.conftest import ROOT, run_cli

EXAMPLE = ROOT / "examples" / "pd-benchmark-plan.yaml"
TEMPLATE = ROOT / "examples" / "pd-benchmark-plan.template.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def validate(capsys, path) -> tuple[int, str, str]:
    rc = kvbench.slo.cli(["validate-plan", str(path)])  # what `kvbench slo validate-plan` calls
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_shipped_example_plan_is_valid_and_equal_budget():
    res = run_cli("kvbench.slo", "validate-plan", str(EXAMPLE))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{EXAMPLE}: valid plan; equal budget: 8 GPUs each")
    assert "aggregated 2 x TP4 x PP1 = 8" in res.stdout
    assert "prefill 1 x TP4 x PP1 + decode 1 x TP4 x PP1 = 8" in res.stdout
    assert "(requests_meeting_all_limits / all_offered_after_warmup)" in res.stdout


def test_example_is_the_template_filled_in():
    """Same keys, every placeholder filled with a value: the template is the example's shape."""
    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict):
                out |= keys(v, prefix + k + ".")
        return out
    template = yaml.safe_load(TEMPLATE.read_text())
    assert keys(template) == keys(example())
    assert "FICTIONAL" in EXAMPLE.read_text()


def test_template_is_refused_for_its_placeholders():
    res = run_cli("kvbench.slo", "validate-plan", str(TEMPLATE))
    assert res.returncode == 2 and res.stdout == "" and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"kvbench slo: error: {TEMPLATE}: comparison.model_revision: "
                                 "placeholder '<hf-repo@commit>' not filled in (+34 more: ")


def _set(plan: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = plan
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


_DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    ("deployments.disaggregated.decode.replicas", 2,
     "deployments: not equal-budget: aggregated uses 8 GPUs, disaggregated uses 12 (prefill 4 + decode 8), "
     "comparison.total_gpus is 8"),
    ("comparison.total_gpus", 16,
     "deployments: not equal-budget: aggregated uses 8 GPUs, disaggregated uses 8 (prefill 4 + decode 4), "
     "comparison.total_gpus is 16"),
    ("deployments.aggregated.pipeline_parallel", 2,
     "deployments: not equal-budget: aggregated uses 16 GPUs"),
    ("comparison.engine_version", "<engine build>", "comparison.engine_version: placeholder '<engine build>' not filled in"),
    ("comparison.offered_rates_rps", [1, "<rate>", 4], "comparison.offered_rates_rps[1]: placeholder '<rate>'"),
    ("acceptance.ttft_p95_ms", 500, "acceptance.ttft_p95_ms: unknown key"),
    ("comparison.duration_second", 60, "comparison.duration_second: unknown key (did you mean 'duration_seconds'?)"),
    ("deployments.disaggregated.prefill.gpus", 4, "deployments.disaggregated.prefill.gpus: unknown key"),
    ("acceptance.denominator", _DELETE, "acceptance.denominator: missing"),
    ("acceptance.denominator", "everyone",
     "acceptance.denominator: must be one of all_offered_after_warmup, successful, got 'everyone'"),
    ("acceptance.numerator", "fast_requests", "acceptance.numerator: must be one of requests_meeting_all_limits"),
    ("acceptance.slo_attainment_min", 95, "acceptance.slo_attainment_min: must be a fraction in 0..1"),
    ("acceptance.require_no_sustained_queue_growth", "yes please",
     "acceptance.require_no_sustained_queue_growth: must be true or false"),
    ("comparison.offered_rates_rps", [1, 4, 2], "comparison.offered_rates_rps[2]: rates must increase, 2 follows 4"),
    ("comparison.offered_rates_rps", [], "comparison.offered_rates_rps: must be a non-empty list"),
    ("comparison.output_tokens_minimum_for_tpot", 1, "comparison.output_tokens_minimum_for_tpot: must be an integer >= 2"),
    ("comparison.total_gpus", 8.0, "comparison.total_gpus: must be a positive integer, got 8.0"),
    ("metrics", ["ttft", "p95"], "metrics[1]: must be one of ttft, tpot"),
    ("deployments.disaggregated.kv_transport", "", "deployments.disaggregated.kv_transport: must be a non-empty string"),
])
def test_bad_plans_are_refused_with_the_offending_path(tmp_path, capsys, path, value, message):
    plan = copy.deepcopy(example())
    _set(plan, path, value)
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(plan))
    rc, out, err = validate(capsys, f)
    assert rc == 2 and out == ""
    assert err.startswith(f"kvbench slo: error: {f}: ") and err.count("\n") == 1
    assert message in err


def test_several_problems_are_all_named_on_one_line(tmp_path, capsys):
    plan = example()
    plan["acceptance"]["denominator"] = "everyone"
    plan["comparison"]["gpu_type"] = "<gpu>"
    plan["extra"] = 1
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(plan))
    rc, _, err = validate(capsys, f)
    assert rc == 2 and err.count("\n") == 1
    for fragment in ("comparison.gpu_type: placeholder '<gpu>'", "extra: unknown key",
                     "acceptance.denominator: must be one of", "(+2 more: "):
        assert fragment in err


@pytest.mark.parametrize("text, message", [
    ("comparison:\n  total_gpus: 8\n  total_gpus: 16\n", ":3: not valid YAML (duplicate key 'total_gpus')"),
    ("comparison: [1, 2\n", ": not valid YAML"),
    ("- just\n- a list\n", "plan: must be a mapping of keys to values"),
])
def test_unreadable_plans(tmp_path, capsys, text, message):
    f = tmp_path / "plan.yaml"
    f.write_text(text)
    rc, _, err = validate(capsys, f)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_missing_plan_file(tmp_path, capsys):
    rc, _, err = validate(capsys, tmp_path / "nope.yaml")
    assert rc == 2 and err.strip() == f"kvbench slo: error: no such plan: {tmp_path / 'nope.yaml'}"
