"""Hostile flags and files given to `kvbench plan`: list flags (one ASCII-digit rule, one
empty-value rule), block-id files that are FIFOs, folders or too short, a per-descriptor term
given without the cut or beyond its bound, and TP pairs too large or that cannot shard.
Each is refused in one line naming the flag, before any work; the largest allowed pair plans.
(Found by issue 43, hostile round 4, groups 1, 3, 4 and the round's own pass.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbench.plan import cli as kvplan
from tests.conftest import ROOT
from tests.helpers import refused, run

GBPS = ["--gbps", "10", "--setup-ms", "1"]


def test_the_largest_tp_pair_plans_and_a_larger_one_is_refused():
    """65,536:65,536 ran an O(P x D) plan ~12 times a row and did not end in 40 s (the
    subprocess limit is a hang guard, not a performance target)."""
    r = subprocess.run([sys.executable, "-m", "kvbench.plan", *GBPS, "--us-per-desc", "0.5",
                        "--block-size", "16", "--tp-pair", "65536:65536"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    refused(run(kvplan.cli, *GBPS, "--us-per-desc", "0.5", "--block-size", "16", "--tp-pair",
                "65537:1"), "--tp-pair", "65,536")


@pytest.mark.parametrize("what", ["fifo", "dir"])
def test_a_block_id_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, what):
    """A FIFO blocked every rank in open(), past --timeout: now refused without opening it
    for a blocking read (a subprocess, so a regression fails the test instead of hanging it)."""
    path = tmp_path / "ids"
    os.mkfifo(path) if what == "fifo" else path.mkdir()
    r = subprocess.run([sys.executable, "-m", "kvbench.plan", *GBPS, "--us-per-desc", "0.5",
                        "--block-size", "16", "--block-ids", f"file:{path}"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("flag, value, needle", [
    ("--tp-pair", "２:１", "--tp-pair expects"), ("--tp-pair", "²:1", "--tp-pair expects"),
    ("--tp-pair", "", "--tp-pair: empty list"), ("--tp-pair", "1:1,", "--tp-pair: empty item"),
    ("--block-ids", "", "--block-ids: empty list"), ("--block-ids", "merged,,", "--block-ids: empty item"),
    ("--block-ids", "file:", "--block-ids: 'file:' is not one of"),
    ("--prompt-tokens", "", "--prompt-tokens: empty list"),
    ("--prompt-tokens", "300,,2000", "--prompt-tokens: empty item"),
    ("--pair", "²,1", "--pair expects"), ("--pair", "0,１", "--pair expects"),
])
def test_plan_list_flags_follow_one_rule(flag, value, needle):
    extra = ["--fit", "nonexistent.fit.json"] if flag == "--pair" else [*GBPS, "--us-per-desc", "0.5",
                                                                        "--block-size", "16"]
    refused(run(kvplan.cli, *extra, flag, value), needle)


def test_a_given_per_descriptor_term_needs_the_cut():
    """`--gbps 10 --us-per-desc 0.5` without a cut planned without the term while its label
    said "+ 0.5 us per descriptor"."""
    refused(run(kvplan.cli, *GBPS, "--us-per-desc", "0.5"), "--us-per-desc 0.5 needs the deployment's cut",
            "--block-size")
    refused(run(kvplan.cli, "route", *GBPS, "--us-per-desc", "0.5", "--prompt-tokens", "300",
                "--local-interference-ms", "2", "--itl-p95-ms", "35", "--itl-target-ms", "50"),
            "plan route does not count descriptors")
    rc, out, err = run(kvplan.cli, *GBPS, "--us-per-desc", "0.5", "--block-size", "16")
    assert rc == 0 and '"descriptors"' in out, err


def test_a_recorded_id_file_is_still_held_to_the_request_when_counting_by_formula(tmp_path):
    """Counting without tables must not skip the check that a file holds the request's ids
    (the formula's first version planned 10^9 tokens over a file of 3 ids)."""
    ids = tmp_path / "ids.json"
    ids.write_text('{"prefill": [0, 1, 2], "decode": [5, 6, 7]}')
    args = [*GBPS, "--us-per-desc", "0.5", "--block-size", "16", "--block-ids", f"file:{ids}"]
    refused(run(kvplan.cli, *args, "--prompt-tokens", "1000000000"), "prefill: lists 3 block ids")
    rc, out, err = run(kvplan.cli, *args, "--prompt-tokens", "48")
    assert rc == 0, err


def test_a_given_per_descriptor_cost_has_the_fits_bound():
    refused(run(kvplan.cli, *GBPS, "--us-per-desc", "2000000", "--block-size", "16"),
            "--us-per-desc", "<= 1e+06")


def test_a_tp_pair_that_cannot_shard_names_the_flag():
    refused(run(kvplan.cli, *GBPS, "--us-per-desc", "0.5", "--block-size", "16", "--tp-pair", "3:1"),
            "kvbench plan: error: --tp-pair 3:1: ", "does not divide")
