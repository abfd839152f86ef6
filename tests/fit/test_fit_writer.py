"""The fit's JSON writer (kvbench.fit.fitting.dumps) is linear in its draws arrays and writes
exactly the bytes the quadratic one wrote (issue 44): the old writer is kept here as the
reference and both are held to the same text on every committed fit document, and the
committed documents the writer wrote come back byte for byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvbench.fit.fitting import dumps
from kvbench.records.write import dumps_json

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted({*ROOT.glob("results/**/*.fit.json"), *ROOT.glob("tests/data/**/*.fit.json")})


def old_dumps(doc: dict) -> str:
    """The writer before issue 44: one str.replace over the whole text per draws array."""
    compact: list[str] = []

    def marker(value) -> str:
        compact.append(dumps_json(value, indent=None))
        return f"@draws{len(compact) - 1}@"

    def mark(v):
        if isinstance(v, dict):
            return {k: (marker(x) if k == "draws" and x else mark(x)) for k, x in v.items()}
        return [mark(x) for x in v] if isinstance(v, list) else v

    text = dumps_json(mark(doc), indent=2)
    for i, c in enumerate(compact):
        text = text.replace(f'"@draws{i}@"', c, 1)
    return text


def test_there_are_committed_fits_with_draws():
    assert len(COMMITTED) >= 5
    assert any('"draws": {' in p.read_text() for p in COMMITTED)


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_writer_writes_what_the_old_one_wrote(path):
    text = path.read_text()
    doc = json.loads(text)
    new = dumps(doc)
    assert new == old_dumps(doc)
    if text.startswith("{\n"):  # written by kvbench fit (a few were saved as one compact line)
        assert new + "\n" == text


def test_many_groups_and_a_marker_like_text_keep_their_bytes():
    rng = np.random.default_rng(0)
    groups = [{"label": f"g{i} @draws{i}@", "draws": {"columns": ["setup_ms", "ms_per_gb"],
                                                   "values": rng.random((5, 2)).round(6).tolist()},
               "sizes": [{"draws": None}]} for i in range(300)]
    doc = {"schema": "kvbench.fit/2", "groups": groups, "note": '"@draws7@"'}
    assert dumps(doc) == old_dumps(doc)
    assert json.loads(dumps(doc)) == doc


def test_draws_are_rounded_as_each_value_was():
    from kvbench.fit.fitting import DRAW_DIGITS, draw_rows

    def _r(x, nd):  # the rule the fit writes every number by: nd significant digits, None if not finite
        return float(f"{x:.{nd}g}") if math.isfinite(x) else None

    rng = np.random.default_rng(1)
    d = np.column_stack([rng.normal(1, 0.01, 5000), rng.lognormal(0, 3, 5000)])
    d[::7] *= -1
    d[:4] = [[0.0, 1e-300], [5e-324, 1e300], [-0.0, 1e-5], [123456.5, 0.1234565]]
    want = [[_r(a, DRAW_DIGITS), _r(b, DRAW_DIGITS)] for a, b in d]
    assert json.dumps(draw_rows(d)) == json.dumps(want)
    d[9, 1] = np.nan  # not finite: None, as _r writes it
    assert draw_rows(d)[9] == [want[9][0], None]
