"""The matrix at scale without MPI (issue 43 group 6, issue 44): labels bounded at any world
size, each records file read once, a refused `plan export` of a matrix pair is one line, the
slow-pair rule linear in pairs with the old rule's verdicts, the report readable at many
ranks. Records are synthetic and go through the real fit and report; the real jobs are in
tests/matrix/test_matrix_mpi.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.records.schema.p2p import HandoffSpec
from tests.conftest import run_cli
from tests.helpers import rounds_records, write_jsonl
from tests.matrix.helpers import ETH0, SIZES

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


# ---------------------------------------------------------------------------
# the slow-pair rule from sorted arrays gives the old rule's verdicts


def old_slow_pairs(entries: list[dict], fraction: float) -> dict[tuple, str]:
    """The rule before issue 44 (two medians of a rebuilt list per pair: O(P^2 log P)), kept
    as the reference the new one is held to."""
    import statistics

    from kvbench.matrix.analyze import fmt_ci

    rated = [e for e in entries if e.get("effective_gb_s") is not None]
    out = {}
    for e in rated:
        ci = e.get("effective_gb_s_ci95")
        others = [o for o in rated if o is not e]
        lows = [o["effective_gb_s_ci95"][0] for o in others
                if o.get("effective_gb_s_ci95") and o["effective_gb_s_ci95"][0] is not None]
        if not ci or ci[1] is None or not lows:
            continue
        ref_lo = statistics.median(lows)
        ref = statistics.median(o["effective_gb_s"] for o in others)
        rate = e["effective_gb_s"]
        if ci[1] < ref_lo and rate < fraction * ref:
            out[tuple(e["pair"])] = (
                f"{rate:.4g} GB/s {fmt_ci(ci)} is below the other {len(others)} pairs beyond "
                f"the intervals (their median {ref:.4g} GB/s, median lower end {ref_lo:.4g}): "
                f"{rate / ref:.0%} of their median")
    return out


def planted_entries(n: int, seed: int) -> list[dict]:
    """A matrix of n ranks with slow, borderline, tied, unrated and interval-less pairs."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        for r in range(n):
            if s == r:
                continue
            rate = float(rng.choice([1.0, 1.0, 0.98, 0.05, 0.75, 0.85, 2.0]))  # ties on purpose
            half = float(rng.choice([0.01, 0.05, 0.3]))
            ci = [rate - half, rate + half]
            kind = rng.integers(0, 12)
            if kind == 0:
                rate, ci = None, None  # not fitted
            elif kind == 1:
                ci = None  # no interval
            elif kind == 2:
                ci = [rate - half, None]  # unbounded above
            elif kind == 3:
                ci = [1.0 - half, 1.0 - half]  # an interval on another pair's bounds: ties
            out.append({"pair": [s, r], "effective_gb_s": rate, "effective_gb_s_ci95": ci})
    return out


@pytest.mark.parametrize("n, seed", [(2, 0), (3, 1), (4, 2), (5, 3), (8, 4), (9, 5), (16, 6),
                                     (17, 7)])
@pytest.mark.parametrize("fraction", [0.5, 0.8, 0.9])
def test_the_sorted_rule_names_what_the_old_rule_named(n, seed, fraction):
    from kvbench.matrix.analyze import slow_pairs

    es = planted_entries(n, seed)
    assert slow_pairs(es, fraction) == old_slow_pairs(es, fraction)


def test_the_comparison_can_fail(monkeypatch):
    """A planted fault: the pair's own value left among 'the others' changes some verdict."""
    from kvbench.matrix import analyze

    monkeypatch.setattr(analyze.Sorted, "median_without",
                        lambda self, x: analyze.Sorted._at_median(len(self.v), self.v.__getitem__))
    assert any(analyze.slow_pairs(es, f) != old_slow_pairs(es, f)
               for es in (planted_entries(n, n) for n in (2, 3, 4, 5)) for f in (0.5, 0.8, 0.9))


# ---------------------------------------------------------------------------
# the pairs' draws beside the document: plan --pair reads them at any N


def _plan_rows(doc: Path, pair: str) -> list[dict]:
    r = run_cli("kvbench.plan", "--fit", str(doc), "--pair", pair, "--format", "json",
                "--prompt-tokens", "500,4000")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["rows"]


def test_plan_reads_a_pairs_draws_from_the_draws_file_as_from_an_inline_document(tmp_path):
    from kvbench.fit.fitting import dumps
    from kvbench.matrix import analyze as az
    from tests.matrix.helpers import ODD, PLANTED, matrix_records

    src = write_jsonl(tmp_path / "run.jsonl", matrix_records(PLANTED, ODD))
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path / "side"),
                "--bootstrap", "200", "--draws", "file")
    assert r.returncode == 0, r.stderr
    side = next((tmp_path / "side").glob("kvbench-matrix-*.json"))
    raw = json.loads(side.read_text())
    assert raw["draws_file"]["file"] == side.name.removesuffix(".json") + ".draws.npy"
    assert raw["draws_file"]["shape"] == [6, 200, 2]
    assert all(p["fit"]["draws"] is None and p["draws_row"] is not None
               and "hosts" not in p["fit"]["group"] for p in raw["pairs"])
    inline = tmp_path / "inline.json"  # the same analysis, draws inline as before
    inline.write_text(dumps(az.analyze([str(src)], n_boot=200).model_dump(by_alias=True)))
    assert json.loads(inline.read_text())["pairs"][0]["fit"]["draws"]["values"]
    for pair in ("1,0", "0,2"):  # the file holds the draws unrounded: the same to 6 digits
        a, b = _plan_rows(side, pair), _plan_rows(inline, pair)
        assert a[0]["handoff_floor_ms_band95"] and len(a) == len(b) == 2
        for x, y in zip(a, b, strict=True):
            assert x["handoff_floor_ms_band95"] == pytest.approx(y["handoff_floor_ms_band95"],
                                                                 rel=1e-5)
            assert {k: v for k, v in x.items() if "band" not in k} == \
                {k: v for k, v in y.items() if "band" not in k}


def test_a_missing_or_foreign_draws_file_is_one_line(tmp_path):
    import numpy as np

    from tests.matrix.helpers import matrix_records

    src = write_jsonl(tmp_path / "run.jsonl", matrix_records({}))
    r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path), "--bootstrap", "100",
                "--draws", "file")
    assert r.returncode == 0, r.stderr
    doc = next(tmp_path.glob("kvbench-matrix-*.json"))
    npy = doc.with_name(doc.name.removesuffix(".json") + ".draws.npy")
    npy.replace(tmp_path / "kept.npy")
    for planted, needle in ((None, "is missing"), (np.ones((2, 100, 2)), "not this matrix's"),
                            (np.full((6, 100, 2), np.inf), "not finite")):
        if planted is not None:
            np.save(npy, planted)
        r = run_cli("kvbench.plan", "--fit", str(doc), "--pair", "0,1")
        assert r.returncode == 2 and needle in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------
# a report a person can read at many ranks


def big_doc(n: int, per_node: int, slow=((77, 3),), odd=((5, 70),)):
    """A typed matrix document of n ranks (every pair at ~1 GB/s, `slow` at 5%, `odd` on
    another path), built without fitting: the report reads documents only."""
    from kvbench.records.schema.matrix import MatrixDocument

    hosts = [f"node-{r // per_node:02d}" for r in range(n)]
    pairs = []
    for s in range(n):
        for r in range(n):
            if s == r:
                continue
            rate = 0.05 if (s, r) in slow else 1.0 + 0.001 * ((s * 7 + r) % 10)
            findings = ([{"code": "slow", "message": "planted"}] if (s, r) in slow else []) + \
                ([{"code": "path_differs", "message": "planted"}] if (s, r) in odd else [])
            pairs.append({"pair": [s, r], "sender": {"rank": s, "host": hosts[s]},
                          "receiver": {"rank": r, "host": hosts[r]},
                          "same_host": hosts[s] == hosts[r], "path": ETH0, "link": "tcp",
                          "n_records": 2, "effective_gb_s": rate,
                          "effective_gb_s_ci95": [rate * 0.99, rate * 1.01],
                          "findings": findings})
    return MatrixDocument.model_validate({
        "schema": "kvbench.matrix/1", "created": "2026-12-06T00:00:00Z", "inputs": ["x"],
        "transport": "nixl", "world_size": n, "hosts": hosts,
        "rules": {"slow": "planted", "slow_fraction": 0.8, "path": "planted"},
        "pairs": pairs, "verdict": "planted"})


def test_the_markdown_at_many_ranks_leads_with_findings_and_summarises_nodes():
    from kvbench.matrix.report import csv_table, markdown

    doc = big_doc(80, 8)
    md = markdown(doc)
    lines = md.splitlines()
    first_finding = next(k for k, x in enumerate(lines) if x.startswith("- **"))
    assert first_finding < 6  # right after the verdict
    assert "**SLOW** [77,3] node-09 -> node-00" in md and "**PATH** [5,70] node-00 -> node-08" in md
    assert "## Nodes" in md and "## Effective GB/s" not in md  # no 80-column grid
    assert "| node-09 | 72..79 (8) |" in md
    rows = [x for x in lines if x.startswith("| [")]
    assert "## Named pairs" in md and len(rows) == 2  # the named ones only
    assert len(md) < 20_000
    assert len(csv_table(doc).splitlines()) == 80 * 79 + 1  # every pair in the CSV
    small = markdown(big_doc(6, 2, slow=((1, 0),), odd=()))
    assert "## Effective GB/s" in small  # every pair still, and the grid
    assert len([x for x in small.splitlines() if x.startswith("| [")]) == 30


def test_the_heatmap_at_many_ranks_is_by_node_with_the_named_pairs_marked(tmp_path):
    from kvbench.matrix.report import heatmap_png

    png = heatmap_png(big_doc(80, 8))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "m.png").write_bytes(png)  # (looked at by eye: tests/matrix README)
    import matplotlib.pyplot as plt

    img = plt.imread(tmp_path / "m.png")
    red = (img[..., 0] > 0.5) & (img[..., 1] < 0.2) & (img[..., 2] < 0.2)
    assert red.sum() > 100  # the frames and the list are drawn in red
