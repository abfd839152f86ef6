"""Hostile folders given to `kvbench report` and `kvbench.results.load`: 1,100 nested folders
(no recursion, a glob over them is one line naming the way round), and an output folder
another report is writing (refused before any reading).
(Found by issue 43, hostile round 4, groups 2 and 10.)
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvbench import errors
from kvbench.report import cli as report_cli
from tests.helpers import refused, run


@pytest.fixture
def deep(tmp_path):
    """1,100 nested folders holding one x.jsonl, removed without recursion afterwards."""
    d = tmp_path / "runs"
    d.mkdir()
    cwd = os.getcwd()
    try:
        os.chdir(d)
        for _ in range(1100):
            os.mkdir("d")
            os.chdir("d")
        Path("x.jsonl").write_text("{}\n")
    finally:
        os.chdir(cwd)
    yield d
    _remove_deep(d)


def test_report_walks_deep_folders_without_recursion(tmp_path, deep):
    """1,100 nested folders were a RecursionError in Python 3.11's os.walk."""
    res = run(report_cli.cli, deep, "--out", tmp_path / "rep")
    refused(res, "no kvbench results", "skipped 1 file(s)")


def test_a_glob_over_deep_folders_is_one_line(deep):
    """glob's `**` recurses per level too: results.load says so and names the way round."""
    import kvbench.results as results

    with pytest.raises(errors.UsageError, match="nest too deep for a glob; name the folder"):
        results.load(f"{deep}/**/*.jsonl", "p2p")


def _remove_deep(top: Path) -> None:
    """Remove the nested folders without recursion (pytest's own clean-up recurses)."""
    order, stack = [], [str(top)]
    while stack:
        folder = stack.pop()
        order.append(folder)
        with os.scandir(folder) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    os.unlink(e.path)
    for folder in reversed(order[1:]):
        os.rmdir(folder)


def test_a_report_into_a_folder_being_written_is_refused_before_reading(tmp_path):
    """Two reports into one folder: the second used to scan (8 lines of notes) and be refused
    only at the write. Here the first holds the folder's lock, as a running report does."""
    runs, out = tmp_path / "runs", tmp_path / "rep"
    runs.mkdir()
    (runs / "other.jsonl").write_text('{"x": 1}\n')  # a file the scan would name as not read
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        refused(run(report_cli.cli, runs, "--out", out), "another kvbench report is writing")
    finally:
        os.close(fd)
    assert list(out.iterdir()) == []
