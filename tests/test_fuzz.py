"""Fuzz every reader kvbench owns and every bounded numeric flag (hypothesis, deterministic).

Each example takes a valid input, mutates it the way a hostile tester would (a value
swapped for NaN, an infinity, a 10^400 or 5,000-digit integer, a denormal, a negative, a
string or bool where a number was, 500-deep nesting, a deleted or unknown key, a key given
twice, the text cut short) and runs the real command in-process. The property: the command
either succeeds with a finite output file, or exits 2 with exactly one line on stderr, no
traceback and no output file. An exception escaping the command fails the test (that is
the traceback case). `derandomize=True` makes every CI run try the same examples; the
example counts keep the whole module at about a minute on 2 cores.
"""

from __future__ import annotations

import functools
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbench.fit.cli
import kvbench.lab.faults.main
import kvbench.lab.sweep.main
import kvbench.model
import kvbench.plan.cli
import kvbench.report.cli
import kvbench.slo.cli
from kvbench.cli import UsageError
from tests.conftest import ROOT
from tests.fuzzing import (
    FUZZ,
    HOSTILE,
    check,
    mutate,
    mutated_jsonl,
    mutation,
    workdir,
)
from tests.helpers import ANALYZE, LLAMA, cohort_lines, run, vllm_result

# ---------------------------------------------------------------------------
# one test per reader


@FUZZ
@given(st.data())
def test_fuzz_hf_config(data):
    d = workdir()
    text, must = mutate({**LLAMA, "rope_scaling": {"factor": 8.0, "type": "llama3"}},
                        data.draw(mutation(LLAMA)), "json")
    (d / "config.json").write_text(text)
    out = d / "out.json"
    check(run(kvbench.model.cli, "--model-config", d / "config.json", "--out", out), out, must)


@FUZZ
@given(st.data())
def test_fuzz_plan_yaml(data):
    plan = yaml.safe_load((ROOT / "examples" / "pd-benchmark-plan.yaml").read_text())
    d = workdir()
    text, must = mutate(plan, data.draw(mutation(plan)), "yaml")
    (d / "plan.yaml").write_text(text)
    check(run(kvbench.slo.cli.cli, "validate-plan", d / "plan.yaml"), None, must)


@FUZZ
@given(st.data(), st.integers(0, 99))
def test_fuzz_request_records(data, line):
    d = workdir()
    must = mutated_jsonl(data, cohort_lines(), line, d / "r.jsonl")
    out = d / "report.json"
    check(run(kvbench.slo.cli.cli, "analyze", d / "r.jsonl", *ANALYZE, "--out", out), out, must)


@FUZZ
@given(st.data())
def test_fuzz_vllm_result(data):
    doc = vllm_result()
    d = workdir()
    m = data.draw(mutation(doc))
    text, must = mutate(doc, m, "json")
    (d / "v.json").write_text(text)
    out = d / "o.jsonl"
    result = run(kvbench.slo.cli.cli, "convert-vllm", d / "v.json", "--deployment", "agg", "--out", out)
    # vLLM writes NaN and Infinity itself, so its file is read with non-finite floats kept
    # (1e400 is one too): refused where kvbench reads the value, kept in a key it does not
    # (check() still proves none reaches the output). Huge integers and deep nesting are
    # refused anywhere.
    non_finite = m[0] == "hostile" and HOSTILE[m[2]][0] in ("NaN", "Infinity", "-Infinity", "1e400")
    check(result, out, must and not non_finite and "NaN" not in text and "Infinity" not in text)


def scrape_lines() -> list[dict]:
    from kvbench.slo.scrape import parse_metrics_text

    samples = parse_metrics_text((ROOT / "tests/data/metrics/vllm-0.32.0-decode.txt").read_text(),
                                 lambda name: name.startswith("vllm:num_requests"))
    head = {"kind": "header", "schema": "kvbench.slo.metrics/1", "endpoints": [], "interval_s": 1.0}
    body = [{"kind": "sample", "role": "decode", "url": "http://127.0.0.1:18012/metrics",
             "t_s": float(i), "elapsed_ms": 1.0, "samples": samples} for i in range(10)]
    return [head, *body, {"kind": "end", "t_s": 10.0, "scrapes": 10, "gaps": 0, "interrupted": False}]


@FUZZ
@given(st.data(), st.integers(0, 11))
def test_fuzz_scrape_file(data, line):
    d = workdir()
    must = mutated_jsonl(data, scrape_lines(), line, d / "s.jsonl")
    out = d / "report.json"
    check(run(kvbench.slo.cli.cli, "analyze", "--metrics", d / "s.jsonl", "--out", out), out, must)


@FUZZ
@given(st.data())
def test_fuzz_mapping_file(data):
    doc = {"engine": "toy", "metrics": {"waiting": {"name": "vllm:num_requests_waiting", "kind": "gauge"},
                                        "xfer_time": {"name": "toy:xfer", "kind": "histogram", "scale": 0.001}}}
    d = workdir()
    text, must = mutate(doc, data.draw(mutation(doc)), "yaml")
    (d / "map.yaml").write_text(text)
    (d / "s.jsonl").write_text("\n".join(json.dumps(x) for x in scrape_lines()) + "\n")
    out = d / "report.json"
    check(run(kvbench.slo.cli.cli, "analyze", "--metrics", d / "s.jsonl", "--metrics-map", d / "map.yaml",
              "--out", out), out, must)


@FUZZ
@given(st.data())
def test_fuzz_fit_document_and_p2p_record(data):
    """The models fit/plan adopt later: a mutated file is read or refused in one line."""
    from kvbench.records.schema.fit import load_fit_document
    from kvbench.records.schema.p2p import iter_p2p_records

    d = workdir()
    fit = json.loads((ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json").read_text())
    rec = json.loads((ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl").read_text().splitlines()[0])
    for name, doc, read in (("f.json", fit, load_fit_document),
                            ("r.jsonl", rec, lambda p: list(iter_p2p_records([p])))):
        text, must = mutate(doc, data.draw(mutation(doc)), "json")
        (d / name).write_text(text if name.endswith(".json") else text.replace("\n", " ") + "\n")
        try:
            read(d / name)
        except UsageError as exc:
            assert "\n" not in str(exc)
        else:
            assert not must


# ---------------------------------------------------------------------------
# the unmutated inputs: a reader that refuses everything would pass every fuzz test above
# (exit 2 with one line is always allowed), so each valid input must be accepted, and a
# planted refuse-everything reader must make this check fail


@functools.cache
def _cohort_text() -> str:
    """The valid request records, built once: their writer validates through the contract, so
    they are built before a plant makes every typed model refuse."""
    return "".join(json.dumps(x) + "\n" for x in cohort_lines())


def _valid_runs() -> dict:
    """name -> fn(folder) running the reader's command on its unmutated valid input."""
    def hf(d):
        (d / "config.json").write_text(json.dumps({**LLAMA, "rope_scaling": {"factor": 8.0, "type": "llama3"}}))
        return run(kvbench.model.cli, "--model-config", d / "config.json", "--out", d / "o.json")

    def plan(d):
        return run(kvbench.slo.cli.cli, "validate-plan", ROOT / "examples" / "pd-benchmark-plan.yaml")

    def records(d):
        (d / "r.jsonl").write_text(_cohort_text())
        return run(kvbench.slo.cli.cli, "analyze", d / "r.jsonl", *ANALYZE, "--out", d / "o.json")

    def vllm(d):
        (d / "v.json").write_text(json.dumps(vllm_result()))
        return run(kvbench.slo.cli.cli, "convert-vllm", d / "v.json", "--deployment", "agg", "--out", d / "o.jsonl")

    def scrape(d):
        (d / "s.jsonl").write_text("\n".join(json.dumps(x) for x in scrape_lines()) + "\n")
        return run(kvbench.slo.cli.cli, "analyze", "--metrics", d / "s.jsonl", "--out", d / "o.json")

    def fit_and_p2p(d):
        src = ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z"
        return run(kvbench.plan.cli.cli, "--fit", f"{src}.fit.json", "--prompt-tokens", "1000") if \
            run(kvbench.fit.cli.cli, f"{src}.jsonl", "--out", d / "f.json", "--bootstrap", "100")[0] == 0 \
            else (2, "", "fit refused its valid input")

    return {"hf_config": hf, "plan_yaml": plan, "request_records": records, "vllm_result": vllm,
            "scrape_file": scrape, "fit_and_p2p": fit_and_p2p}


def accepted(name: str) -> None:
    rc, _, err = _valid_runs()[name](workdir())
    assert rc == 0, f"{name}: the unmutated valid input was refused: {err[-500:]}"


@pytest.mark.parametrize("name", list(_valid_runs()))
def test_unmutated_valid_inputs_are_accepted(name):
    accepted(name)


@pytest.mark.parametrize("name", list(_valid_runs()))
def test_a_reader_that_refuses_everything_fails_the_acceptance_check(name, monkeypatch):
    """The plant: every typed model refuses every value (as a broken reader would, in one line)."""
    from pydantic import BaseModel, TypeAdapter

    def refuse(owner, *args, **kwargs):
        raise UsageError("planted: a reader that refuses everything")

    _cohort_text()  # the inputs exist before the plant; only the reader is planted
    monkeypatch.setattr(BaseModel, "model_validate", classmethod(refuse))
    monkeypatch.setattr(BaseModel, "model_validate_json", classmethod(refuse))
    monkeypatch.setattr(TypeAdapter, "validate_python", refuse)
    with pytest.raises(AssertionError, match="the unmutated valid input was refused"):
        accepted(name)


# ---------------------------------------------------------------------------
# numeric flags

FLAG_VALUES = ["nan", "inf", "-inf", "1e-320", "1e400", "9" * 310, "", " ", "-1", "0", "0x10",
               "1_000", "１２", "1e306", "3.5", "-0", "+7", "1e9", "12abc"]
FLAGS = [
    (kvbench.model.cli, (), "--prompt-tokens"), (kvbench.model.cli, (), "--links-gbps"),
    (kvbench.model.cli, (), "--setup-ms"), (kvbench.model.cli, (), "--budget-ms"),
    (kvbench.model.cli, (), "--tp"), (kvbench.model.cli, (), "--block-size"),
    (kvbench.model.cli, (), "--short-prompt-tokens"),
    *[(kvbench.slo.cli.cli, ("analyze", "RECORDS", *ANALYZE), f) for f in
      ("--deadline-s", "--max-itl-ms", "--send-lag-max-ms", "--duration-s", "--warmup-requests",
       "--min-tokens-for-tpot")],
    (kvbench.slo.cli.cli, ("synth", "sweep", "--duration-s", "1"), "--rates"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1"), "--duration-s"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1", "--duration-s", "1"), "--warmup-requests"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1", "--duration-s", "1"), "--seed"),
    # (issue 25) flags that were raw int(): the folder or plan does not exist, so an accepted
    # value ends in "no such ..." (exit 2) before any work; a hostile one must be refused first
    (kvbench.report.cli.cli, ("/nonexistent-kvbench-folder",), "--bootstrap"),
    (kvbench.lab.sweep.main.cli, ("/nonexistent-kvbench-plan.yaml",), "--repeats"),
    (kvbench.lab.faults.main.cli, ("/nonexistent-kvbench-plan.yaml",), "--requests"),
    (kvbench.fit.cli.cli, (str(ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl"),), "--bootstrap"),
]


@pytest.fixture(scope="module")
def records_file():
    d = workdir()
    (d / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
    return d / "r.jsonl"


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(range(len(FLAGS))), st.sampled_from(FLAG_VALUES))
def test_fuzz_numeric_flags(records_file, which, value):
    cli, base, flag = FLAGS[which]
    d = workdir()
    out = d / ("o.jsonl" if "synth" in base else "o.json")
    argv = [str(records_file) if a == "RECORDS" else a for a in base]
    rc, stdout, err = run(cli, *argv, flag, value, "--out", out)
    must = value in ("nan", "inf", "-inf", "1e-320", "1e400", "9" * 310, "", " ", "１２", "12abc")
    check((rc, stdout, err), out, must)
    if must:  # refused by the flag parser itself, not later by a missing file
        assert f"argument {flag}" in err or flag in err, err
    if rc == 0:
        assert "NaN" not in stdout and "Infinity" not in stdout


@FUZZ
@given(st.data(), st.integers(0, 99))
def test_fast_record_path_never_accepts_what_the_careful_one_refuses(data, line):
    """A line the fast (pydantic JSON) path accepts is accepted, equal, by the careful path."""
    from kvbench.records.schema.read import decode_line
    from kvbench.records.schema.slo import RequestIn
    from kvbench.records.schema.types import parse, parse_line_fast

    lines = cohort_lines()
    text, _ = mutate(lines[line], data.draw(mutation(lines[line])), "json")
    raw = text.replace("\n", " ").encode()
    fast = parse_line_fast(RequestIn, raw)
    if fast is not None:
        assert fast == parse(RequestIn, decode_line(raw, "w"), "w")


@FUZZ
@given(st.data(), st.booleans())
def test_fuzz_fit_document_through_plan_and_report(data, bare_draws):
    """(issue 25) A mutated fit document, its draws in either schema form, through the commands
    that read fits: plan, plan route (via plan) and report. Read, or refused in one line."""
    import kvbench.report.cli

    d = workdir()
    doc = json.loads((ROOT / "tests/data/runs/fit-example/kvbench-p2p-20261203T140056Z-7a0e16.fit.json").read_text())
    if bare_draws:
        doc["groups"][0]["draws"] = doc["groups"][0]["draws"]["values"]
    doc["groups"][0]["draws"] = {"columns": ["setup_ms", "ms_per_gb"], "values": [
        v for v in (doc["groups"][0]["draws"]["values"] if isinstance(doc["groups"][0]["draws"], dict)
                    else doc["groups"][0]["draws"])][:50]} if not bare_draws else doc["groups"][0]["draws"][:50]
    text, must = mutate(doc, data.draw(mutation(doc)), "json")
    (d / "f.fit.json").write_text(text)
    check(run(kvbench.plan.cli.cli, "--fit", d / "f.fit.json", "--prompt-tokens", "1000"), None, must)
    check(run(kvbench.report.cli.cli, d, "--out", d / "rep", "--quiet", "--no-refit"), None, must,
          json_out=False)
