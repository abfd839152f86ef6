"""kvbench fit reads its records as a stream of typed lines, with bounded work per line and per
sample: the schema's fast path, the spec check, merged units for files of many runs, and the
exact resampled medians of large sizes. Committed fits must come out unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.cli import UsageError
from kvbench.fit.data import MAX_UNITS
from kvbench.fit.stats import GroupSamples, grid_medians, unit_counts, weighted_medians
from kvbench.records.schema.p2p import P2PRecord, parse_p2p_line
from kvbench.records.schema.read import plain_line
from kvbench.records.schema.types import parse_line_fast
from tests.conftest import committed, run_cli
from tests.fit.helpers import fit as run_fit
from tests.fit.helpers import near
from tests.helpers import SPEC, rounds_records, write_jsonl


def _hex_exponent_records() -> list[dict]:
    """Records whose spec_id holds 'e' and three digits (e.g. '91e013...'): such ids once sent
    every line to the slow path, as if they were a number's exponent."""
    import re

    for i in range(2000):
        spec = dict(SPEC, hosts=[f"node-{i}", f"node-{i}"])
        recs = rounds_records([1 << 20, 1 << 22, 1 << 24], 0.3, 2.0, spec=spec, hosts=spec["hosts"])
        if re.search(r"e\d{3}", recs[0]["spec_id"]):
            return recs
    raise AssertionError("no spec_id with an e-digit run found")


def _line(rec: dict, **extra) -> bytes:
    return json.dumps({**rec, **extra}, separators=(",", ":")).encode()


def test_fast_path_reads_real_records_and_refuses_what_the_careful_path_refuses():
    rec = _hex_exponent_records()[0]
    raw = _line(rec)
    assert plain_line(raw)
    fast = parse_line_fast(P2PRecord, raw)  # extra keys (gbps, env, argv ...) counted once
    assert fast is not None and fast.spec_id == rec["spec_id"]
    # planted: a number out of range in a kept extra key, and a key given twice
    huge = raw[:-1] + b',"peak_rss_bytes":[1e400]}'
    assert not plain_line(huge) and parse_line_fast(P2PRecord, huge) is None
    with pytest.raises(UsageError, match=r"f\.jsonl:3: number 1e400 is out of range"):
        parse_p2p_line(huge, "f.jsonl:3")
    twice = raw[:-1] + b',"gbps":1.0,"gbps":2.0}'
    assert parse_line_fast(P2PRecord, twice) is None
    with pytest.raises(UsageError, match="duplicate key 'gbps'"):
        parse_p2p_line(twice, "f.jsonl:4")


def test_an_edited_spec_is_refused_on_every_line_not_only_the_first(tmp_path):
    recs = rounds_records([1 << 20, 1 << 22], 0.3, 2.0)
    edited = json.loads(json.dumps(recs[1]))
    edited["spec"]["hosts"] = ["node-b", "node-b"]  # the spec_id still names node-a's spec
    p = write_jsonl(tmp_path / "edited.jsonl", [recs[0], recs[1], edited])
    res = run_cli("kvbench.fit", str(p), "--out", str(tmp_path / "f.json"))
    assert res.returncode == 2 and "edited.jsonl:3: spec_id" in res.stderr
    assert "is not the hash of spec" in res.stderr and not (tmp_path / "f.json").exists()


@pytest.mark.parametrize("seed", range(6))
def test_grid_medians_equal_the_weighted_medians_exactly(seed):
    rng = np.random.default_rng(seed)
    for _ in range(8):
        n, u, b = int(rng.integers(1, 4000)), int(rng.integers(1, 300)), int(rng.integers(1, 50))
        vals = np.sort(np.round(rng.lognormal(size=n), int(rng.integers(0, 3))))  # with ties
        units = rng.integers(0, u, n)
        counts = rng.multinomial(u, np.full(u, 1 / u), size=b).astype(np.int32)
        counts[0, :] = 0  # a draw without samples of this size: NaN in both
        want = weighted_medians(vals, counts[:, units])
        assert np.array_equal(grid_medians(vals, units, counts), want, equal_nan=True)


def test_many_units_are_drawn_with_the_multinomial_distribution():
    m = 3000
    g = GroupSamples(np.full(m, 1 << 20), np.ones(m), np.arange(m), np.zeros(m, dtype=int),
                     ["rounds"])
    counts = unit_counts(g, 400, np.random.default_rng(0))
    assert counts.shape == (400, m) and np.all(counts.sum(axis=1) == m)
    assert counts.mean() == pytest.approx(1.0) and counts.var() == pytest.approx(1 - 1 / m, rel=0.02)


def test_a_file_of_many_runs_resamples_merged_runs_of_adjacent_rounds(tmp_path):
    runs, rounds, sizes = 300, 10, [1 << 20, 1 << 22, 1 << 24]
    recs = []
    for r in range(runs):
        recs += rounds_records(sizes, 0.3, 2.0, rounds=rounds, seed=r, run_id=f"run-{r}")
    doc, _ = run_fit(tmp_path, recs, boot=200)
    (g,) = doc["groups"]
    assert g["n_samples"] == runs * rounds * len(sizes)
    merged = g["resampling"]["units_merged"]
    assert merged == {"units_read": runs * rounds, "units_resampled": runs * rounds // 2,
                      "max_units_per_stratum": MAX_UNITS}
    assert g["resampling"]["n_rounds"] == runs * rounds // 2
    assert near(2.0, g["effective_gb_s_ci95"]) and g["effective_gb_s"] == pytest.approx(2.0, rel=0.01)


def _comparable(doc: dict) -> dict:
    doc = {k: v for k, v in doc.items() if k not in ("created", "inputs")}
    doc["groups"] = [{k: v for k, v in g.items() if k != "sources"} for g in doc["groups"]]
    return doc


@pytest.mark.parametrize("fit_json", ["tests/data/runs/mixed-folder/fit.json",
                                      "tests/data/runs/shaped-link/kvbench-p2p-20261203T092334Z.fit.json"])
def test_refit_of_committed_records_is_unchanged(tmp_path, fit_json):
    """The committed kvbench.fit/2 files, written by the fit before it streamed, come out again
    field for field (every draw included) from their committed inputs."""
    kept_path = committed(str(Path(fit_json).parent)) / Path(fit_json).name
    kept = json.loads(kept_path.read_text())
    out = tmp_path / "refit.json"  # the inputs are named as published (results/...): found beside it
    res = run_cli("kvbench.fit", *(str(kept_path.parent / Path(p).name) for p in kept["inputs"]),
                  "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert _comparable(json.loads(out.read_text())) == _comparable(kept)


def _nudged_copy(src: Path, dst: Path, rng: np.random.Generator) -> None:
    """src's records with every sample moved by 1 to 4 units in the last place, up or down: what
    another CPU's arithmetic could make of the same run (BLAS kernels, fused multiply-adds)."""
    lines = []
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        if isinstance(rec.get("samples_ms"), list):
            v = np.asarray(rec["samples_ms"], dtype=float)
            ulps = rng.integers(1, 5, v.size) * rng.choice([-1.0, 1.0], v.size)
            rec["samples_ms"] = (v + ulps * np.spacing(v)).tolist()
        lines.append(json.dumps(rec))
    dst.write_text("\n".join(lines) + "\n")


# What the fit writes may move under last-bit noise in its inputs: one unit in the last digit
# it writes (a value at a rounding boundary), never more. residual_rel is written with 4
# significant digits, the rest of the document's floats with 6 (draws included).
_WRITTEN_REL = {"residual_rel": 1e-3}


def _within_written_precision(a, b, key: str = "") -> list[str]:
    """The paths where b differs from a by more than the written precision allows; a value
    written as zero must stay exactly zero (rounding noise is not data)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [p for k in a for p in _within_written_precision(a[k], b[k], k)]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for x, y in zip(a, b, strict=True) for p in _within_written_precision(x, y, key)]
    if isinstance(a, float) and isinstance(b, float) and a != 0.0 and b != 0.0:
        return [] if abs(a - b) <= _WRITTEN_REL.get(key, 1e-5) * abs(a) else [f"{key}: {a} -> {b}"]
    return [] if a == b else [f"{key}: {a!r} -> {b!r}"]


@pytest.mark.parametrize("fit_json", ["tests/data/runs/mixed-folder/fit.json",
                                      "tests/data/runs/shaped-link/kvbench-p2p-20261203T092334Z.fit.json"])
def test_refit_under_last_bit_noise_moves_no_more_than_the_written_precision(tmp_path, fit_json):
    """Issue 39: a residual of rounding noise (a line through two sizes) was written as data
    (-1.255e-15 on one machine, -7.845e-16 on another), so the refit above failed on any machine
    but the one that wrote the file. Inputs moved at the last bit must leave the written fit
    within one unit of its last written digit, and every zero residual exactly zero."""
    kept_path = committed(str(Path(fit_json).parent)) / Path(fit_json).name
    kept = json.loads(kept_path.read_text())
    rng = np.random.default_rng(39)
    inputs = []
    for p in kept["inputs"]:
        inputs.append(tmp_path / Path(p).name)
        _nudged_copy(kept_path.parent / Path(p).name, inputs[-1], rng)
    out = tmp_path / "refit.json"
    res = run_cli("kvbench.fit", *map(str, inputs), "--out", str(out))
    assert res.returncode == 0, res.stderr
    moved = _within_written_precision(_comparable(kept), _comparable(json.loads(out.read_text())))
    assert moved == [], moved[:10]
