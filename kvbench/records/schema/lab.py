"""The contracts of what the lab writes: a sweep folder's marker (`kvbench.lab.sweep/1`,
sweep.json), the sweep's report (`kvbench.lab.sweep-report/2`, sweep-report.json), the fault
audit (`kvbench.lab.faults/1`, faults-report.json) and `lab agree`'s document
(`kvbench.lab.agree/1`, agreement.json).

Each writer validates its document as one of these classes before the file is written
(kvbench.records.write.as_contract); the sweep reads its marker back through SweepMeta when it
resumes. The classes fix what a reader of the file relies on (the top-level keys, their
types, the verdict fields); the per-run and per-point tables inside stay open (extra keys
kept), documented in docs/lab.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvbench.records.schema.types import AnyText, Finite, Open, Text

SCHEMA_SWEEP = "kvbench.lab.sweep/1"
SCHEMA_SWEEP_REPORT = "kvbench.lab.sweep-report/2"
SCHEMA_FAULTS = "kvbench.lab.faults/1"
SCHEMA_AGREE = "kvbench.lab.agree/1"


class SweepMeta(Open):
    """sweep.json: which plan (by digest) and client a sweep folder belongs to."""

    schema_: Literal["kvbench.lab.sweep/1"] = Field(alias="schema")
    plan: AnyText
    plan_sha256_16: Text
    client: Text = "vllm"  # sweeps before --client existed ran vllm bench serve
    command: list[AnyText]
    started: Text


class SweepReport(Open):
    """sweep-report.json: capacity and verdict per cache state, the points and the tables."""

    schema_: Literal["kvbench.lab.sweep-report/2"] = Field(alias="schema")
    plan: AnyText
    machine: Any = None
    provenance: dict[str, Any]
    runs: list[dict[str, Any]]
    analysis_errors: dict[str, Any]
    capacity: dict[str, Any]
    verdicts: dict[str, Any]
    points: Any
    scheduler: Any
    kv_transfers: Any
    handoff_fit: AnyText | None = None
    engine_shaped_reference: AnyText | None = None
    attainment_min_pct: Finite
    plots: list[AnyText] = []
    files: list[AnyText] = []


class FaultsReport(Open):
    """faults-report.json: one audit result per policy and injection, and whether all passed."""

    schema_: Literal["kvbench.lab.faults/1"] = Field(alias="schema")
    command: list[AnyText]
    passed: bool
    results: list[dict[str, Any]]


class AgreeDocument(Open):
    """agreement.json: the engine's runs, the p2p runs beside them and the agreement."""

    schema_: Literal["kvbench.lab.agree/1"] = Field(alias="schema")
    command: list[AnyText]
    started: Text
    finished: Text
    plan: AnyText
    rates_rps: list[Finite]
    repeats: int
    engine: Any
    p2p: Any
    plain_fit: Any = None
    agreement: Any
