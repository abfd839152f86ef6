"""kvbench matrix under a real mpirun on this host (MPI transport, host memory): with 4 ranks
every ordered pair measured with the p2p engine and its data check, two pairs at a time, each
with its own samples, records naming their pair, the matrix written beside them; a corrupted
payload (3 ranks, one pair at a time) fails every pair by name; a bad flag is one line from one
rank. Paths and rates of a real multi-node matrix: test_matrix_cluster.py."""

from __future__ import annotations

import json

import pytest

from kvbench.records.schema.job import whole_dicts
from tests.conftest import run_cli, run_mpi

pytestmark = pytest.mark.mpi

RUN = ("kvbench.matrix", "--device", "cpu", "--transport", "mpi", "--bytes", "64K,256K,1M",
       "--iters", "10", "--min-iters", "10", "--warmup", "1", "--seconds-per-point", "1",
       "--timeout", "60", "--quiet")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    r = run_mpi(4, *RUN, "--out", str(out), "--expect-link", "host", "--bootstrap", "200")
    return r, out


PAIRS4 = {(s, d) for s in range(4) for d in range(4) if s != d}


def test_every_ordered_pair_is_measured_checked_and_fitted(run):
    r, out = run
    assert r.returncode == 0, r.stderr[-3000:]
    records = [x for f in out.glob("kvbench-p2p-*.jsonl") for x in whole_dicts(f)]  # lean: made whole
    assert len(records) == 12 * 3  # 12 ordered pairs x 3 sizes
    assert {tuple(x["pair"]) for x in records} == PAIRS4
    for x in records:
        s, d = x["pair"]
        assert x["spec"]["world"] == {"size": 4, "prefill_ranks": [s], "decode_ranks": [d]}
        assert x["sender"]["rank"] == s and x["receiver"]["rank"] == d and x["wrong"] == 0
        assert x["schedule"]["name"] == "rounds" and [s, d] in x["schedule"]["pairs_in_round"]
        assert len(x["schedule"]["pairs_in_round"]) == 2  # two pairs at a time, no rank shared
        assert x["n_samples"] == 10 and x["wireup_ms"] > 0 and x["transport_info"]["path"] == "host"
        assert x["descriptors"] == 1  # one message per handoff, counted on its moving side
    # the two pairs of a round: the same rounds, each its own samples (its own critical path)
    by = {(tuple(x["pair"]), x["bytes"]): x for x in records}
    for x in records:
        other = [p for p in x["schedule"]["pairs_in_round"] if p != x["pair"]][0]
        y = by[(tuple(other), x["bytes"])]
        assert x["sample_rounds"] == y["sample_rounds"] and x["samples_ms"] != y["samples_ms"]
    doc = json.loads(next(out.glob("kvbench-matrix-*.json")).read_text())
    assert doc["schema"] == "kvbench.matrix/1" and doc["world_size"] == 4
    assert len(doc["pairs"]) == 12 and all(p["fit"]["n_samples"] == 30 for p in doc["pairs"])
    assert not any(f["code"] in ("expect_link", "wrong_data") for p in doc["pairs"]
                   for f in p["findings"])
    assert sorted(f.suffix for f in out.glob("kvbench-matrix-*")) == [".csv", ".json", ".md", ".png"]
    assert "kvbench matrix: 12 of 12 ordered pairs measured" in r.stdout


def test_the_same_records_judged_again_offline(run, tmp_path):
    _, out = run
    src = next(out.glob("kvbench-p2p-*.jsonl"))
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path), "--expect-link",
                "rdma", "--bootstrap", "200")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 12
    assert "expected the bytes on rdma" in r.stderr and "'host'" in r.stderr


def test_a_corrupted_payload_names_every_pair_and_fails(tmp_path):
    r = run_mpi(3, *RUN, "--out", str(tmp_path), "--debug-corrupt-elements", "3",
                "--schedule", "serial", "--bootstrap", "200")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvbench matrix: error: pair")]
    assert len(lines) == 6 and all("wrong_data" in ln for ln in lines)
    doc = json.loads(next(tmp_path.glob("kvbench-matrix-*.json")).read_text())
    assert all(p["wrong_elements"] and p["fit"] is None for p in doc["pairs"])
    assert doc["schedule"] == "serial"


def test_a_bad_flag_is_one_line_from_one_rank(tmp_path):
    r = run_mpi(3, *RUN, "--out", str(tmp_path), "--slow-fraction", "2")
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert errors == [errors[0]] and "--slow-fraction" in errors[0] and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
