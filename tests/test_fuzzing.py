"""The fuzz property is not vacuous (tests/fuzzing.py): a reader that refuses everything would
pass every fuzz test (exit 2 with one line is always allowed), so each reader's unmutated
valid input must be accepted, and a planted refuse-everything reader must make that check fail.
"""

from __future__ import annotations

import functools
import json

import pytest

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
    workdir,
)
from tests.helpers import ANALYZE, LLAMA, cohort_lines, run, vllm_result
from tests.slo.helpers import scrape_lines


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
