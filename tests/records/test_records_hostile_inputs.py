"""Hostile values against kvbench's records: the typed models of a p2p record and a fit document,
and the one writer every command writes through (output paths under a file or /proc, a group
commit that fails half way, non-finite numbers, concurrent writers, a full disk).
Bad input is one line (exit 2), an I/O failure exit 3, and nothing partial is ever left.
(Found by issue 15, lists A and C.)
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

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
from tests.conftest import committed
from tests.helpers import (
    refused,
    run,
)


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
