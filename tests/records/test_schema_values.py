"""Readers take every value their schema lets through, or refuse it in one line (issue 25, group 4).

The values come from the schemas themselves: a hypothesis strategy walks the JSON Schema that
pydantic derives from `kvbench.records.schema` (types, bounds, lengths, required keys, unions)
and draws documents that satisfy it. The models are open (`extra="allow"`: another field a
later kvbench adds must not break an older reader), so each object also gets a few of the keys
kvbench itself writes there, with any JSON value: exactly what the schema lets through and a
reader may still read (a `timestamp` that is no date, `cpu_count` as a string, a
`lack_of_fit` that is a list). The property: `kvbench.results.load` and `kvbench report`
either take the file or refuse it with one line and exit 2; never a traceback.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvbench.report.cli
from kvbench.cli import UsageError
from kvbench.records.schema.fit import FitDocument
from kvbench.records.schema.p2p import P2PRecord
from tests.conftest import ROOT
from tests.helpers import run

P2P = ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl"
FIT = ROOT / "tests/data/runs/fit-example/kvbench-p2p-20261203T140056Z-7a0e16.fit.json"
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def _keys(doc, out: set[str]) -> set[str]:
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.add(k)
            _keys(v, out)
    elif isinstance(doc, list):
        for v in doc[:3]:
            _keys(v, out)
    return out


KNOWN_KEYS = sorted(_keys(json.loads(P2P.read_text().splitlines()[0]), set())
                    | _keys(json.loads(FIT.read_text()), set()))
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20 + 1, 10**20 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KNOWN_KEYS), inner, max_size=3),
    max_leaves=8)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values that satisfy a pydantic JSON Schema (the subset kvbench's models use)."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].split("/")[-1]], defs, depth + 1))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema.get("anyOf") or schema["oneOf"]])
    kind = schema.get("type")
    if kind is None:
        return ANY_JSON
    return _BY_TYPE[kind](schema, defs, depth)


def _number(schema, defs, depth):
    lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
    edges = [x for x in (lo, hi, 0.0, 1e-300, 5e-324, 1e300) if x is not None and
             (lo is None or x >= lo) and (hi is None or x <= hi)
             and not (x == schema.get("exclusiveMinimum"))]
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False,
                     exclude_min="exclusiveMinimum" in schema) | st.sampled_from(edges or [0.0])


def _integer(schema, defs, depth):
    lo, hi = schema.get("minimum", -10**19), schema.get("maximum", 10**19)
    return st.integers(lo, hi) | st.sampled_from([lo, hi])


def _string(schema, defs, depth):
    lo, hi = schema.get("minLength", 0), min(schema.get("maxLength", 40), 40)
    text = st.text(min_size=max(lo, 1 if "pattern" in schema else 0), max_size=hi)
    return text.filter(lambda s: not s.isspace()) if "pattern" in schema else text


def _array(schema, defs, depth):
    if "prefixItems" in schema:
        return st.tuples(*[from_schema(s, defs, depth + 1) for s in schema["prefixItems"]]).map(list)
    lo = schema.get("minItems", 0)
    hi = min(schema.get("maxItems", 3), max(lo, 3))
    return st.lists(from_schema(schema.get("items", {}), defs, depth + 1), min_size=lo, max_size=hi)


def _object(schema, defs, depth):
    props, required = schema.get("properties", {}), set(schema.get("required", []))
    fixed = {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k in required}
    optional = {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k not in required}
    extra = schema.get("additionalProperties", False)
    extras = (st.dictionaries(st.sampled_from(KNOWN_KEYS), ANY_JSON, max_size=3 if depth < 3 else 0)
              if extra is True else st.just({}))
    if isinstance(extra, dict) and not props:
        extras = st.dictionaries(st.text(min_size=1, max_size=8), from_schema(extra, defs, depth + 1), max_size=3)
    return st.builds(lambda f, o, e: {**e, **f, **o}, st.fixed_dictionaries(fixed),
                     st.fixed_dictionaries({}, optional=optional), extras)


_BY_TYPE = {"number": _number, "integer": _integer, "string": _string, "array": _array,
            "object": _object, "boolean": lambda *a: st.booleans(), "null": lambda *a: st.none()}


def documents(model) -> st.SearchStrategy:
    schema = model.model_json_schema(by_alias=True)
    return from_schema(schema, schema.get("$defs", {}))


def finite(doc) -> bool:
    return all(math.isfinite(v) for v in _floats(doc))


def _floats(doc):
    if isinstance(doc, float):
        yield doc
    elif isinstance(doc, dict):
        for v in doc.values():
            yield from _floats(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _floats(v)


def one_line_or_taken(fn) -> None:
    """fn() returns normally or raises UsageError of one line: never anything else."""
    try:
        fn()
    except UsageError as exc:
        assert "\n" not in str(exc), str(exc)


def _folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvbench-schema-values-"))


def _report(d: Path) -> None:
    rc, _, err = run(kvbench.report.cli.cli, d, "--out", d / "rep", "--quiet", "--no-refit")
    assert rc in (0, 2) and "Traceback" not in err, err[-3000:]
    assert rc == 0 or err.count("\n") == 1, err


@SETTINGS
@given(documents(FitDocument))
def test_fit_documents_the_schema_lets_through_are_read_or_refused_in_one_line(doc):
    from kvbench.results import load

    d = _folder()
    (d / "x.fit.json").write_text(json.dumps(doc))
    for what in ("fit", "fit-sizes"):
        one_line_or_taken(lambda w=what: load(d / "x.fit.json", w))
    _report(d)


@SETTINGS
@given(documents(P2PRecord))
@example({"transport": "0", "pattern": "0", "granularity": "0", "layout": "contiguous",
          "device": "cpu", "world_size": 1, "hosts": [], "bytes": 0, "iters": 0,
          "samples_ms": [], "p50_ms": 5e-324})  # a denormal p50: its rate is none, not 1/0
def test_p2p_records_the_schema_lets_through_are_read_or_refused_in_one_line(rec):
    from kvbench.results import load

    d = _folder()
    (d / "x.jsonl").write_text(json.dumps({**rec, "schema": "kvbench.p2p/1"}) + "\n")
    one_line_or_taken(lambda: load(d / "x.jsonl", "p2p"))
    _report(d)


@pytest.mark.parametrize("model", [FitDocument, P2PRecord])
def test_the_generator_draws_documents_the_schema_accepts(model):
    """The generator is only useful if its documents pass the schema (else every case would be
    a refusal); most of them must."""
    from hypothesis import find

    doc = find(documents(model), lambda d: True, settings=settings(database=None, derandomize=True))
    model.model_validate(doc)


def _p2p_with(path, value):
    rec = json.loads(P2P.read_text().splitlines()[0])
    *parents, last = path
    node = rec
    for k in parents:
        node = node[k]
    node[last] = value
    return rec


def _fit_with(key, value):
    doc = json.loads(FIT.read_text())
    doc["groups"][0][key] = value
    return doc


NAMED = [  # the values the second hostile round named, each let through by the open models
    ("x.jsonl", lambda: _p2p_with(["timestamp"], "9999-12-31T23:59:59Z")),
    ("x.jsonl", lambda: _p2p_with(["timestamp"], "not a date")),
    ("x.jsonl", lambda: _p2p_with(["timestamp"], 17)),
    ("x.jsonl", lambda: _p2p_with(["env", "cpu_count"], "8")),
    ("x.jsonl", lambda: _p2p_with(["env", "cpu_count"], 10**19)),
    ("x.jsonl", lambda: _p2p_with(["env", "host"], ["a", "b"])),
    ("x.jsonl", lambda: _p2p_with(["samples_ms"], [])),
    ("x.fit.json", lambda: _fit_with("lack_of_fit", [1, 2])),
    ("x.fit.json", lambda: _fit_with("lack_of_fit", "bad")),
    ("x.fit.json", lambda: _fit_with("resampling", [])),
    ("x.fit.json", lambda: _fit_with("no_interval", 5)),
    ("x.fit.json", lambda: _fit_with("label", ["a"])),
]


@pytest.mark.parametrize("name, make", NAMED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(NAMED)])
def test_the_named_hostile_values_are_read_or_refused_in_one_line(name, make):
    from kvbench.results import load

    d = _folder()
    doc = make()
    (d / name).write_text(json.dumps(doc) + ("\n" if name.endswith(".jsonl") else ""))
    for kind in (("p2p",) if name.endswith(".jsonl") else ("fit", "fit-sizes")):
        one_line_or_taken(lambda k=kind: load(d / name, k))
    _report(d)
