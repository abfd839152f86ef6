"""Hostile files and flags given to `kvbench slo`: request records, the benchmark plan (YAML),
vLLM result files, the metrics scrape and its mapping file, analyze's bounded flags and its plot.

Each test plants the fault a hostile-input audit reported and checks what a user sees: exit 2,
exactly one line on stderr naming the file (and line) and the value, no traceback, and no
output file left behind. Commands run in-process (`tests.helpers.run`) for speed; the YAML
alias bomb runs as a user would (`python -m`) to prove the exit status there.
(Found by issue 15, lists A-D.)
"""

from __future__ import annotations

import json

import pytest
import yaml

import kvbench.model
import kvbench.plan.cli
import kvbench.slo.cli
from tests.conftest import ROOT, run_cli
from tests.helpers import (
    ANALYZE,
    HUGE,
    cohort_lines,
    deep,
    json_with,
    no_traceback,
    refused,
    run,
    vllm_result,
)

TUTORIAL_PLAN = ROOT / "examples" / "pd-benchmark-plan.yaml"


@pytest.mark.parametrize("key, raw, fragment", [
    ("end_ms", str(HUGE), "integer with 401 digits"),
    ("offered_rate_rps", str(HUGE), "integer with 401 digits"),
    ("output_tokens", str(HUGE), "integer with 401 digits"),
    ("output_tokens", "1e400", "number 1e400 is out of range"),
    ("meta", '{"a":' * 100_000 + "1" + "}" * 100_000, "JSON nested deeper than 64 levels"),
    ("offered_rate_rps", "true", "offered_rate_rps: must be a number, got True"),
    ("output_tokens", '"64"', "output_tokens: must be an integer, got '64'"),
    ("actual_send_ms", "Infinity", "Infinity is not a JSON number"),
])
def test_slo_records_malformed_values(tmp_path, key, raw, fragment):
    lines = cohort_lines()
    f = tmp_path / "records.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in lines[:5]) + json_with(lines[5], key, raw) + "\n")
    out = tmp_path / "report.json"
    refused(run(kvbench.slo.cli.cli, "analyze", f, *ANALYZE, "--out", out), f"{f}:6: ", fragment)
    assert not out.exists()


def test_slo_record_with_a_duplicated_key(tmp_path):
    f = tmp_path / "records.jsonl"
    line = json.dumps(cohort_lines()[0])
    f.write_text(line[:-1] + ', "status": "ok"}\n')
    refused(run(kvbench.slo.cli.cli, "analyze", f, *ANALYZE), f"{f}:1: duplicate key 'status'")


def plan_text(**replace_raw) -> str:
    text = TUTORIAL_PLAN.read_text()
    for old, new in replace_raw.items():
        assert old in text
        text = text.replace(old, new, 1)
    return text


@pytest.mark.parametrize("text, fragment", [
    (plan_text(**{"total_gpus: 8": "total_gpus: " + "9" * 5000}), "integer with 5000 digits"),
    (plan_text(**{"offered_rates_rps: [": f"offered_rates_rps: [{HUGE}, "}), "integer with 401 digits"),
    ("a: &a [*a]\n", "anchor &a: kvbench does not read YAML anchors"),
    ("? [1, 2]\n: 3\n", "a key must be a plain value, not a list or mapping"),
    ("a: " + deep(50_000) + "\n", "nested deeper than 64 levels"),
    (plan_text(**{"total_gpus: 8": "total_gpus: .inf"}), ".inf is not a finite number"),
    (plan_text(**{"total_gpus: 8": "total_gpus: true"}), "comparison.total_gpus: must be a positive integer, got True"),
    (plan_text(**{"total_gpus: 8": "total_gpus: 10000000"}), "comparison.total_gpus: must be at most 1,000,000"),
])
def test_plan_yaml_hostile(tmp_path, text, fragment):
    f = tmp_path / "plan.yaml"
    f.write_text(text)
    refused(run(kvbench.slo.cli.cli, "validate-plan", f), fragment)


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """The billion-laughs file: refused at its first anchor, before any expansion."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 30)]
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\n")
    res = run_cli("kvbench.slo", "validate-plan", str(f), timeout=30)
    refused((res.returncode, res.stdout, res.stderr), f"{f}:1: not valid YAML (anchor &a0")


@pytest.mark.parametrize("key, raw, fragment", [
    ("start_times", f"[{HUGE}, 1, 2, 3, 4, 5]", "integer with 401 digits"),
    ("itls", deep(100_000), "JSON nested deeper than 64 levels"),
    ("start_times", "[1e400, 1, 2, 3, 4, 5]", "start_times[0]: must be a finite number, got inf"),
    ("ttfts", '[0.25, "0.3", 0, 0, 0, 0.2]', "ttfts[1]: must be a number, got '0.3'"),
])
def test_vllm_result_hostile(tmp_path, key, raw, fragment):
    f = tmp_path / "vllm.json"
    f.write_text(json_with(vllm_result(), key, raw))
    out = tmp_path / "o.jsonl"
    refused(run(kvbench.slo.cli.cli, "convert-vllm", f, "--deployment", "aggregated", "--out", out), fragment)
    assert not out.exists()


def test_vllm_infinity_in_unread_fields_is_kept_out_of_the_records(tmp_path):
    """vLLM may write Infinity in fields kvbench does not read: converted, and no Infinity out."""
    f = tmp_path / "vllm.json"
    f.write_text(json_with(vllm_result(), "burstiness", "Infinity"))
    out = tmp_path / "o.jsonl"
    rc, _, err = run(kvbench.slo.cli.cli, "convert-vllm", f, "--deployment", "aggregated", "--out", out)
    assert rc == 0, err
    assert "Infinity" not in out.read_text() and "NaN" not in out.read_text()
    rc, _, err = run(kvbench.slo.cli.cli, "analyze", out, *ANALYZE)
    assert rc == 0, err


@pytest.mark.parametrize("flag, value", [("--ttft-max-ms", "inf"), ("--send-lag-max-ms", "inf"),
                                         ("--deadline-s", "1e306"), ("--tpot-max-ms", "nan"),
                                         ("--warmup-requests", "9" * 310), ("--duration-s", "-1")])
def test_analyze_flags_are_bounded(tmp_path, flag, value):
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
    out = tmp_path / "report.json"
    refused(run(kvbench.slo.cli.cli, "analyze", f, *ANALYZE, flag, value, "--out", out), f"argument {flag}")
    assert not out.exists()


def test_slo_plot_svg_is_svg_and_comes_with_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
    out, plot = tmp_path / "report.json", tmp_path / "plot.svg"
    rc, _, err = run(kvbench.slo.cli.cli, "analyze", f, *ANALYZE, "--out", out, "--plot", plot)
    assert rc == 0, err
    assert plot.read_bytes().lstrip().startswith(b"<?xml") and b"<svg" in plot.read_bytes()[:2000]
    assert json.loads(out.read_text())["schema"] == "kvbench.slo.report/1"
    refused(run(kvbench.slo.cli.cli, "analyze", f, *ANALYZE, "--plot", tmp_path / "p.gif"),
            "use a .png, .svg or .pdf file name")


def test_mapping_file_is_bounded(tmp_path):
    f = tmp_path / "map.yaml"
    f.write_text("engine: toy\nmetrics:\n  waiting: {name: q, kind: gauge, scale: .nan}\n")
    refused(run(kvbench.slo.cli.cli, "analyze", "--metrics", f, "--metrics-map", f), ".nan is not a finite number")
    f.write_text("engine: toy\nmetrics:\n  waiting: {name: q, kind: gauge, scale: -1}\n")
    m = tmp_path / "s.jsonl"
    m.write_text(json.dumps({"kind": "header", "schema": "kvbench.slo.metrics/1"}) + "\n")
    refused(run(kvbench.slo.cli.cli, "analyze", "--metrics", m, "--metrics-map", f), "metrics.waiting.scale: must be > 0")


def test_scrape_lines_are_typed(tmp_path):
    m = tmp_path / "s.jsonl"
    head = json.dumps({"kind": "header", "schema": "kvbench.slo.metrics/1"})
    m.write_text(head + "\n" + json.dumps({"kind": "sample", "role": "decode", "t_s": "1",
                                           "samples": {}}) + "\n")
    refused(run(kvbench.slo.cli.cli, "analyze", "--metrics", m), f"{m}:2: t_s: must be a number, got '1'")
    m.write_text(head + "\n" + json.dumps({"kind": "sample", "role": "decode", "t_s": 1.0,
                                           "samples": {"x": [[{"le": "1"}, "7"]]}}) + "\n")
    refused(run(kvbench.slo.cli.cli, "analyze", "--metrics", m), "a sample value must be a number")


def test_plan_yaml_and_config_file_size_limits(tmp_path):
    f = tmp_path / "plan.yaml"
    f.write_text("# " + "x" * (2 * 2**20) + "\n")
    refused(run(kvbench.slo.cli.cli, "validate-plan", f), "larger than 1 MiB")
    assert yaml.safe_load(TUTORIAL_PLAN.read_text())  # the real plan is far below the limit


# what kvbench writes, kvbench reads (issue 25, group 11)


def test_plan_rates_closer_than_the_matching_tolerance_are_refused(tmp_path):
    """Group 11: rates 1e-13 apart validated, then one was analysed and the other 'untested'."""
    plan = yaml.safe_load((ROOT / "examples" / "pd-benchmark-plan.yaml").read_text())
    plan["comparison"]["offered_rates_rps"] = [1.0, 1.0 + 1e-13, 2.0]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    err = no_traceback(run(kvbench.slo.cli.cli, "validate-plan", tmp_path / "p.yaml"), codes=(2,))
    assert "is the same rate as 1.0" in err


@pytest.mark.parametrize("argv", [
    ("cohort",),
    ("sweep", "--rates", "0.000001", "--duration-s", "10000000"),
    ("sweep", "--rates", "1000000", "--duration-s", "0.005"),
    ("sweep", "--rates", "1,50", "--duration-s", "20", "--warmup-requests", "0"),
])
def test_what_slo_synth_writes_slo_analyze_accepts(tmp_path, argv):
    out = tmp_path / "s.jsonl"
    rc, _, err = run(kvbench.slo.cli.cli, "synth", *argv, "--out", out)
    assert rc == 0, err
    rc, _, err = run(kvbench.slo.cli.cli, "analyze", out, "--ttft-max-ms", "2000", "--tpot-max-ms", "50",
                     "--denominator", "successful", "--attainment-min", "0.9", "--format", "json")
    assert rc == 0, err
