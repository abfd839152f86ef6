"""Hostile data given to `kvbench fit`, and the fit documents it writes as every reader of fits
takes them (plan, plan route, plan export, slo analyze --fit, report).

Numerical edges (all-zero or denormal samples, sub-ns times, the extremes of bytes), a file
named twice, a folder whose name is not UTF-8, and fit draws in the bare schema form or not
this fit's: each is fitted and read back, or refused in one line, never a traceback.
(Found by issue 25, groups 5, 6, 7 and 11.)
"""

from __future__ import annotations

import json

import pytest

import kvbench.fit.cli
import kvbench.plan.cli
import kvbench.report.cli
import kvbench.slo.cli
from tests.conftest import ROOT
from tests.helpers import no_traceback, run

P2P = ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl"


FIT = ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json"


def records_with(path, value: float, sizes=(1000, 2000, 4000, 8000, 16000, 32000), blocks=12):
    rec = json.loads(P2P.read_text().splitlines()[0])
    with open(path, "w") as fh:
        for b in sizes:
            for _ in range(blocks):
                fh.write(json.dumps({**rec, "bytes": b, "samples_ms": [value] * 5}) + "\n")


@pytest.mark.parametrize("value", [0.0, 5e-324, 1e-310])
def test_all_zero_or_denormal_samples_say_no_rate_can_be_fitted(tmp_path, value):
    """Group 6: a zero matrix in the lack-of-fit test (a singular solve) and a division that
    underflowed to zero (end-to-end GB/s of a denormal median)."""
    records_with(tmp_path / "z.jsonl", value)
    fit = tmp_path / "z.fit.json"
    rc, out, err = run(kvbench.fit.cli.cli, tmp_path / "z.jsonl", "--out", fit, "--bootstrap", "100")
    assert rc == 0, err
    assert "no rate can be fitted" in out + err
    no_traceback(run(kvbench.plan.cli.cli, "--fit", fit, "--prompt-tokens", "1000"))
    no_traceback(run(kvbench.report.cli.cli, tmp_path, "--out", tmp_path / "rep", "--quiet",
                     "--bootstrap", "100"))


def test_one_file_named_twice_is_read_once(tmp_path, monkeypatch):
    """Group 11: `fit f.jsonl ./f.jsonl` counted every record twice."""
    (tmp_path / "f.jsonl").write_text(P2P.read_text())
    monkeypatch.chdir(tmp_path)
    docs = []
    for names in (["f.jsonl"], ["f.jsonl", "./f.jsonl", str(tmp_path / "f.jsonl")]):
        out = tmp_path / f"fit{len(names)}.json"
        rc, _, err = run(kvbench.fit.cli.cli, *names, "--out", out, "--bootstrap", "100")
        assert rc == 0, err
        docs.append(json.loads(out.read_text()))
    assert "given already: read once" in err
    assert [g["n_samples"] for g in docs[0]["groups"]] == [g["n_samples"] for g in docs[1]["groups"]]


FIT2 = ROOT / "tests/data/runs/fit-example/kvbench-p2p-20261203T140056Z-7a0e16.fit.json"


ROUTE = ("--prompt-tokens", "1000,8000", "--local-interference-ms", "5", "--itl-p95-ms", "20",
         "--itl-target-ms", "50")


def fit_with_draws(tmp_path, draws) -> str:
    doc = json.loads(FIT2.read_text())
    doc["groups"][0]["draws"] = draws
    path = tmp_path / "d.fit.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_draws_as_a_bare_list_of_pairs_are_read_by_every_fit_reader(tmp_path):
    """Group 7: the schema accepted the bare form; plan, route, export and slo --fit crashed."""
    from kvbench.plan.floors import links_from_fit

    values = json.loads(FIT2.read_text())["groups"][0]["draws"]["values"]
    bare = fit_with_draws(tmp_path, values)
    for cli, argv in ((kvbench.plan.cli.cli, ("--fit", bare, "--prompt-tokens", "1000")),
                      (kvbench.plan.cli.cli, ("route", "--fit", bare, *ROUTE)),
                      (kvbench.plan.cli.export_cli, ("--fit", bare, "--to", "json"))):
        rc, out, err = run(cli, *argv)
        assert rc == 0, err
    link = links_from_fit(bare, {})[0]  # what slo analyze --fit reads
    lo, hi = link.band(10**8)
    assert lo < link.setup_ms + 10**8 / (link.effective_gb_s * 1e9) * 1000 < hi


@pytest.mark.parametrize("change, fragment", [
    (lambda v: {"columns": ["ms_per_gb", "setup_ms"], "values": v}, "draw columns must be"),
    (lambda v: [[b, a] for a, b in v], "do not surround the point estimate"),
    (lambda v: [[a + 1000.0, b] for a, b in v], "do not surround the point estimate"),
    (lambda v: [[a, -b] for a, b in v], "do not surround the point estimate"),
])
def test_draws_that_are_not_this_fits_are_refused(tmp_path, change, fragment):
    """Group 7: a band of 1000 ms beside a 13.5 ms floor was printed as if true."""
    values = json.loads(FIT2.read_text())["groups"][0]["draws"]["values"]
    path = fit_with_draws(tmp_path, change(values))
    err = no_traceback(run(kvbench.plan.cli.cli, "--fit", path, "--prompt-tokens", "1000"), codes=(2,))
    assert fragment in err and "draws" in err


def _read_by_every_fit_reader(fit_path, folder) -> None:
    """Every kvbench reader of fit documents takes what fit wrote (plan may refuse a group
    without a rate, in one line: that is a verdict, not a refused file)."""
    from kvbench.records.schema.fit import load_fit_document
    from kvbench.results import load

    load_fit_document(fit_path)
    for kind in ("fit", "fit-sizes"):
        load(fit_path, kind)
    err = no_traceback(run(kvbench.plan.cli.cli, "--fit", fit_path, "--prompt-tokens", "1000"))
    assert "must be" not in err, err  # not a schema refusal
    rc, _, err = run(kvbench.report.cli.cli, folder, "--out", folder / "rep", "--quiet", "--bootstrap", "100")
    assert rc == 0, err


@pytest.mark.parametrize("value, sizes", [
    (lambda b: 1.5 + 1e-12 * b, (1000, 2000, 4000, 8000, 16000, 32000)),  # constant: a noise slope
    (lambda b: 1e-6 + b * 1e-15, (1, 2, 4, 8)),  # sub-ns times on 1-byte payloads
    (lambda b: 1e9 + b * 1e-9, (1, 2**40, 2**50, 2**53 - 1)),  # the extremes of bytes and times
])
def test_what_fit_writes_every_fit_reader_accepts(tmp_path, value, sizes):
    """Group 5: fit wrote 1.7e13 GB/s (zero-width interval, no warning) that plan then refused."""
    rec = json.loads(P2P.read_text().splitlines()[0])
    with open(tmp_path / "r.jsonl", "w") as fh:
        for b in sizes:
            for _ in range(4):
                fh.write(json.dumps({**rec, "bytes": b, "samples_ms": [value(b)] * 5}) + "\n")
    fit = tmp_path / "r.fit.json"
    rc, _, err = run(kvbench.fit.cli.cli, tmp_path / "r.jsonl", "--out", fit, "--bootstrap", "100")
    assert rc == 0, err
    _read_by_every_fit_reader(fit, tmp_path)


def test_a_fit_in_a_folder_whose_name_is_not_utf8_is_read_back(tmp_path):
    """Group 5: plan refused the fit (a lone surrogate in `inputs`), report crashed writing it."""
    folder = tmp_path / b"run-\xff".decode("utf-8", "surrogateescape")
    folder.mkdir()
    (folder / "r.jsonl").write_text(P2P.read_text())
    rc, _, err = run(kvbench.fit.cli.cli, folder / "r.jsonl", "--bootstrap", "100")
    assert rc == 0, err
    _read_by_every_fit_reader(folder / "r.fit.json", folder)
    assert "run-\\xff" in (folder / "rep" / "report.md").read_text()
