"""The matrix at scale without MPI (issue 43 group 6, issue 44): labels bounded at any world
size, each records file read once, a refused `plan export` of a matrix pair is one line, the
slow-pair rule linear in pairs with the old rule's verdicts, the report readable at many
ranks. Records are synthetic and go through the real fit and report; the real jobs are in
tests/matrix/test_matrix_mpi.py."""

from __future__ import annotations

import json

from kvbench.p2p.spec import HandoffSpec
from tests.conftest import run_cli
from tests.fit.test_fit import rounds_records, write_jsonl
from tests.matrix.test_matrix import ETH0, SIZES

BIG = 500  # ranks: every host in the label was about 500 x 23 characters, over 4096


def big_world_records(pairs, n=BIG) -> list[dict]:
    """Records of a few pairs of an n-rank matrix (a part of a big job's file)."""
    hosts = [f"gpu-node-{r:04d}.cluster" for r in range(n)]
    out = []
    for k, (s, r) in enumerate(pairs):
        spec = HandoffSpec(transport="nixl", pattern="matrix", granularity="whole", layout="raw",
                           device="cpu", hosts=hosts, variant=f"{s}->{r}",
                           world={"size": n, "prefill_ranks": [s], "decode_ranks": [r]}).as_dict()
        out += rounds_records(SIZES, 1.0, 1.0, rounds=12, seed=k, spec=spec, run_id="big",
                              transport="nixl", pattern="matrix", variant=f"{s}->{r}",
                              world_size=n, hosts=hosts, pair=[s, r],
                              sender={"rank": s, "host": hosts[s]},
                              receiver={"rank": r, "host": hosts[r]},
                              transport_info={"path": ETH0, "path_source": "test"})
    return out


def test_a_500_rank_run_fits_and_reports_with_a_bounded_label(tmp_path):
    src = write_jsonl(tmp_path / "big.jsonl", big_world_records([(0, 1), (1, 0), (2, 3)]))
    r = run_cli("kvbench.fit", str(src), "--out", str(tmp_path / "f.json"), "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    labels = [g["label"] for g in json.loads((tmp_path / "f.json").read_text())["groups"]]
    assert labels and all(len(x) < 1000 for x in labels)
    assert "hosts=[500 values, 500 distinct: gpu-node-0000.cluster .. gpu-node-0499.cluster]" \
        in labels[0]
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path), "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    assert "3 of 249500 ordered pairs measured" in r.stdout


def test_report_reads_a_file_named_twice_once(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", big_world_records([(0, 1), (1, 0)], n=3))
    r = run_cli("kvbench.matrix", "report", "r.jsonl", "./r.jsonl", str(src), "--out", "o",
                "--bootstrap", "100", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("given already: read once") == 2
    doc = json.loads(next((tmp_path / "o").glob("kvbench-matrix-*.json")).read_text())
    assert [p["n_records"] for p in doc["pairs"]] == [len(SIZES)] * 2  # not counted twice
    assert doc["inputs"] == ["r.jsonl"]


def test_a_refused_export_of_a_matrix_pair_is_one_line(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", big_world_records([(0, 1), (1, 0)], n=3))
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path), "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    doc = str(next(tmp_path.glob("kvbench-matrix-*.json")))
    for cmd in (["kvbench.plan", "export", "--fit", doc, "--pair", "0,1", "--to", "json"],
                ["kvbench.plan", "--fit", doc, "--pair", "0,1"]):
        bad = run_cli(*cmd, "--model", "no-such-model")
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert bad.stderr.startswith(f"{'kvbench plan export' if 'export' in cmd else 'kvbench plan'}"
                                     ": error: unknown model")
        good = run_cli(*cmd)
        assert good.returncode == 0, good.stderr
        prog = "kvbench plan export" if "export" in cmd else "kvbench plan"
        assert good.stderr.startswith(f"{prog}: note: pair [0,1]")  # the pair still named
