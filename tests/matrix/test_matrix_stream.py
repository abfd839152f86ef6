"""A big matrix's report streamed as its pairs are fitted (kvbench.matrix.stream, issue 44
items 3-4) says what the report holding every entry says: forced onto the streaming path at
a small N (a threshold of 0 pairs, chunks of 16 pairs), its document (the named pairs),
verdict, majority paths, pairs file (every line, byte for byte), CSV and Markdown are the
inline path's, its draws are the inline path's in float32, plan --pair reads it, and it
leaves no temp file. Records: benchmarks/matrix_scale.py's (two slow pairs, an odd path)
and tests/matrix/helpers' (wrong data, no fit, a link that is not the expected kind)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.errors import UsageError
from kvbench.matrix import analyze as az
from kvbench.matrix import report
from kvbench.matrix.cli import report_files
from kvbench.matrix.stream import write_streamed
from kvbench.records.write import write_records
from tests.conftest import run_cli
from tests.helpers import write_jsonl
from tests.matrix.helpers import ODD, PLANTED, matrix_records, matrix_scale_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    bench = matrix_scale_module()
    src, _ = write_records(tmp, list(bench.records(8, 4, 12, seed=1)), "kvbench-p2p")
    draws: list = []
    inline = az.analyze([str(src)], n_boot=200, draws="file", draws_out=draws)
    doc, table, files = write_streamed(az.read_run([str(src)]), [str(src)], tmp / "s",
                                       n_boot=200, chunk=16)
    return {"inline": inline, "draws": draws[0], "doc": doc, "table": table,
            "files": {f.name.split(".", 1)[1]: f for f in files}, "out": tmp / "s",
            "planted": bench.planted(8, 4)}


def test_the_document_holds_the_named_pairs_with_the_inline_verdict(both):
    doc, inline = both["doc"], both["inline"]
    assert doc.pairs == [p for p in inline.pairs if p.findings]
    assert {tuple(p.pair): [f.code for f in p.findings] for p in doc.pairs} == \
        {p: [c] for p, c in both["planted"].items()}
    assert (doc.verdict, doc.majority_path, doc.hosts) == \
        (inline.verdict, inline.majority_path, inline.hosts)
    every = [p.model_dump(by_alias=True) for p in inline.pairs]
    assert doc.pairs_file.model_dump() == {**az.pairs_file_of(every),
                                           "file": both["files"]["pairs.jsonl"].name}
    raw = json.loads(both["files"]["json"].read_text())  # what is written is the typed doc
    assert raw["pairs"] == [p.model_dump(by_alias=True) for p in doc.pairs]


def test_every_pair_is_its_inline_entry_on_its_line(both):
    lines = both["files"]["pairs.jsonl"].read_text().splitlines(keepends=True)
    want = [p.model_dump(by_alias=True) for p in both["inline"].pairs]
    assert [json.loads(x) for x in lines] == want
    # one compact line each, the pair first (what plan --pair bisects on)
    assert all(x.startswith(f'{{"pair":[{w["pair"][0]},{w["pair"][1]}],') and x.count("\n") == 1
               for x, w in zip(lines, want, strict=True))


def test_the_csv_and_markdown_are_the_inline_reports(both):
    assert both["files"]["csv"].read_text() == report.csv_table(both["inline"])
    assert both["files"]["md"].read_text() == report.markdown(both["inline"])
    assert report.rates_line(both["doc"], both["table"]) == report.rates_line(both["inline"])


def test_the_draws_are_the_inline_draws_in_float32(both):
    arr = np.load(both["files"]["draws.npy"], mmap_mode="r")
    assert arr.dtype == np.float32 and list(arr.shape) == both["doc"].draws_file.shape
    assert np.array_equal(arr, both["draws"].astype(np.float32))
    rel = np.abs(arr - both["draws"]) / np.abs(both["draws"])
    assert rel.max() < 6e-8  # float32: 24 significant bits (the schema's stated precision)
    assert not [p.name for p in both["out"].iterdir() if p.name.startswith(".")]  # no temps


def test_plan_reads_a_pair_of_the_streamed_matrix(both):
    a = run_cli("kvbench.plan", "--fit", str(both["files"]["json"]), "--pair", "1,0",
                "--format", "json", "--prompt-tokens", "500,4000")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["rows"][0]["handoff_floor_ms_band95"]
    assert "pair [1,0]" in a.stderr


def test_wrong_data_no_fit_and_links_stream_as_inline(tmp_path):
    """Every pair named (no pair is the expected rdma), one with wrong data and no fit: every
    line of the pairs file is rewritten with its findings."""
    src = write_jsonl(tmp_path / "r.jsonl", matrix_records(PLANTED, ODD, wrong={(2, 1): 7}))
    rules = {"expect_link": "rdma", "expect_local_link": None, "slow_fraction": 0.8,
             "n_boot": 100, "seed": 0, "draws": "file"}
    doc, files, table = report_files([str(src)], tmp_path / "s", rules, stream_above=0)
    assert table is not None and doc.pairs_file is not None
    inline = az.analyze([str(src)], **rules)
    assert doc.pairs == inline.pairs and doc.verdict == inline.verdict
    assert [f.code for f in doc.pair(2, 1).findings] == ["expect_link", "wrong_data", "no_fit"]
    side = next(f for f in files if f.name.endswith(".pairs.jsonl"))
    assert [json.loads(x) for x in side.read_text().splitlines()] == \
        [p.model_dump(by_alias=True) for p in inline.pairs]
    csv = next(f for f in files if f.suffix == ".csv")
    assert csv.read_text() == report.csv_table(inline)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17])
def test_plan_finds_a_pair_s_line_by_bisecting_the_pairs_file(tmp_path, n):
    """Every pair kept is found, every pair left out is not, at any line lengths; lines out
    of order are still read (in lines) by read_pairs."""
    import random

    from kvbench.records.schema.matrix import PairsFile, bisect_pair_line, read_pairs

    rng = random.Random(n)
    pairs = [(i, j) for i in range(n + 1) for j in range(n + 1) if i != j]
    keep = sorted(rng.sample(pairs, max(1, len(pairs) // 2)))
    side = tmp_path / "m.pairs.jsonl"
    side.write_text("".join(json.dumps({"pair": list(q), "pad": "x" * rng.randint(0, 300)},
                                       separators=(",", ":")) + "\n" for q in keep))
    for q in pairs:
        got = bisect_pair_line(side, q)
        assert (json.loads(got)["pair"] if got else None) == (list(q) if q in keep else None)
    side.write_text("".join(json.dumps({"pair": list(q), "x": 1}, separators=(",", ":")) + "\n"
                            for q in reversed(keep)))
    pf = PairsFile(file=side.name, count=len(keep), n_fitted=0)
    with pytest.raises(UsageError, match="line"):  # found by reading in lines, then typed
        read_pairs(tmp_path / "m.json", pf, keep[0])


_CHILD = """
import gc, importlib.util, json, sys, tracemalloc
from pathlib import Path
import kvbench.matrix.stream as st
from kvbench.matrix.analyze import read_run
from kvbench.records.write import write_records
spec = importlib.util.spec_from_file_location("b", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
out, n = Path(sys.argv[2]), int(sys.argv[3])
src, _ = write_records(out, list(bench.records(n, 8, 12, seed=5)), "kvbench-p2p")
run = read_run([str(src)])
gc.collect()
peaks = {}
keep = st.stream_pairs
def traced(*a, **k):
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    got = keep(*a, **k)
    peaks["fits"] = tracemalloc.get_traced_memory()[1] - base
    return got
st.stream_pairs = traced
tracemalloc.start()
doc, table, files = st.write_streamed(run, [str(src)], out / "r", n_boot=100)
peaks["report"] = tracemalloc.get_traced_memory()[1]
named = sorted([tuple(p.pair), [f.code for f in p.findings]] for p in doc.pairs)
print(json.dumps({"peaks": peaks, "named": named, "pairs": len(table)}))
"""


@pytest.mark.slow  # 16,256 pairs fitted (100 resamples) under tracemalloc: minutes here
def test_a_128_rank_report_stays_small_in_memory(tmp_path):
    """tracemalloc's peak of the streamed report of a 128-rank run (after its records are
    read: that is the reading's memory, not the report's): the fits and the files' writing
    hold a chunk of pairs and a row of numbers per pair (under 48 MiB; every entry held,
    as the inline path does, is ~5 KB a pair: ~80 MiB here, ~5 GB at N = 1,024), and the
    whole report with its picture under 400 MiB (matplotlib's canvas, the same at any N)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "benchmarks" /
                                                          "matrix_scale.py"), str(tmp_path),
                        "128"], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(got["peaks"])
    assert got["pairs"] == 128 * 127
    assert {tuple(p): c for p, c in got["named"]} == \
        {p: [c] for p, c in matrix_scale_module().planted(128, 8).items()}
    assert got["peaks"]["fits"] < 48 * 2**20
    assert got["peaks"]["report"] < 400 * 2**20
