"""The slo report's and the lab documents' contracts (docs/contracts.md sections 5 and 6).

The published documents under results/lab/ validate against their classes; a document that
lost a field its readers rely on is refused in one line; the sweep reads its folder marker
back through its class; `kvbench slo analyze --out` writes what SloReport accepts, and a
report that drifts from it fails at the writer, before any file exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.errors import UsageError
from kvbench.records.schema.lab import (
    SCHEMA_AGREE,
    SCHEMA_FAULTS,
    SCHEMA_SWEEP,
    SCHEMA_SWEEP_REPORT,
    AgreeDocument,
    FaultsReport,
    SweepMeta,
    SweepReport,
)
from kvbench.records.schema.slo import SloReport
from kvbench.records.schema.types import parse
from tests.conftest import ROOT

CLASSES = {SCHEMA_SWEEP: SweepMeta, SCHEMA_SWEEP_REPORT: SweepReport, SCHEMA_FAULTS: FaultsReport,
           SCHEMA_AGREE: AgreeDocument}
PLAN = ROOT / "examples" / "lab-plan.yaml"


def published() -> list[tuple[Path, dict]]:
    out = []
    for f in sorted((ROOT / "results" / "lab").rglob("*.json")):
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and doc.get("schema") in CLASSES:
            out.append((f, doc))
    return out


def test_every_published_lab_document_validates_against_its_class():
    docs = published()
    assert {d["schema"] for _, d in docs} == set(CLASSES), "a lab format has no published example"
    for f, doc in docs:
        parse(CLASSES[doc["schema"]], doc, str(f))


@pytest.mark.parametrize("schema, drop, message", [
    (SCHEMA_FAULTS, "passed", "passed"),
    (SCHEMA_SWEEP_REPORT, "capacity", "capacity"),
    (SCHEMA_SWEEP, "plan_sha256_16", "plan_sha256_16"),
    (SCHEMA_AGREE, "agreement", "agreement"),
])
def test_a_document_without_what_its_readers_use_is_refused(schema, drop, message):
    f, doc = next((f, d) for f, d in published() if d["schema"] == schema)
    parse(CLASSES[schema], doc, str(f))  # the file as published passes
    broken = {k: v for k, v in doc.items() if k != drop}
    with pytest.raises(UsageError, match=message):
        parse(CLASSES[schema], broken, str(f))
    with pytest.raises(UsageError, match="schema"):
        parse(CLASSES[schema], {**doc, "schema": schema.replace("/", "/9")}, str(f))


def test_a_resumed_sweep_reads_its_marker_through_the_contract(tmp_path):
    from kvbench.lab.sweep.main import open_out

    out = tmp_path / "sweep"
    open_out(out, str(PLAN), [])
    parse(SweepMeta, json.loads((out / "sweep.json").read_text()), "sweep.json")
    meta = json.loads((out / "sweep.json").read_text())
    (out / "sweep.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "started"}))
    with pytest.raises(UsageError, match="sweep.json.*started"):
        open_out(out, str(PLAN), [])


def test_slo_analyze_writes_its_contract_and_a_drifting_report_fails_at_the_writer(
        tmp_path, monkeypatch, capsys):
    from kvbench.slo import cli as slo_cli

    records, report = tmp_path / "cohort.jsonl", tmp_path / "report.json"
    assert slo_cli.cli(["synth", "cohort", "--out", str(records)]) == 0
    argv = ["analyze", str(records), "--ttft-max-ms", "2000", "--tpot-max-ms", "50",
            "--denominator", "all_offered_after_warmup", "--attainment-min", "0.95",
            "--format", "json"]
    assert slo_cli.cli([*argv, "--out", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert parse(SloReport, doc, str(report)).groups

    real = slo_cli._client_report

    def drifted(args, plan):  # a renamed key inside a group: what results.load would refuse
        out = real(args, plan)
        out["groups"][0]["deployment_name"] = out["groups"][0].pop("deployment")
        return out

    monkeypatch.setattr(slo_cli, "_client_report", drifted)
    again = tmp_path / "again.json"
    capsys.readouterr()
    assert slo_cli.cli([*argv, "--out", str(again)]) == 2
    err = capsys.readouterr().err
    assert "the report being written" in err and "deployment" in err, err
    assert not again.exists()
