"""Hostile flags given to `kvbench p2p`, checked as every rank checks them before any MPI work:
a handoff of too many pieces (refused before any table, in a 3 GiB address space), a model
config that is a FIFO, list flags of the cut (one rule), a block-size sweep without a paged
layout, and a point declared twice. Each is one line naming the flag.
(Found by issue 43, hostile round 4, groups 1, 3 and 8.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbench import errors
from tests.conftest import ROOT


def p2p_validate(*argv: str):
    """kvbench p2p's checks as every rank runs them before MPI work (no launcher needed)."""
    from kvbench.p2p.args import build_parser, validate

    return validate(build_parser().parse_args(list(argv)), 2)


def test_p2p_refuses_a_handoff_of_too_many_pieces_before_any_table():
    """--sizes 10^9 --block-size 1: refused naming the flags and the bound, in a process whose
    address space is capped at 3 GiB (before: the table, then MemoryError on every rank)."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "from kvbench.p2p.args import build_parser, validate\n"
            "from kvbench.errors import UsageError\n"
            "for extra in ([], ['--kv-pages', 'joint']):\n"
            "    a = build_parser().parse_args(['--layout', 'paged', '--granularity', 'block',\n"
            "        '--sizes', '1000000000', '--block-size', '1', *extra])\n"
            "    try:\n"
            "        validate(a, 2)\n"
            "    except UsageError as e:\n"
            "        print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all("--sizes 1000000000 with --block-size 1" in ln and
                                   "at most 4,194,304" in ln for ln in lines), lines


def test_p2p_model_config_must_be_a_regular_file(tmp_path):
    """Every rank reads it: a FIFO blocked them in open() (a subprocess, as above)."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    code = ("from kvbench.p2p.args import build_parser, validate\n"
            f"validate(build_parser().parse_args(['--model-config', {str(fifo)!r}]), 2)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 1 and "--model-config" in r.stderr and "not a regular file" in r.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--kv-pages", ""], "--kv-pages: empty list"), (["--block-ids", ""], "--block-ids: empty list"),
    (["--tp-pair", "２:１"], "--tp-pair expects"), (["--tp-pair", "²:1"], "--tp-pair expects"),
    (["--block-size", "16,"], "--block-size: empty item"), (["--sizes", ""], "--sizes: empty list"),
])
def test_p2p_cut_flags_follow_one_rule(argv, needle):
    with pytest.raises(errors.UsageError, match=needle):
        p2p_validate("--layout", "paged", "--granularity", "block", "--sizes", "64", *argv)


def test_a_block_size_list_needs_a_paged_layout():
    """--layout contiguous --block-size 4,16 measured the same point twice (one spec id)."""
    with pytest.raises(errors.UsageError, match="--block-size 4,16 sweeps paged block sizes"):
        p2p_validate("--layout", "contiguous", "--block-size", "4,16", "--sizes", "64")
    p2p_validate("--layout", "paged", "--block-size", "4,16", "--sizes", "64")  # the sweep


@pytest.mark.parametrize("argv", [["--sizes", "64,64"], ["--bytes", "4K,4096"],
                                  ["--layout", "paged", "--block-size", "16,16", "--sizes", "64"]])
def test_a_point_declared_twice_is_refused(argv):
    """Two records of one spec id, the second measuring nothing new (as group 8's)."""
    with pytest.raises(errors.UsageError, match="declared twice"):
        p2p_validate(*argv)
