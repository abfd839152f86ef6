"""kvbench matrix without MPI: the schedule, one pair's samples out of a round, the per-pair data
check, the verdict's rules on planted matrices, the typed document, the report files, the
exit status, and plan / plan export reading a matrix. Records are synthetic (known rates and
paths per pair) and go through the real fit; the real runs are tests/matrix/test_matrix_mpi.py
and tests/matrix/test_matrix_cluster.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from kvbench.cli import UsageError
from kvbench.links.linkpath import LinkPath
from kvbench.matrix import analyze as az
from kvbench.p2p.harness import LoopResult
from kvbench.p2p.layout import KVCache, KVSpec, RawBuffer
from kvbench.p2p.patterns.matrix import FromPeer, ordered_pairs, pair_loop, schedule
from kvbench.records.schema.matrix import (
    MatrixDocument,
    load_matrix_document,
    parse_pair_choice,
)
from kvbench.records.stats import Measurement
from tests.conftest import run_cli
from tests.helpers import rounds_records, write_jsonl
from tests.matrix.helpers import ETH0, ETH1, ODD, PLANTED, SIZES, matrix_records

# ---------------------------------------------------------------------------
# the schedule


@pytest.mark.parametrize("n", range(2, 10))
def test_rounds_cover_every_ordered_pair_once_and_share_no_rank(n):
    rounds = schedule(n, "rounds")
    pairs = [p for rnd in rounds for p in rnd]
    assert sorted(pairs) == ordered_pairs(n) and len(pairs) == n * (n - 1)
    for rnd in rounds:
        ranks = [r for p in rnd for r in p]
        assert len(ranks) == len(set(ranks))  # no rank in two pairs of a round
        assert len(rnd) == n // 2  # every rank busy (one idle when n is odd)
    assert len(rounds) == (2 * (n - 1) if n % 2 == 0 else 2 * n)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_serial_is_one_pair_at_a_time(n):
    rounds = schedule(n, "serial")
    assert [len(r) for r in rounds] == [1] * (n * (n - 1))
    assert sorted(p for r in rounds for p in r) == ordered_pairs(n)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule(3, "random")


# ---------------------------------------------------------------------------
# one pair's measurement out of its round's


def _round(starts, ends, cold_starts=None, cold_ends=None) -> LoopResult:
    """A round of 4 ranks, pairs (0->1) and (2->3), with per-rank stamps (ms from the round's
    first start), the way critical_paths builds them."""
    crit = [max(e for e in col if e is not None) for col in zip(*[c for c in ends if c], strict=True)]
    return LoopResult(cold_ms=None, warmup_ms=[1.0], samples=Measurement(crit), iters=len(crit),
                      rounds=list(range(len(crit))), rank_ms=ends, rank_start_ms=starts,
                      rank_cold_ms=cold_ends or [None] * 4,
                      rank_cold_start_ms=cold_starts or [None] * 4)


def test_a_concurrent_pair_gets_its_own_critical_path():
    loop = _round(starts=[[0.0, 0.5], None, [0.2, 0.0], None],
                  ends=[[9.0, 9.5], [10.0, 9.0], [3.0, 4.0], [2.5, 4.5]],
                  cold_starts=[0.0, None, 1.0, None], cold_ends=[20.0, 21.0, 6.0, 7.0])
    a, b = pair_loop(loop, 0, 1, alone=False), pair_loop(loop, 2, 3, alone=False)
    assert a.samples.samples_ms == [10.0, 9.0]  # max(its two ends) - its sender's start
    assert b.samples.samples_ms == [2.8, 4.5]  # not the round's 10 ms
    assert (a.cold_ms, b.cold_ms) == (21.0, 6.0)
    assert a.rounds == [0, 1] and a.rank_ms[2] is None and b.rank_ms[0] is None
    assert pair_loop(loop, 0, 1, alone=True) is loop  # alone: the round's own measurement


# ---------------------------------------------------------------------------
# the data check names the sender: a receiving link expects its own sender's values


def _model():
    from kvbench.model import PRESETS, get_dtype

    return PRESETS["llama-3.1-8b"], get_dtype("bf16")


@pytest.mark.parametrize("kind", ["raw", "kv"])
def test_a_receiving_link_checks_its_own_senders_values(kind):
    if kind == "raw":
        sent, got = RawBuffer(4096, origin=2), RawBuffer(4096)
    else:
        model, dtype = _model()
        sent = KVCache(KVSpec(model, dtype, 8, origin=2))
        got = KVCache(KVSpec(model, dtype, 8))
    sent.fill()
    got.backing.copy_(sent.backing)
    assert FromPeer(got, 2).count_wrong() == 0
    assert FromPeer(got, 1).count_wrong() > 0  # the bytes of rank 2, expected from rank 1
    holder = got.spec if kind == "kv" else got
    assert holder.origin == 0  # restored after the check
    FromPeer(got, 2).clear()
    assert int(torch.count_nonzero(got.backing)) == 0


# ---------------------------------------------------------------------------
# the verdict's rules on plain entries


def entry(pair, rate, ci, path=ETH0, same_host=False, link="tcp"):
    return {"pair": list(pair), "effective_gb_s": rate, "effective_gb_s_ci95": ci, "path": path,
            "same_host": same_host, "link": link}


def test_slow_needs_both_the_intervals_apart_and_a_material_gap():
    es = [entry((0, 1), 1.00, [0.95, 1.05]), entry((1, 0), 1.02, [0.97, 1.08]),
          entry((0, 2), 0.98, [0.94, 1.03]), entry((2, 0), 1.01, [0.96, 1.06]),
          entry((1, 2), 0.05, [0.049, 0.051]),  # planted: 5% of the others
          entry((2, 1), 0.85, [0.84, 0.86])]  # apart from the others, but only 15% slower
    slow = az.slow_pairs(es, 0.8)
    assert set(slow) == {(1, 2)} and "5% of their median" in slow[(1, 2)]
    assert set(az.slow_pairs(es, 0.9)) == {(1, 2), (2, 1)}  # a stricter fraction names it too


def test_slow_is_not_said_without_intervals_or_beyond_them():
    es = [entry((0, 1), 1.0, [0.9, 1.1]), entry((1, 0), 1.0, [0.9, 1.1]),
          entry((0, 2), 0.5, [0.3, 1.2]),  # half the rate, but its interval reaches the others
          entry((2, 0), 0.1, None)]  # no interval: not judged
    assert az.slow_pairs(es, 0.8) == {}


def test_paths_are_compared_within_their_kind_and_need_a_majority():
    es = [entry((0, 1), 1, None), entry((1, 0), 1, None), entry((0, 2), 1, None, ETH1),
          entry((2, 0), 1, None), entry((2, 3), 9, None, "NCCL P2P/CUMEM/read", True),
          entry((3, 2), 9, None, "NCCL P2P/CUMEM/read", True)]
    majority = az.majority_paths(es)
    assert majority == {az.ACROSS: ETH0, az.WITHIN: "NCCL P2P/CUMEM/read"}
    odd = az.odd_paths(es, majority)
    assert set(odd) == {(0, 2)} and "3 of 4 pairs across hosts" in odd[(0, 2)]
    split = [entry((0, 1), 1, None), entry((1, 0), 1, None, ETH1)]  # one each: no majority
    assert az.majority_paths(split) == {az.ACROSS: None} and az.odd_paths(split, {az.ACROSS: None}) == {}


def test_expect_link_uses_the_local_kind_for_pairs_within_a_host():
    es = [entry((0, 1), 1, None, "NET/IB/0", link="rdma"),
          entry((0, 2), 1, None, "P2P/CUMEM", True, "nvlink"),
          entry((1, 2), 1, None, "NET/Socket/0", link="tcp")]
    kinds = {pair: LinkPath(frozenset({k}), path) for pair, k, path in (
        ((0, 1), "rdma", "NET/IB/0"), ((0, 2), "nvlink", "P2P/CUMEM"), ((1, 2), "tcp", "NET/Socket/0"))}
    assert set(az.link_failures(es, kinds, "rdma", "nvlink")) == {(1, 2)}
    assert set(az.link_failures(es, kinds, "rdma", None)) == {(0, 2), (1, 2)}
    assert az.link_failures(es, kinds, None, None) == {}


# ---------------------------------------------------------------------------
# a synthetic run through the real fit


@pytest.fixture(scope="module")
def planted_doc(tmp_path_factory) -> tuple[MatrixDocument, Path]:
    d = tmp_path_factory.mktemp("m")
    src = write_jsonl(d / "run.jsonl", matrix_records(PLANTED, ODD))
    return az.analyze([str(src)], expect_link="tcp", n_boot=200), src


def named(doc: MatrixDocument) -> dict:
    return {tuple(p.pair): [f.code for f in p.findings] for p in doc.pairs if p.findings}


def test_the_planted_pairs_and_only_they_are_named(planted_doc):
    doc, _ = planted_doc
    assert named(doc) == {(1, 0): ["slow"], (0, 2): ["path_differs"]}
    slow = doc.pair(1, 0)
    assert slow.effective_gb_s == pytest.approx(0.05, rel=0.05)
    assert slow.sender.host == "n2" and slow.receiver.host == "n1" and not slow.same_host
    assert doc.majority_path == {az.ACROSS: ETH0}
    assert "6 of 6 ordered pairs" in doc.verdict and "[1,0] n2 -> n1: slow" in doc.verdict
    assert all(p.fit is not None and p.fit.n_samples == 48 for p in doc.pairs)


def test_the_document_round_trips_through_its_typed_model(planted_doc, tmp_path):
    doc, _ = planted_doc
    f = tmp_path / "m.json"
    f.write_text(json.dumps(doc.model_dump(by_alias=True)))
    again = load_matrix_document(f)
    assert again == doc
    raw = json.loads(f.read_text())
    raw["pairs"][0]["sender"]["rank"] = 2  # a pair that does not match its ends
    f.write_text(json.dumps(raw))
    with pytest.raises(UsageError, match=r"pairs\[0\].*does not match"):
        load_matrix_document(f)


def test_wrong_data_and_a_missing_fit_are_named(tmp_path):
    recs = matrix_records({}, wrong={(2, 1): 7})
    doc = az.analyze([str(write_jsonl(tmp_path / "w.jsonl", recs))], n_boot=200)
    p = doc.pair(2, 1)
    assert [f.code for f in p.findings] == ["wrong_data", "no_fit"]
    assert p.wrong_elements == 7 * len(SIZES) and p.fit is None and p.effective_gb_s is None
    assert named(doc) == {(2, 1): ["wrong_data", "no_fit"]}


def test_records_of_two_matrices_or_of_no_matrix_are_refused(tmp_path):
    a = matrix_records({}, transport="nixl")
    b = matrix_records({}, transport="mpi")
    with pytest.raises(UsageError, match="2 different matrices"):
        az.analyze([str(write_jsonl(tmp_path / "ab.jsonl", a + b))], n_boot=200)
    plain = rounds_records(SIZES, 1.0, 1.0)
    with pytest.raises(UsageError, match="no matrix records"):
        az.analyze([str(write_jsonl(tmp_path / "p.jsonl", plain))], n_boot=200)


# ---------------------------------------------------------------------------
# the command: files, lines, exit status


def test_report_writes_four_files_and_names_the_pairs(planted_doc, tmp_path):
    _, src = planted_doc
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path), "--expect-link",
                "tcp", "--bootstrap", "200")
    assert r.returncode == 0, r.stderr
    files = sorted(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".csv", ".json", ".md", ".png"]
    assert files[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(files[0].open()))
    assert len(rows) == 6 and {(r["sender_host"], r["receiver_host"]) for r in rows
                               if r["findings"]} == {("n2", "n1"), ("n1", "n3")}
    md = files[2].read_text()
    assert "**SLOW** [1,0] n2 -> n1" in md and "**PATH** [0,2] n1 -> n3" in md
    assert "slow" in r.stdout and "path_differs" in r.stdout and r.stderr == ""


def test_an_unmet_expected_link_fails_with_one_line_per_pair(planted_doc, tmp_path):
    _, src = planted_doc
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path), "--expect-link",
                "rdma", "--bootstrap", "200")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 6 and all("expect_link: expected the bytes on rdma" in ln for ln in lines)
    assert any(ln.startswith("kvbench matrix: error: pair [1,0] n2 -> n1:") for ln in lines)


EMULATED_ROWS = [{"endpoint": "kv-0 intra-node cfg#1", "range": "0..inf",
                  "operation": "remote memory write by ucp_put* from host memory to host",
                  "protocol": "software emulation", "transport": "tcp/eth0"}]


@pytest.mark.parametrize("ucx_env, cause", [({"UCX_TLS": "tcp,self"}, "cause (ucx-tls)"),
                                            ({}, "cause: not recognised")])  # planted: no TLS
def test_matrix_names_an_emulated_path_and_its_cause(tmp_path, ucx_env, cause):
    recs = matrix_records({}, hosts=["n1", "n2", "n2"])
    for rec in recs:
        if rec["pair"] == [1, 2]:  # within n2, its KV rows: UCX's software emulation over TCP
            rec["transport_info"] = {"path": ETH0, "nixl_op": "write", "ucx_env": ucx_env,
                                     "ucx_protocols": EMULATED_ROWS}
    src = write_jsonl(tmp_path / "e.jsonl", recs)
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path / "o"),
                "--expect-link", "tcp", "--bootstrap", "200")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()  # only the emulated pair fails: tcp was expected
    assert len(lines) == 1 and lines[0].startswith("kvbench matrix: error: pair [1,2]")
    assert "software emulation" in lines[0] and cause in lines[0]
    assert ("ucx-tls" in lines[0]) == bool(ucx_env)  # UCX_TLS left out shared memory
    assert "UCX RMA write (host->host, the KV's memory): tcp/eth0" in lines[0]


def test_outliers_fail_the_run_only_when_asked(planted_doc, tmp_path):
    _, src = planted_doc
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path),
                "--fail-on-outliers", "--bootstrap", "200")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 2


@pytest.mark.parametrize("args, needle", [
    (["--slow-fraction", "1.5"], "--slow-fraction"),
    (["--expect-link", "fiber"], "--expect-link"),
    (["--out", ""], "empty path"),
])
def test_bad_report_input_is_one_line_and_exit_2(planted_doc, tmp_path, args, needle):
    _, src = planted_doc
    r = run_cli("kvbench.matrix", "report", str(src), *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_measure_mode_refuses_before_mpi_starts():
    import os

    r = run_cli("kvbench.matrix", "--bytes", "1M")  # no launcher: no MPI singleton started
    assert r.returncode == 2 and "run it under MPI with 2 or more ranks" in r.stderr
    launched = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"}  # what mpirun sets (not started)
    for bad_flag in (["--pattern", "sequential"], ["--no-write"]):
        r = run_cli("kvbench.matrix", *bad_flag, env=launched)
        assert r.returncode == 2 and "kvbench matrix runs the matrix pattern" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("kvbench.matrix", "--slow-fraction", "0", env={**launched, "OMPI_COMM_WORLD_RANK": "1"})
    assert r.returncode == 2 and r.stderr == ""  # rank 1 is silent: rank 0 says it


# ---------------------------------------------------------------------------
# plan and export read a matrix: the slowest pair, or a named one


@pytest.fixture(scope="module")
def matrix_file(planted_doc, tmp_path_factory) -> Path:
    doc, _ = planted_doc
    f = tmp_path_factory.mktemp("mf") / "m.json"
    f.write_text(json.dumps(doc.model_dump(by_alias=True)))
    return f


def _plan(*args):
    r = run_cli("kvbench.plan", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_plan_takes_the_slowest_pair_of_a_matrix(matrix_file, planted_doc):
    doc, _ = planted_doc
    plan, err = _plan("--fit", str(matrix_file), "--prompt-tokens", "2000")
    slow = doc.pair(1, 0)
    assert plan["rows"][0]["link"].startswith("pair [1,0] n2 -> n1")
    assert "the slowest of 6 fitted pairs" in err
    kv = 2000 * 327_680  # the default model's bytes
    floor = max(slow.setup_ms, 0) + kv / (slow.effective_gb_s * 1e9) * 1e3
    assert plan["rows"][0]["handoff_floor_ms"] == pytest.approx(floor, rel=1e-4)


def test_plan_and_export_take_a_named_pair(matrix_file, planted_doc):
    doc, _ = planted_doc
    plan, err = _plan("--fit", str(matrix_file), "--pair", "0,1", "--prompt-tokens", "2000")
    assert plan["rows"][0]["link"].startswith("pair [0,1] n1 -> n2") and "named" in err
    r = run_cli("kvbench.plan", "export", "--fit", str(matrix_file), "--pair", "2,1", "--to", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["effective_gb_s"] == doc.pair(2, 1).effective_gb_s
    assert out["context"]["group"]["pair"] == [2, 1]


@pytest.mark.parametrize("args, needle", [
    (["--pair", "0,0"], "no pair [0, 0]"),
    (["--pair", "7,1"], "no pair [7, 1]"),
    (["--pair", "a,b"], "--pair expects"),
])
def test_plan_refuses_a_pair_the_matrix_does_not_hold(matrix_file, args, needle):
    r = run_cli("kvbench.plan", "--fit", str(matrix_file), *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_pair_is_refused_with_a_plain_fit_or_a_given_rate(tmp_path):
    fit = tmp_path / "f.fit.json"
    r = run_cli("kvbench.fit", str(write_jsonl(tmp_path / "p.jsonl", rounds_records(SIZES, 1, 1))),
                "--out", str(fit), "--bootstrap", "200")
    assert r.returncode == 0, r.stderr
    r = run_cli("kvbench.plan", "--fit", str(fit), "--pair", "0,1")
    assert r.returncode == 2 and "is not one" in r.stderr
    r = run_cli("kvbench.plan", "--gbps", "10", "--pair", "0,1")
    assert r.returncode == 2 and "--pair picks a pair" in r.stderr


def test_pair_choice_parses():
    assert parse_pair_choice(None) is None and parse_pair_choice("slowest") is None
    assert parse_pair_choice("3,0") == (3, 0)
    with pytest.raises(UsageError):
        parse_pair_choice("3")


@pytest.mark.parametrize("flags, needle", [
    (["--baseline"], "--baseline times ranks 0 and 1 only"),
    (["--transport", "nixl", "--nixl-engine-profile", "vllm-0.32"], "--nixl-engine-profile"),
])
def test_the_pattern_refuses_what_it_cannot_measure(flags, needle):
    from kvbench.p2p import args as p2p
    from kvbench.p2p.patterns.matrix import Matrix

    ns = p2p.build_parser().parse_args(["--pattern", "matrix", *flags])
    assert needle in Matrix.layout_error(ns, 3, None)
    assert Matrix.layout_error(p2p.build_parser().parse_args([]), 1, None) is not None


# ---------------------------------------------------------------------------
# each pair's own path: UCX tables tied to a peer, NCCL connections of a pair


def _row(cfg: str, op: str, transport: str) -> dict:
    return {"endpoint": f"kv-0 inter-node cfg#{cfg}", "operation": op, "range": "0..inf",
            "protocol": "zero-copy", "transport": transport}


PUT = "remote memory write by ucp_put* from host memory to host"
AM = "active message by ucp_am_send* from host memory"


def test_a_peers_path_is_its_configurations_rows_whenever_printed():
    from kvbench.p2p.transports.ucx_info import peer_rows, summarize_path

    cfg1 = [_row("1", PUT, "tcp/eth0")]
    cfg2 = [_row("2", PUT, "tcp/eth1")]
    late_am = [_row("2", AM, "tcp/eth1")]  # printed later, at the first notification
    every = cfg1 + cfg2 + late_am
    rows, how = peer_rows(cfg2, every, "write")
    assert how == "printed while connecting to the peer"
    assert summarize_path(rows, "write") == ("RMA write: tcp/eth1 (zero-copy); notifications "
                                             "(AM): tcp/eth1")
    # nothing printed with this peer: known only when the rank used one configuration
    assert peer_rows([], cfg1, "write")[1] == "the only endpoint configuration this rank used"
    rows, how = peer_rows([], every, "write")
    assert rows == [] and how.startswith("ambiguous: the endpoint reused one of 2")
    assert peer_rows([], [], "write") == ([], "UCX reported no protocol selection")
    # a read-mode run's tables do not answer a write question
    assert peer_rows([_row("3", "remote memory read by ucp_get*", "tcp/eth0")], [], "write")[0] == []


def test_read_complete_lines_leaves_a_line_being_written(tmp_path):
    from kvbench.p2p.transports.ucx_info import read_complete_lines

    f = tmp_path / "ucx.log"
    f.write_bytes(b"one\ntwo\npart")
    text, at = read_complete_lines(f, 0)
    assert text == "one\ntwo\n" and at == 8
    f.write_bytes(b"one\ntwo\npartial\n")
    assert read_complete_lines(f, at) == ("partial\n", 16)
    assert read_complete_lines(tmp_path / "none", 5) == ("", 5)


def test_nccl_connections_of_one_pair():
    from kvbench.links import nccl_log
    from tests.conftest import ROOT

    log = nccl_log.parse((ROOT / "tests/data/nccl/nccl-2.21-net-ib-gdrdma.log").read_text())
    there, back = log.for_pair(0, 1), log.for_pair(1, 0)
    assert {(c.src, c.dst) for c in there.connections} == {(0, 1)}
    assert {(c.src, c.dst) for c in back.connections} == {(1, 0)}
    assert there.path().startswith("NET/IB/0/GDRDMA") and there.version == log.version
    assert log.for_pair(0, 2).path() is None  # no connection logged: no path claimed


def test_the_committed_cluster_run_judged_again(tmp_path):
    """The records of a real Slurm run over three nodes in network namespaces
    (benchmarks/matrix_cluster.py, published in results/matrix-20261206, copied to
    tests/data/runs); judged again, the same two pairs, and no other."""
    from tests.conftest import committed

    src = sorted(committed("tests/data/runs/matrix-20261206").glob("kvbench-p2p-*.jsonl"))
    doc = az.analyze([str(p) for p in src], expect_link="tcp", n_boot=1000)
    assert named(doc) == {(1, 0): ["slow"], (0, 2): ["path_differs"]}
    assert doc.pair(1, 0).effective_gb_s == pytest.approx(0.4e9 / 8 / 1e9 * 8948 / 9014, rel=0.10)
    assert "tcp/eth1" in doc.pair(0, 2).path and doc.pair(0, 2).sender.host == "n1"
