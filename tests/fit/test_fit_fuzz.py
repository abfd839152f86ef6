"""Fuzz fit documents and p2p records (hypothesis, deterministic): through their typed models,
and a mutated fit document, its draws in either schema form, through the commands that read
fits (plan and report). Read, or refused in one line; never a traceback.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

import kvbench.fit.cli
import kvbench.lab.faults.main
import kvbench.lab.sweep.main
import kvbench.model
import kvbench.plan.cli
import kvbench.report.cli
from kvbench.cli import UsageError
from tests.conftest import ROOT
from tests.fuzzing import (
    FUZZ,
    check,
    mutate,
    mutation,
    workdir,
)
from tests.helpers import run


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


@FUZZ
@given(st.data(), st.booleans())
def test_fuzz_fit_document_through_plan_and_report(data, bare_draws):
    """(issue 25) A mutated fit document, its draws in either schema form, through the commands
    that read fits: plan, plan route (via plan) and report. Read, or refused in one line."""

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
