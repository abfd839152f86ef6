"""Hostile round 4 (issue 43): each group's example, planted against the rule that now holds.

Groups here: valid numbers that sized unbounded work (1), tracebacks (2: report over deep
folders), non-ASCII digits and empty values (3), a per-descriptor term dropped (4: the
--gbps form), a dead flag combination (8), gpu-check's flags (9) and a refusal after the
work (10). The fit-based cases of 2, 4 and 5 are in tests/plan/test_descriptor_plan.py, the
--cases exit status (7) in tests/p2p/test_cases.py.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench import errors
from kvbench.kv import cut as kc
from kvbench.kv.shards import heads_by_rank, shard_plan
from kvbench.model import get_dtype, resolve_model
from kvbench.plan import cli as kvplan
from kvbench.report import cli as report_cli
from tests.helpers import refused, run

ROOT = Path(__file__).resolve().parents[1]
GBPS = ["--gbps", "10", "--setup-ms", "1"]


def p2p_validate(*argv: str):
    """kvbench p2p's checks as every rank runs them before MPI work (no launcher needed)."""
    from kvbench.p2p.args import build_parser, validate

    return validate(build_parser().parse_args(list(argv)), 2)


# ---------------------------------------------------------------------------
# 1. counts by formula, work bounded before it starts


def test_descriptor_counts_build_no_block_table(monkeypatch):
    """10^9 tokens in blocks of 16: the count is arithmetic. Before: a block table of 6.25e7
    ids per side was built to count one run (10^7 tokens took 7.7 s and 830 MB)."""
    model, dtype = resolve_model(None, None), get_dtype("bf16")
    small = {b: kc.count_pieces(model, dtype, 300, kc.Cut(16, "joint", b), merge_adjacent=True)
             for b in ("contiguous", "merged", "scattered")}

    def no_tables(kind, need, side, seed=0):
        raise AssertionError(f"built a {kind} block table of {need} ids to count pieces")

    monkeypatch.setattr(kc, "block_table", no_tables)
    blocks = 10**9 // 16
    for kind, runs in (("contiguous", 1), ("merged", 1), ("scattered", blocks)):
        c = kc.Cut(16, "joint", kind)
        assert kc.count_pieces(model, dtype, 10**9, c) == 80 * (1 if kind == "merged" else blocks)
        assert kc.count_pieces(model, dtype, 10**9, c, merge_adjacent=True) == 80 * runs
    assert small == {"contiguous": 80, "merged": 80, "scattered": 80 * 19}  # 300 tokens, 19 blocks


def test_the_formula_counts_what_the_tables_count():
    """The arithmetic against the tables themselves (small prompts, every kind)."""
    model, dtype = resolve_model(None, None), get_dtype("bf16")
    for kind in ("contiguous", "merged", "scattered"):
        for tokens in (1, 16, 17, 300, 1000):
            nb = -(-tokens // 16)
            want = kc.runs_of(kc.block_table(kind, nb, "prefill"), kc.block_table(kind, nb, "decode"))
            got = kc.count_pieces(model, dtype, tokens, kc.Cut(16, "joint", kind), merge_adjacent=True)
            assert got == 80 * want, (kind, tokens)


def _scanning_shard_plan(kv_heads: int, p: int, d: int, mla: bool = False) -> list:
    """The former O(P x D) rule, written out: each decode head from its least-loaded holder."""
    k = 1 if mla else kv_heads
    ph, dh = heads_by_rank(p, k, mla, "prefill"), heads_by_rank(d, k, mla, "decode")
    load, chosen = [0] * p, {}
    for j, heads in enumerate(dh):
        for h in heads:
            src = min((i for i in range(p) if h in ph[i]), key=lambda i: (load[i], i))
            load[src] += 1
            chosen.setdefault((src, p + j), []).append(h)
    return sorted(((s, t, tuple(sorted(h))) for (s, t), h in chosen.items()), key=lambda e: (e[1], e[0]))


@pytest.mark.parametrize("kv_heads", [1, 2, 8, 12])
def test_the_shard_plan_by_formula_is_the_least_loaded_rule(kv_heads):
    for p in range(1, 33):
        for d in range(1, 33):
            try:
                want = _scanning_shard_plan(kv_heads, p, d)
            except errors.UsageError:
                continue
            got = [(e.src, e.dst, e.heads) for e in shard_plan(kv_heads, p, d).edges]
            assert got == want, (kv_heads, p, d)


def test_the_largest_tp_pair_plans_and_a_larger_one_is_refused():
    """65,536:65,536 ran an O(P x D) plan ~12 times a row and did not end in 40 s (the
    subprocess limit is a hang guard, not a performance target)."""
    r = subprocess.run([sys.executable, "-m", "kvbench.plan", *GBPS, "--us-per-desc", "0.5",
                        "--block-size", "16", "--tp-pair", "65536:65536"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    refused(run(kvplan.cli, *GBPS, "--us-per-desc", "0.5", "--block-size", "16", "--tp-pair",
                "65537:1"), "--tp-pair", "65,536")


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


def test_p2p_model_config_must_be_a_regular_file(tmp_path):
    """Every rank reads it: a FIFO blocked them in open() (a subprocess, as above)."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    code = ("from kvbench.p2p.args import build_parser, validate\n"
            f"validate(build_parser().parse_args(['--model-config', {str(fifo)!r}]), 2)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 1 and "--model-config" in r.stderr and "not a regular file" in r.stderr


# ---------------------------------------------------------------------------
# 2. tracebacks: report over deep folders


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


# ---------------------------------------------------------------------------
# 3. one ASCII-digit rule and one empty-value rule for every list flag


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


@pytest.mark.parametrize("argv, needle", [
    (["--kv-pages", ""], "--kv-pages: empty list"), (["--block-ids", ""], "--block-ids: empty list"),
    (["--tp-pair", "２:１"], "--tp-pair expects"), (["--tp-pair", "²:1"], "--tp-pair expects"),
    (["--block-size", "16,"], "--block-size: empty item"), (["--sizes", ""], "--sizes: empty list"),
])
def test_p2p_cut_flags_follow_one_rule(argv, needle):
    with pytest.raises(errors.UsageError, match=needle):
        p2p_validate("--layout", "paged", "--granularity", "block", "--sizes", "64", *argv)


def test_the_rule_itself():
    assert errors.list_items(" a , b ", "--x") == ["a", "b"]
    assert errors.parse_int_pair(" 2:1 ", "--x", ":", 1, 8, "P:D") == (2, 1)
    for bad in ("2", "2:", ":1", "2:1:1", "0:1", "9:1", "2_0:1", "٢:1", "2 :1x"):
        with pytest.raises(errors.UsageError, match="--x expects P:D"):
            errors.parse_int_pair(bad, "--x", ":", 1, 8, "P:D")


# ---------------------------------------------------------------------------
# 4. a term the link carries is never dropped (the fit form: tests/plan/test_descriptor_plan.py)


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


# ---------------------------------------------------------------------------
# 8. no dead flag combination


def test_a_block_size_list_needs_a_paged_layout():
    """--layout contiguous --block-size 4,16 measured the same point twice (one spec id)."""
    with pytest.raises(errors.UsageError, match="--block-size 4,16 sweeps paged block sizes"):
        p2p_validate("--layout", "contiguous", "--block-size", "4,16", "--sizes", "64")
    p2p_validate("--layout", "paged", "--block-size", "4,16", "--sizes", "64")  # the sweep


# ---------------------------------------------------------------------------
# 9. gpu-check


def gpu_check(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check"), "--one-gpu",
                           "--dry-run", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path / "out")})


@pytest.mark.parametrize("args, needle", [
    (["--steps", ""], "argument --steps: empty list"), (["--steps", "fit,"], "empty item"),
    (["--budget-scale", "1_0"], "from 1 to 10, got '1_0'"),
    (["--budget-scale", "3"], "past its ceiling of 300 s"),
])
def test_gpu_check_flags(tmp_path, args, needle):
    r = gpu_check(tmp_path, *args)
    assert r.returncode == 2 and needle in r.stderr and r.stdout == "", r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_gpu_check_scales_within_the_ceiling(tmp_path):
    r = gpu_check(tmp_path, "--budget-scale", "1.5", "--steps", "fit")
    assert r.returncode == 0 and "(285 s free)" in r.stdout, r.stderr


# ---------------------------------------------------------------------------
# 10. a refusal before the work


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


# ---------------------------------------------------------------------------
# found by this round's own pass


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


@pytest.mark.parametrize("argv", [["--sizes", "64,64"], ["--bytes", "4K,4096"],
                                  ["--layout", "paged", "--block-size", "16,16", "--sizes", "64"]])
def test_a_point_declared_twice_is_refused(argv):
    """Two records of one spec id, the second measuring nothing new (as group 8's)."""
    with pytest.raises(errors.UsageError, match="declared twice"):
        p2p_validate(*argv)
