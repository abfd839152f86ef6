"""Hostile input (issue 15, lists A-D): each case is one stderr line and its exit status.

Every test plants the fault the issue reported and checks the outcome a user sees: exit 2
(bad input or bad path) or 3 (I/O failure), exactly one line on stderr, no traceback, and
no output file left behind. Commands run in-process (`cli(argv)`) for speed; a few run as
a user would (`python -m`) to prove the exit status and the absence of a traceback there.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest
import yaml

import kvbench.model
import kvbench.plan.cli
import kvbench.slo.cli
from kvbench.cli import UsageError
from kvbench.records.write import (
    check_destination,
    fresh_stem,
    write_files,
    write_new_file,
    write_records,
)
from tests.conftest import ROOT, committed, run_cli
from tests.helpers import (
    ANALYZE,
    HUGE,
    LLAMA,
    cohort_lines,
    deep,
    json_with,
    refused,
    run,
    vllm_result,
)

TUTORIAL_PLAN = ROOT / "examples" / "pd-benchmark-plan.yaml"


# ---------------------------------------------------------------------------
# A. malformed values inside files


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "sliding_window",
                                 "max_window_layers", "num_hidden_layers"])
@pytest.mark.parametrize("raw, fragment", [
    ('"4096"', "must be an integer, got '4096'"),
    ("NaN", "NaN is not a JSON number"),
    (str(HUGE), "integer with 401 digits (kvbench reads at most 20)"),
    ("9" * 5000, "integer with 5000 digits"),
    (deep(200_000), "JSON nested deeper than 64 levels"),
    ("true", "must be an integer, got True"),
])
def test_hf_config_malformed_values(tmp_path, key, raw, fragment):
    cfg = tmp_path / "config.json"
    cfg.write_text(json_with(LLAMA, key, raw))
    err = refused(run(kvbench.model.cli, "--model-config", cfg), str(cfg))
    assert fragment in err


@pytest.mark.parametrize("patch, fragment", [
    ({"sliding_window": -5}, "sliding_window: must be >= 0, got -5"),
    ({"num_key_value_heads": 7}, "num_key_value_heads 7 does not divide num_attention_heads 32"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers: must be <= 10000, got 1000000000"),
    ({"layer_types": ["full_attention"] * 3, "sliding_window": 4096}, "layer_types has 3 entries for 32 layers"),
    ({"hidden_size": 4095, "num_key_value_heads": 32}, "hidden_size 4095 is not a positive multiple"),
])
def test_hf_config_inconsistent_geometry(tmp_path, patch, fragment):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, **patch}))
    refused(run(kvbench.model.cli, "--model-config", cfg), fragment)


def test_hf_config_through_plan_and_as_a_user_runs_it(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json_with(LLAMA, "hidden_size", str(HUGE)))
    refused(run(kvbench.plan.cli.cli, "--model-config", cfg, "--gbps", "10", "--setup-ms", "1",
                "--prompt-tokens", "100"), "integer with 401 digits")
    res = run_cli("kvbench.model", "--model-config", str(cfg))
    refused((res.returncode, res.stdout, res.stderr), "integer with 401 digits")


def test_hf_config_valid_still_sizes_the_kv(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    rc, out, _ = run(kvbench.model.cli, "--model-config", cfg, "--prompt-tokens", "1000")
    assert rc == 0 and json.loads(out)[0]["kv_bytes"] == 2 * 32 * 8 * 128 * 2 * 1000


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


def test_p2p_record_and_fit_document_models():
    """The models fit/plan/results adopt later: the issue's record and fit-file cases."""
    from kvbench.records.schema.fit import FitDocument
    from kvbench.records.schema.p2p import P2PRecord
    from kvbench.records.schema.types import parse

    rec = json.loads(committed("tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl").read_text().splitlines()[0])
    parse(P2PRecord, rec, "r.jsonl:1")
    for patch, fragment in [({"bytes": 1e20}, "bytes: must be an integer"),
                            ({"bytes": 2**60}, "bytes: must be <= 9007199254740991"),
                            ({"prompt_tokens": [300]}, "prompt_tokens: must be an integer"),
                            ({"prompt_tokens": "300"}, "prompt_tokens: must be an integer, got '300'"),
                            ({"samples_ms": [1.0, -2.0]}, "samples_ms[1]: must be >= 0"),
                            ({"n_samples": 3}, "n_samples is 3 but samples_ms holds 30")]:
        with pytest.raises(UsageError, match=None) as exc:
            parse(P2PRecord, {**rec, **patch}, "r.jsonl:1")
        assert fragment in str(exc.value)
    fit = json.loads(committed("tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json").read_text())
    parse(FitDocument, fit, "f.json")
    g = fit["groups"][0]
    for gpatch, fragment in [(None, "groups[0]: must be an object, got 1"),
                             ({"setup_ms": "7"}, "groups[0].setup_ms: must be a number, got '7'"),
                             ({"warnings": [1]}, "groups[0].warnings[0]: must be an object"),
                             ({"sizes": []}, "groups[0].sizes: must have at least 1 entries"),
                             ({"setup_ms_ci95": [1.0]}, "groups[0].setup_ms_ci95: must have at least 2"),
                             ({"two_regimes": {**(g["two_regimes"] or {}), "break_bytes": "1M"}},
                              "groups[0].two_regimes.break_bytes: must be an integer"),
                             ({"effective_gb_s": True}, "groups[0].effective_gb_s: must be a number, got True"),
                             ({"effective_gb_s_ci95": [2.0, 1.0]}, "lower end above its upper end")]:
        doc = copy.deepcopy(fit)
        doc["groups"] = [1] if gpatch is None else [{**g, **gpatch}]
        with pytest.raises(UsageError) as exc:
            parse(FitDocument, doc, "f.json")
        assert fragment in str(exc.value)


# ---------------------------------------------------------------------------
# B. infinity, NaN, denormals and huge numbers on the command line


@pytest.mark.parametrize("cli, argv, fragment", [
    (kvbench.model.cli, ("--setup-ms", "inf"), "--setup-ms must be a non-negative number"),
    (kvbench.model.cli, ("--links-gbps", "1e-320"), "--links-gbps must be positive numbers (>= 1e-06"),
    (kvbench.model.cli, ("--prompt-tokens", "9" * 310), "--prompt-tokens must be positive integers"),
    (kvbench.model.cli, ("--prompt-tokens", ""), "--prompt-tokens: empty list"),
    (kvbench.model.cli, ("--budget-ms", "nan"), "--budget-ms must be positive numbers"),
    (kvbench.model.cli, ("--prompt-tokens", "999999999", "--model", "deepseek-v3"), None),
    (kvbench.plan.cli.cli, ("--gbps", "1e-320", "--setup-ms", "1", "--prompt-tokens", "300"), "--gbps must be positive"),
    (kvbench.plan.cli.cli, ("--gbps", "10", "--setup-ms", "inf", "--prompt-tokens", "300"), "--setup-ms must be"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--duration-s", "inf", "--out", "x"), "argument --duration-s"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1e9", "--out", "x"), "--rates must be positive numbers"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1000", "--duration-s", "100000", "--out", "x"),
     "synth writes at most 2,000,000"),
])
def test_numeric_flags_are_bounded(tmp_path, monkeypatch, cli, argv, fragment):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(cli, *argv)
    if fragment is None:  # bounded but valid: a correct, finite result
        assert rc == 0 and "Infinity" not in out and "NaN" not in out, err
        return
    refused((rc, out, err), fragment)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flag, value", [("--ttft-max-ms", "inf"), ("--send-lag-max-ms", "inf"),
                                         ("--deadline-s", "1e306"), ("--tpot-max-ms", "nan"),
                                         ("--warmup-requests", "9" * 310), ("--duration-s", "-1")])
def test_analyze_flags_are_bounded(tmp_path, flag, value):
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
    out = tmp_path / "report.json"
    refused(run(kvbench.slo.cli.cli, "analyze", f, *ANALYZE, flag, value, "--out", out), f"argument {flag}")
    assert not out.exists()


# ---------------------------------------------------------------------------
# C. output paths and the one writer


def test_out_under_a_regular_file_and_under_proc(tmp_path):
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "file" / "r.json", Path("/proc/kvbench-test/r.json")):
        refused(run(kvbench.model.cli, "--out", target), "cannot write into")
    with pytest.raises(UsageError, match="not a directory"):
        check_destination(tmp_path / "file")


def test_group_commit_removes_what_it_linked(tmp_path):
    (tmp_path / "b.csv").write_text("existing")
    with pytest.raises(UsageError, match="refusing to overwrite existing file"):
        write_files([(tmp_path / "a.jsonl", "1\n"), (tmp_path / "b.csv", "2\n")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.csv"]  # a.jsonl unlinked, no temps
    assert (tmp_path / "b.csv").read_text() == "existing"


def test_non_finite_numbers_are_never_written(tmp_path):
    with pytest.raises(UsageError, match=r"non-finite number at groups\[0\].setup_ms"):
        write_records(tmp_path, [{"groups": [{"setup_ms": float("inf")}]}], "x")
    assert list(tmp_path.iterdir()) == []


def _write_one(args):
    out_dir, i = args
    return [str(p) for p in write_records(Path(out_dir), [{"writer": i}], "kvbench-p2p")]


def test_six_concurrent_writers_in_one_second_get_six_names(tmp_path):
    with multiprocessing.get_context("fork").Pool(6) as pool:
        paths = pool.map(_write_one, [(str(tmp_path), i) for i in range(6)])
    names = {p for pair in paths for p in pair}
    assert len(names) == 12 and len(list(tmp_path.iterdir())) == 12
    assert sorted(json.loads(Path(p[0]).read_text())["writer"] for p in paths) == list(range(6))
    stem = fresh_stem(tmp_path, "kvbench-p2p", (".jsonl",))
    assert not stem.with_name(stem.name + ".jsonl").exists()


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


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 64 KiB tmpfs (root only): writing more than it holds fails with ENOSPC."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.root
def test_full_disk_is_exit_3_and_leaves_nothing(tiny_fs):
    big = "x" * 200_000
    with pytest.raises(UsageError) as exc:
        write_files([(tiny_fs / "a.jsonl", "small\n"), (tiny_fs / "b.csv", big)])
    assert exc.value.exit_code == 3 and "No space left on device" in str(exc.value)
    assert list(tiny_fs.iterdir()) == []
    f = tiny_fs / "cohort.jsonl"
    assert run(kvbench.slo.cli.cli, "synth", "sweep", "--rates", "1,2", "--duration-s", "60", "--out", f)[0] == 3
    assert list(tiny_fs.iterdir()) == []


def test_write_new_file_keeps_its_contract(tmp_path):
    p = write_new_file(tmp_path / "x.json", "1")
    with pytest.raises(UsageError, match="refusing to overwrite"):
        write_new_file(p, "2")
    assert p.read_text() == "1" and list(tmp_path.iterdir()) == [p]


# ---------------------------------------------------------------------------
# D. unbounded work on bad input


def test_huge_model_is_refused_before_any_sizing(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, "num_hidden_layers": 10_000, "head_dim": 2**20,
                               "num_key_value_heads": 32}))
    refused(run(kvbench.model.cli, "--model-config", cfg, "--prompt-tokens", "1000000000"),
            "more than 2^53 B")


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
