"""Each file format's writer and reader meet in one class (docs/contracts.md).

What the planner writes is read back through its contract and gives the numbers the writer
printed; a writer whose document drifts from its contract fails at the writer, one line
naming the field. (Which module may write which format: tests/test_layout.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.errors import UsageError
from kvbench.plan import cli as kvplan
from kvbench.records.schema.fit import FitDocument, load_fit_document
from kvbench.records.schema.p2p import P2PRecord, iter_p2p_records
from kvbench.records.schema.plan import KVTransferModel, PlanDocument, RouteDocument, load_plan_file
from kvbench.records.write import contract_dump
from tests.conftest import committed
from tests.helpers import run

FIT = committed("tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json")
P2P = committed("tests/data/p2p/kvbench-p2p-20261203T122234Z-b96bb8.jsonl")


def _run(*argv) -> dict:
    rc, out, err = run(kvplan.cli, *argv)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("argv, model", [
    (("--fit", FIT, "--prompt-tokens", "300,2000", "--format", "json"), PlanDocument),
    (("route", "--fit", FIT, "--prompt-tokens", "300", "--local-interference-ms", "2",
      "--itl-p95-ms", "35", "--itl-target-ms", "50", "--format", "json"), RouteDocument),
    (("export", "--fit", FIT, "--to", "json"), KVTransferModel),
])
def test_what_plan_writes_reads_back_through_its_contract(tmp_path, argv, model):
    out = tmp_path / "doc.json"
    printed = _run(*argv, "--out", out)
    doc = load_plan_file(out, model)
    assert doc.schema_ == printed["schema"]
    if model is PlanDocument:
        assert [r.handoff_floor_ms for r in doc.rows] == [r["handoff_floor_ms"] for r in printed["rows"]]
        assert doc.rows[0].effective_gb_s > 0 and doc.rows[0].source == "fit"
    elif model is KVTransferModel:
        assert doc.handoff_ms == printed["handoff_ms"] and doc.fold.prompt_tokens == 2000
    with pytest.raises(UsageError, match="expected a kvbench"):  # another format is refused
        load_plan_file(out, PlanDocument if model is not PlanDocument else RouteDocument)


def test_the_fit_and_the_p2p_record_dump_as_their_readers_read_them():
    fit = json.loads(Path(FIT).read_text())
    assert contract_dump(FitDocument, fit, "fit") == load_fit_document(FIT).model_dump(
        mode="json", by_alias=True, exclude_unset=True) == fit
    _, rec = next(iter(iter_p2p_records([P2P])))
    raw = json.loads(Path(P2P).read_text().splitlines()[0])
    assert contract_dump(P2PRecord, raw, "record") == raw
    assert rec.n_samples == len(raw["samples_ms"])


@pytest.mark.parametrize("model, change, field", [
    (P2PRecord, {"n_samples": 1}, "n_samples is 1 but samples_ms holds"),
    (P2PRecord, {"bytes": -1}, "bytes"),
    (FitDocument, {"schema": "kvbench.fit/9"}, "schema"),
])
def test_a_writer_that_drifts_from_its_contract_fails_at_the_writer(model, change, field):
    src = P2P if model is P2PRecord else FIT
    text = Path(src).read_text()
    raw = json.loads(text.splitlines()[0] if model is P2PRecord else text)
    with pytest.raises(UsageError, match=field) as err:
        contract_dump(model, {**raw, **change}, "the document being written")
    assert "\n" not in str(err.value)
