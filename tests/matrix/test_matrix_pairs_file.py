"""A big matrix's pairs beside its document (issue 44: `plan --fit DOC --pair I,J` reads the
documents of every N): beyond 240 pairs each pair's entry is a line of a .pairs.jsonl, the
.json keeps the named pairs and names the slowest fitted one, and plan reads only the line
it needs. Planted: a 17-rank synthetic matrix (benchmarks/matrix_scale.py's records: two slow
pairs and an odd path); the same analysis with every pair inline is the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.fit.fitting import dumps
from kvbench.matrix.analyze import analyze
from kvbench.records.write import write_records
from tests.conftest import run_cli
from tests.matrix.helpers import matrix_scale_module

pytestmark = pytest.mark.slow  # a 17-rank analysis and ten plans: ~90 s on 2 busy cores

N = 17  # 272 pairs: past the 240 kept inline


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs")
    bench = matrix_scale_module()
    src, _ = write_records(tmp, list(bench.records(N, 8, 12, seed=2)), "kvbench-p2p")
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp / "out"),
                "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    inline = tmp / "inline.json"  # every pair in the document, as before
    inline.write_text(dumps(analyze([str(src)], n_boot=100).model_dump(by_alias=True)))
    return {"doc": next((tmp / "out").glob("kvbench-matrix-*.json")), "inline": inline,
            "planted": bench.planted(N, 8)}


def _plan(doc: Path, *pair: str):
    return run_cli("kvbench.plan", "--fit", str(doc), *(("--pair", *pair) if pair else ()),
                   "--format", "json", "--prompt-tokens", "500,4000")


def test_the_document_keeps_the_named_pairs_and_every_pair_is_a_line_beside(big):
    raw = json.loads(big["doc"].read_text())
    side = big["doc"].with_name(big["doc"].name.removesuffix(".json") + ".pairs.jsonl")
    assert raw["pairs_file"]["file"] == side.name and raw["pairs_file"]["count"] == N * (N - 1)
    assert {tuple(p["pair"]): [f["code"] for f in p["findings"]] for p in raw["pairs"]} == \
        {p: [c] for p, c in big["planted"].items()}
    lines = side.read_text().splitlines()
    assert len(lines) == N * (N - 1) and all(x.startswith('{"pair":[') for x in lines)
    whole = json.loads(big["inline"].read_text())
    slowest = min((p for p in whole["pairs"] if p["fit"] and p["effective_gb_s"]),
                  key=lambda p: p["effective_gb_s"])
    assert raw["pairs_file"]["slowest_fitted"] == slowest["pair"]
    assert raw["pairs_file"]["n_fitted"] == sum(1 for p in whole["pairs"]
                                                if p["fit"] and p["effective_gb_s"])


@pytest.mark.parametrize("pair", [("16,0",), ("0,16",), ("3,5",), ()])
def test_plan_reads_a_pair_from_the_pairs_file_as_from_the_whole_document(big, pair):
    a, b = _plan(big["doc"], *pair), _plan(big["inline"], *pair)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ra, rb = json.loads(a.stdout)["rows"], json.loads(b.stdout)["rows"]
    assert ra[0]["handoff_floor_ms_band95"] and len(ra) == len(rb) == 2
    for x, y in zip(ra, rb, strict=True):  # the draws file is unrounded: the same to 6 digits
        assert x["handoff_floor_ms_band95"] == pytest.approx(y["handoff_floor_ms_band95"],
                                                             rel=1e-5)
        assert {k: v for k, v in x.items() if "band" not in k} == \
            {k: v for k, v in y.items() if "band" not in k}
    assert a.stderr.replace(str(big["doc"]), "DOC") == b.stderr.replace(str(big["inline"]), "DOC")


def test_a_missing_pair_or_pairs_file_is_one_line(big, tmp_path):
    r = _plan(big["doc"], "17,0")
    assert r.returncode == 2 and "no pair [17, 0]" in r.stderr, r.stderr
    copy = tmp_path / big["doc"].name
    copy.write_text(big["doc"].read_text())  # without its pairs file
    for args in (("0,1",), ()):
        r = _plan(copy, *args)
        assert r.returncode == 2 and "pairs file" in r.stderr and "is missing" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
