"""A pair's line in a big matrix's pairs file (kvbench.matrix.stream.pair_line): the typed
entry's JSON as pydantic writes it, the pair first, and never a non-finite number (pydantic
would write it as null; the line falls back to kvbench's writer, which refuses it)."""

from __future__ import annotations

import json
import math

import pytest

from kvbench.errors import UsageError
from kvbench.matrix.analyze import analyze
from kvbench.matrix.stream import pair_line
from kvbench.records.schema.matrix import PairEntry
from kvbench.records.write import write_records
from tests.matrix.helpers import matrix_records


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    src, _ = write_records(tmp_path_factory.mktemp("m"), matrix_records({}), "kvbench-p2p")
    doc = analyze([str(src)], n_boot=200)
    return [p.model_dump(by_alias=True) for p in doc.pairs]


def test_a_line_is_its_entry_compact_and_pair_first(entries):
    for e in entries:
        line, typed = pair_line(e)
        assert line.endswith("\n") and line.count("\n") == 1
        assert line.startswith(f'{{"pair":[{e["pair"][0]},{e["pair"][1]}],')
        assert json.loads(line) == e == typed.model_dump(by_alias=True)


def test_small_floats_and_other_scripts_read_back_the_same(entries):
    e = {**entries[0], "path": "UCX RMA write: tcp/eth0 — café", "wireup_ms": 1e-05,
         "setup_ms": -3.0e-7}
    line, _ = pair_line(e)
    back = json.loads(line)
    assert back["path"] == e["path"] and back["wireup_ms"] == 1e-05
    assert back["setup_ms"] == -3.0e-7 and PairEntry.model_validate(back) == PairEntry.model_validate(e)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_number_in_an_open_part_is_refused_not_written_as_null(entries, bad):
    e = json.loads(json.dumps(entries[0]))
    e["fit"]["spec"] = {**e["fit"]["spec"], "planted": bad}  # (the fit's spec is any JSON)
    PairEntry.model_validate(e)  # the model takes it: only the writer can refuse it
    with pytest.raises(UsageError, match="non-finite number at .*planted"):
        pair_line(e)


def test_a_string_that_names_nan_is_written_as_text(entries):
    e = json.loads(json.dumps(entries[0]))
    e["fit"]["spec"] = {**e["fit"]["spec"], "note": "NaN and Infinity, as words"}
    line, _ = pair_line(e)
    assert json.loads(line)["fit"]["spec"]["note"] == "NaN and Infinity, as words"
