"""`kvbench slo validate-plan`: the shipped example passes; every kind of bad plan is one line, exit 2."""

from __future__ import annotations

import copy

import pytest
import yaml

import kvbench.slo.cli
from tests.conftest import ROOT, run_cli

EXAMPLE = ROOT / "examples" / "pd-benchmark-plan.nested.yaml"  # the project's nested spelling
TEMPLATE = ROOT / "examples" / "pd-benchmark-plan.nested.template.yaml"
TUTORIAL = ROOT / "examples" / "pd-benchmark-plan.yaml"  # the tutorial's spelling
TUTORIAL_TEMPLATE = ROOT / "examples" / "pd-benchmark-plan.template.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def tutorial() -> dict:
    return yaml.safe_load(TUTORIAL.read_text())


def validate(capsys, path) -> tuple[int, str, str]:
    rc = kvbench.slo.cli.cli(["validate-plan", str(path)])  # what `kvbench slo validate-plan` calls
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


NESTED_REFUSALS = [
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
     "acceptance.denominator: must be one of all_offered_after_warmup, successful (or the synonym "
     "all_offered_requests_after_warmup_including_rejections_and_timeouts), got 'everyone'"),
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
]


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


# ---------------------------------------------------------------------------
# the tutorial's spelling (issue 13): accepted key for key, one BenchmarkPlan for both spellings

FILLS = {  # what a user writes for each of the tutorial template's placeholders
    "<hf-repo@commit>": "org/model@0123abc", "<engine and version>": "vllm 0.32.0",
    "<N>": "8", "<gpu model and memory>": "H100 80 GB", "<rate>": "2",
    "<NICs, links, CPU and host RAM both deployments may use>": "one node",
    "<requests excluded at the start of each run>": "20", "<tokens>": "16", "<seconds>": "60",
    "<weights/activations/KV dtype>": "bf16", "<trace file or generator with seed>": "random, seed 0",
    "<seconds of measured traffic per rate, after warm-up>": "120", "<ms>": "100",
    "<what one replica serves, e.g. prefill and decode on the same GPUs>": "both phases",
    "<connector and fabric that moves the KV cache>": "NixlConnector over NVLink",
    "<fraction>": "0.95", "<true | false>": "true",
}


def _filled_tutorial_text() -> str:
    """The tutorial's text with only its placeholders replaced, as a user fills it in."""
    import re

    text = TUTORIAL_TEMPLATE.read_text()
    rates = iter(["1", "2", "4"])
    text = text.replace("[<rate>, <rate>, <rate>]", f"[{next(rates)}, {next(rates)}, {next(rates)}]")
    text = text.replace("<n>", "1").replace("replicas: 1\n    tensor_parallel: 1",
                                            "replicas: 2\n    tensor_parallel: 1")
    text = re.sub(r"<[^<>]*>", lambda m: FILLS.get(m.group(0), m.group(0)), text)  # comments keep theirs
    return text.replace("total_gpus: 8", "total_gpus: 2")


def test_tutorial_text_with_placeholders_filled_validates(tmp_path):
    f = tmp_path / "pd-benchmark-plan.yaml"
    f.write_text(_filled_tutorial_text())
    res = run_cli("kvbench.slo", "validate-plan", str(f))
    assert res.returncode == 0, res.stderr
    assert "equal budget: 2 GPUs each (aggregated 2 x TP1 x PP1 = 2; disaggregated prefill " \
           "1 x TP1 x PP1 + decode 1 x TP1 x PP1 = 2)" in res.stdout
    assert "cache states cold, warm (12 runs)" in res.stdout
    assert "(requests_meeting_all_limits / all_offered_after_warmup)" in res.stdout
    assert ("metrics client: ttft, tpot, itl, e2e, errors, goodput; scheduler: prefill_queue, "
            "decode_queue, running, rejected; kv_transfer: bytes, setup_ms, transfer_ms, failures") in res.stdout


def test_tutorial_template_is_refused_only_for_its_placeholders():
    res = run_cli("kvbench.slo", "validate-plan", str(TUTORIAL_TEMPLATE))
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "comparison.model_revision: placeholder '<hf-repo@commit>' not filled in (+28 more: " in res.stderr
    problems = kvbench.slo.benchplan.check_plan(yaml.safe_load(TUTORIAL_TEMPLATE.read_text()))[1]
    assert problems and all("placeholder" in str(p) for p in problems)


def test_tutorial_example_is_its_template_filled_in():
    def keys(d, prefix=""):
        return {prefix + k for k in d} | {x for k, v in d.items() if isinstance(v, dict)
                                          for x in keys(v, prefix + k + ".")}
    assert keys(yaml.safe_load(TUTORIAL_TEMPLATE.read_text())) == keys(tutorial())


def test_both_spellings_read_into_one_plan():
    from kvbench.slo.benchplan import load_benchmark_plan

    t, n = load_benchmark_plan(TUTORIAL), load_benchmark_plan(EXAMPLE)
    assert (t.form, n.form) == ("tutorial", "nested")
    assert t.deployment_specs == n.deployment_specs | {
        "aggregated": t.deployment_specs["aggregated"]}  # only the description differs
    assert t.deployment_specs["disaggregated"].roles == {"prefill": (1, 4, 1), "decode": (1, 4, 1)}
    assert t.criteria == n.criteria and t.gpus == n.gpus == {"aggregated": 8, "disaggregated": 8}
    assert t.cache_states == ("cold", "warm") and len(t.runs()) == 2 * 2 * 8
    assert t.runs()[0] == ("cold", "aggregated", 1.0) and t.runs()[-1] == ("warm", "disaggregated", 8.0)
    assert t.metrics["kv_transfer"] == ("bytes", "setup_ms", "transfer_ms", "failures")
    assert n.metrics == {"client": tuple(yaml.safe_load(EXAMPLE.read_text())["metrics"])}


TUTORIAL_REFUSALS = [
    ("deployments.disaggregated.decode_replicas", 2,
     "deployments: not equal-budget: aggregated uses 8 GPUs, disaggregated uses 12 (prefill 4 + decode 8), "
     "comparison.total_gpus is 8"),
    ("deployments.disaggregated.tensor_parallel_per_replica", 2,
     "deployments: not equal-budget: aggregated uses 8 GPUs, disaggregated uses 4 (prefill 2 + decode 2)"),
    ("deployments.disaggregated.prefill", {"replicas": 1, "tensor_parallel": 4, "pipeline_parallel": 1},
     "deployments.disaggregated: mixes the tutorial's keys (prefill_replicas, decode_replicas, "
     "tensor_parallel_per_replica, pipeline_parallel_per_replica) with the nested form (prefill)"),
    ("deployments.disaggregated.prefill_replica", 1,
     "deployments.disaggregated.prefill_replica: unknown key (did you mean 'prefill_replicas'?)"),
    ("deployments.disaggregated.decode_replicas", _DELETE, "deployments.disaggregated.decode_replicas: missing"),
    ("deployments.aggregated.descripton", "x", "unknown key (did you mean 'description'?)"),
    ("comparison.cache_state", ["cold", "cold"], "comparison.cache_state[1]: cache state 'cold' is listed twice"),
    ("comparison.cache_state", [], "comparison.cache_state: must be a cache state (text) or a non-empty list"),
    ("comparison.cache_state", ["cold", "<state>"], "comparison.cache_state[1]: placeholder '<state>'"),
    ("metrics.scheduler", ["prefill_queue", "queue"], "metrics.scheduler[1]: must be one of prefill_queue"),
    ("metrics.kv_transfers", ["bytes"], "metrics.kv_transfers: unknown metrics group (did you mean 'kv_transfer'?)"),
    ("acceptance.numerator", "successful_requests_meeting_all_latency_conditions",
     "acceptance.numerator: must be one of requests_meeting_all_limits, requests_meeting_ttft_and_tpot "
     "(or the synonym successful_requests_meeting_all_three_latency_conditions)"),
    ("deployments.aggregated.endpoint", "127.0.0.1:18000",
     "deployments.aggregated.endpoint: must be an http:// or https:// URL, got '127.0.0.1:18000'"),
    ("deployments.disaggregated.metrics_endpoints", {"decode": "ftp://x/metrics"},
     "deployments.disaggregated.metrics_endpoints.decode: must be an http:// or https:// URL"),
    ("lab", ["not", "a", "mapping"], "lab: must be a mapping (read by kvbench lab, not by kvbench slo)"),
]


@pytest.mark.parametrize("spelling, path, value, message",
                         [("nested", *c) for c in NESTED_REFUSALS] + [("tutorial", *c) for c in TUTORIAL_REFUSALS])
def test_bad_plans_are_refused_with_the_offending_path(tmp_path, capsys, spelling, path, value, message):
    """Both spellings keep every refusal: budget, placeholders, unknown/missing keys, types."""
    plan = copy.deepcopy(example() if spelling == "nested" else tutorial())
    _set(plan, path, value)
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(plan))
    rc, out, err = validate(capsys, f)
    assert rc == 2 and out == ""
    assert err.startswith(f"kvbench slo: error: {f}: ") and err.count("\n") == 1
    assert message in err


def test_tutorial_text_with_a_duplicated_key_is_refused(tmp_path, capsys):
    text = TUTORIAL.read_text().replace("    decode_replicas: 1\n", "    decode_replicas: 1\n    decode_replicas: 2\n")
    f = tmp_path / "plan.yaml"
    f.write_text(text)
    rc, _, err = validate(capsys, f)
    assert rc == 2 and "not valid YAML (duplicate key 'decode_replicas')" in err


def test_endpoints_and_lab_reach_the_plan(tmp_path):
    from kvbench.slo.benchplan import load_benchmark_plan

    plan = tutorial()
    plan["deployments"]["aggregated"].update(
        endpoint="http://127.0.0.1:18000", metrics_endpoints={"aggregated": ["http://127.0.0.1:18001/metrics",
                                                                             "http://127.0.0.1:18002/metrics"]})
    plan["deployments"]["disaggregated"].update(
        endpoint="http://127.0.0.1:18010",
        metrics_endpoints={"prefill": "http://127.0.0.1:18011/metrics", "decode": "http://127.0.0.1:18012/metrics"})
    plan["lab"] = {"model": "<lab decides>", "anything": [1, 2]}  # unread by slo, placeholders too
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(plan))
    p = load_benchmark_plan(f)
    agg, dis = p.deployment_specs["aggregated"], p.deployment_specs["disaggregated"]
    assert agg.endpoint == "http://127.0.0.1:18000"
    assert agg.metrics_endpoints == {"aggregated": ("http://127.0.0.1:18001/metrics",
                                                    "http://127.0.0.1:18002/metrics")}
    assert dis.metrics_endpoints == {"prefill": ("http://127.0.0.1:18011/metrics",),
                                     "decode": ("http://127.0.0.1:18012/metrics",)}
    assert p.lab == {"model": "<lab decides>", "anything": [1, 2]}
