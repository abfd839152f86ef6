"""The fuzzing machinery the hostile-input tests share (hypothesis, deterministic): mutate a valid
document the way a hostile tester would, and the property every reader must keep.

A mutation swaps a value for NaN, an infinity, a 10^400 or 5,000-digit integer, a denormal, a
negative, a string or bool where a number was, 500-deep nesting, deletes a key or adds an unknown
one, gives a key twice, or cuts the text short. `check` is the property: the command either
succeeds with a finite output file, or exits 2 with exactly one line on stderr, no traceback and no
output file. `derandomize=True` (FUZZ) makes every CI run try the same examples. `workdir()`
gives each example a fresh folder under one temp folder per test process.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


MARK = "@@HOSTILE@@"


# (JSON literal, YAML literal, always refused by the bounded readers?)
HOSTILE = [
    ("NaN", ".nan", True), ("Infinity", ".inf", True), ("-Infinity", "-.inf", True),
    ("1e400", "1.0e+400", True), (str(10**400), str(10**400), True), ("9" * 5000, "9" * 5000, True),
    ("[" * 100_000 + "]" * 100_000, "[" * 2000 + "]" * 2000, True),
    ("1e-320", "1.0e-320", False), ("-1", "-1", False), ("0", "0", False), ('"300"', '"300"', False),
    ("true", "true", False), ("null", "null", False), ("[]", "[]", False), ("{}", "{}", False),
    ('"' + "x" * 100_000 + '"', "x" * 100_000, False), ("1.5", "1.5", False), ("-0.0", "-0.0", False),
]


def paths(obj, prefix=()):
    """Every key path of a decoded document (containers and leaves)."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from paths(v, (*prefix, k))


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _delete(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    del doc[path[-1]]


@st.composite
def mutation(draw, doc):
    """(op, path, hostile index, cut fraction): one change to a valid document."""
    all_paths = [p for p in paths(doc) if p]
    path = all_paths[draw(st.integers(0, len(all_paths) - 1))]
    op = draw(st.sampled_from(["hostile"] * 6 + ["delete", "unknown", "wrap", "duplicate", "truncate"]))
    return op, path, draw(st.integers(0, len(HOSTILE) - 1)), draw(st.floats(0.0, 1.0))


def mutate(doc, m, fmt: str) -> tuple[str, bool]:
    """The mutated document as text, and whether the bounded reader must refuse it."""
    op, path, h, cut = m
    doc = json.loads(json.dumps(doc))
    must_refuse = False
    if op == "hostile":
        _set(doc, path, MARK)
        must_refuse = HOSTILE[h][2]
    elif op == "delete" and isinstance(path[-1], str):
        _delete(doc, path)
    elif op == "unknown" and isinstance(doc, dict):
        doc["kvbench_fuzz_unknown_key"] = 1
    elif op == "wrap":
        _set(doc, path, {"value": _get(doc, path)})
    text = json.dumps(doc) if fmt == "json" else yaml.safe_dump(doc, sort_keys=False)
    if fmt == "json":
        text = text.replace(f'"{MARK}"', HOSTILE[h][0])
    else:
        text = text.replace(f"'{MARK}'", HOSTILE[h][1]).replace(MARK, HOSTILE[h][1])
    if op == "duplicate" and isinstance(doc, dict) and doc:
        key = next(iter(doc))
        if fmt == "json":
            text = "{" + json.dumps(key) + ": 0, " + text[1:]
        else:
            text = text + f"{key}: 0\n"
        must_refuse = True
    if op == "truncate":
        text = text[: int(len(text) * cut)]
    return text, must_refuse


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def check(result, out: Path | None, must_refuse: bool, json_out: bool = True) -> None:
    """Success with a finite output, or exit 2 with one line and nothing written."""
    rc, stdout, err = result
    assert rc in (0, 2), (rc, err[-2000:])
    if rc == 2:
        assert err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
        assert out is None or not out.exists()
        return
    assert not must_refuse, "the bounded reader accepted a hostile literal"
    if out is not None and json_out and out.exists():
        text = out.read_text()
        assert "NaN" not in text and "Infinity" not in text
        for line in text.splitlines() if out.suffix == ".jsonl" else [text]:
            json.loads(line)


_ROOT: tempfile.TemporaryDirectory | None = None  # workdir()'s folder, one per process


def workdir() -> Path:
    """A fresh folder for one example, under this test process's fuzz folder (made on first
    use, removed when the process exits)."""
    global _ROOT
    if _ROOT is None:
        _ROOT = tempfile.TemporaryDirectory(prefix="kvbench-fuzz-")
    return Path(tempfile.mkdtemp(dir=_ROOT.name))


def mutated_jsonl(data, lines: list[dict], line: int, path: Path) -> bool:
    """lines as a JSON Lines file with one line mutated; whether the reader must refuse it."""
    text, must = mutate(lines[line], data.draw(mutation(lines[line])), "json")
    body = [json.dumps(x) for x in lines]
    body[line] = text.replace("\n", " ")
    path.write_text("\n".join(body) + "\n")
    return must
