"""Hostile variants of the AIPerf and GuideLLM exports through `kvbench slo convert` (hypothesis).

The same property and mutations as tests/fuzzing.py (a value swapped for NaN, 1e400, a
5,000-digit integer, a string or bool where a number was, deep nesting, a deleted or unknown
key, a duplicated key, the text cut short), applied to the committed real runs: the command
either writes finite records, or exits 2 with one line on stderr, no traceback, no file.
Plus hand-picked huge-but-finite values that only the typed models can refuse.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvbench.slo.cli
from tests.conftest import ROOT
from tests.fuzzing import (
    FUZZ,
    check,
    mutate,
    mutated_jsonl,
    mutation,
    workdir,
)
from tests.helpers import run

CLIENTS = ROOT / "tests" / "data" / "clients"
AIPERF = CLIENTS / "aiperf-0.13.0"
GUIDELLM = CLIENTS / "guidellm-0.8.1" / "benchmarks.json"


def aiperf_lines(n: int = 4) -> list[dict]:
    return [json.loads(x) for x in (AIPERF / "profile_export.jsonl").read_text().splitlines()[:n]]


def small_guidellm(n: int = 3) -> dict:
    """The real report with its first n requests (totals adjusted), so each example is quick."""
    doc = json.loads(GUIDELLM.read_text())
    b = doc["benchmarks"][0]
    b["requests"]["successful"] = b["requests"]["successful"][:n]
    b["metrics"] = {"request_totals": {**b["metrics"]["request_totals"], "successful": n, "total": n}}
    b["config"] = {k: b["config"][k] for k in ("strategy", "sample_size")}
    for r in b["requests"]["successful"]:
        r["request_args"] = r["output"] = None
    return doc


def convert(tool: str, src, out) -> tuple[int, str, str]:
    return run(kvbench.slo.cli.cli, "convert", "--from", tool, src, "--deployment", "d", "--out", out)


@FUZZ
@given(st.data(), st.integers(0, 3))
def test_fuzz_aiperf_records(data, line):
    d = workdir()
    must = mutated_jsonl(data, aiperf_lines(), line, d / "profile_export.jsonl")
    shutil.copy(AIPERF / "profile_export_aiperf.json", d)
    out = d / "o.jsonl"
    check(convert("aiperf", d, out), out, must)


@FUZZ
@given(st.data())
def test_fuzz_aiperf_summary(data):
    d = workdir()
    doc = {"aiperf_version": "0.13.0", "input_config": json.loads(
        (AIPERF / "profile_export_aiperf.json").read_text())["input_config"]}
    text, must = mutate(doc, data.draw(mutation(doc)), "json")
    (d / "profile_export_aiperf.json").write_text(text)
    (d / "profile_export.jsonl").write_text("".join(json.dumps(x) + "\n" for x in aiperf_lines(2)))
    out = d / "o.jsonl"
    check(convert("aiperf", d / "profile_export.jsonl", out), out, must)


@FUZZ
@given(st.data())
def test_fuzz_guidellm_report(data):
    doc = small_guidellm()
    d = workdir()
    text, must = mutate(doc, data.draw(mutation(doc)), "json")
    (d / "benchmarks.json").write_text(text)
    out = d / "o.jsonl"
    check(convert("guidellm", d / "benchmarks.json", out), out, must)


def _set(doc, path: str, value) -> None:
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    for k in keys[:-1]:
        doc = doc[k]
    doc[keys[-1]] = value


@pytest.mark.parametrize("path, value, fragment", [
    ("metadata.request_start_ns", 10**19 + 1, "request_start_ns"),
    ("metadata.request_start_ns", -5, "request_start_ns"),
    ("metadata.request_start_ns", 1.5e18, "request_start_ns"),  # a float where AIPerf writes int ns
    ("metrics.time_to_first_token.value", 1e300, "time_to_first_token"),
    ("metrics.time_to_first_token.unit", "furlongs", "expected a time unit"),
    ("metrics.inter_chunk_latency.value", "fast", "inter_chunk_latency"),
    ("metrics.usage_completion_tokens.value", 1e12, "usage_completion_tokens"),
    ("metrics.usage_completion_tokens.value", 3.5, "whole number of tokens"),
    ("metadata.benchmark_phase", 7, "benchmark_phase"),
    ("error", "boom", "error"),
])
def test_aiperf_wrong_types_and_huge_values(tmp_path, path, value, fragment):
    lines = aiperf_lines(3)
    _set(lines[1], path, value)
    (tmp_path / "profile_export.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.jsonl"
    rc, _, err = run(kvbench.slo.cli.cli, "convert", "--from", "aiperf", tmp_path, "--deployment", "d",
                     "--offered-rate", "2", "--out", out)
    assert rc == 2 and err.count("\n") == 1 and fragment in err and ":2" in err, err
    assert not out.exists()


def test_aiperf_missing_fields_and_files(tmp_path):
    lines = aiperf_lines(2)
    del lines[0]["metadata"]["request_start_ns"]
    (tmp_path / "profile_export.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, _, err = run(kvbench.slo.cli.cli, "convert", "--from", "aiperf", tmp_path, "--deployment", "d",
                     "--offered-rate", "2")
    assert rc == 2 and "request_start_ns" in err and err.count("\n") == 1
    rc, _, err = run(kvbench.slo.cli.cli, "convert", "--from", "aiperf", tmp_path / "empty", "--deployment", "d")
    assert rc == 2 and "no such file" in err and err.count("\n") == 1
    (tmp_path / "sub").mkdir()
    rc, _, err = run(kvbench.slo.cli.cli, "convert", "--from", "aiperf", tmp_path / "sub", "--deployment", "d")
    assert rc == 2 and "no profile_export.jsonl in this folder" in err


@pytest.mark.parametrize("path, value, fragment", [
    ("benchmarks.0.requests.successful.0.info.timings.request_start", 1e300, "request_start"),
    ("benchmarks.0.requests.successful.0.info.timings.first_token_iteration", "soon", "first_token_iteration"),
    ("benchmarks.0.requests.successful.0.output_tokens", 10**11, "output_tokens"),
    ("benchmarks.0.requests.successful.0.info.timings.token_iterations", -1, "token_iterations"),
    ("benchmarks.0.config.strategy.rate", 1e9, "rate"),
    ("benchmarks.0.requests.successful", {"a": 1}, "successful"),
    ("benchmarks", [], "benchmarks"),
])
def test_guidellm_wrong_types_and_huge_values(tmp_path, path, value, fragment):
    doc = copy.deepcopy(small_guidellm())
    _set(doc, path, value)
    src = tmp_path / "benchmarks.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "o.jsonl"
    rc, _, err = convert("guidellm", src, out)
    assert rc == 2 and err.count("\n") == 1 and fragment in err, err
    assert not out.exists()


def test_guidellm_first_token_before_send_is_refused(tmp_path):
    doc = small_guidellm()
    t = doc["benchmarks"][0]["requests"]["successful"][1]["info"]["timings"]
    t["first_token_iteration"] = t["request_start"] - 1.0
    src = tmp_path / "benchmarks.json"
    src.write_text(json.dumps(doc))
    rc, _, err = convert("guidellm", src, tmp_path / "o.jsonl")
    assert rc == 2 and "before the send" in err and err.count("\n") == 1
