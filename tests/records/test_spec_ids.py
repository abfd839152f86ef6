"""Committed records keep their spec ids: every record (and fit group) under results/ and
tests/data/ that carries a `spec` and its `spec_id` hashes to that id under today's
`spec_id_of`, and today's typed `HandoffSpec` writes a complete spec back key for key.

The fit pools records by spec_id (kvbench.fit.data), so a change to the hash (key order,
separators, float formatting, a field added with a default) would split every published
group from the records measured after it. `test_the_check_catches_a_changed_hash` plants
such a change and shows this check fails on it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbench.records.schema import p2p as schema
from kvbench.records.schema.p2p import HandoffSpec

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for top in ("results", "tests/data") for pattern in ("*.jsonl", "*.json")
               for p in (ROOT / top).rglob(pattern) if '"spec_id"' in p.read_text(errors="replace"))


def pairs(obj, where: str) -> Iterator[tuple[str, dict, str]]:
    """(where, spec, spec_id) for every object in obj that holds a spec and its id."""
    if isinstance(obj, dict):
        if isinstance(obj.get("spec"), dict) and isinstance(obj.get("spec_id"), str):
            yield where, obj["spec"], obj["spec_id"]
        for k, v in obj.items():
            yield from pairs(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from pairs(v, f"{where}[{i}]")


def committed(path: Path) -> list[tuple[str, dict, str]]:
    rel = path.relative_to(ROOT)
    if path.suffix == ".jsonl":
        return [p for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()
                for p in pairs(json.loads(line), f"{rel}:{n}")]
    return list(pairs(json.loads(path.read_text()), str(rel)))


def mismatches(path: Path) -> list[str]:
    out = []
    for where, spec, sid in committed(path):
        actual = schema.spec_id_of(spec)
        if actual != sid:
            out.append(f"{where}: spec_id {sid}, spec hashes to {actual}")
        elif set(spec) >= set(HandoffSpec.model_fields) - {"cut"}:  # a spec written whole
            typed = HandoffSpec.model_validate(spec)
            if typed.as_dict() != spec or typed.spec_id != sid:
                out.append(f"{where}: HandoffSpec writes {typed.as_dict()} back as {typed.spec_id}")
    return out


def test_there_are_committed_specs_to_hold():
    """The check holds something: the committed runs carry hundreds of specs."""
    found = [p for path in FILES for p in committed(path)]
    assert len(FILES) >= 50 and len(found) >= 300, (len(FILES), len(found))
    assert any("cut" in spec for _, spec, _ in found)  # the page plan's specs among them


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_committed_records_keep_their_spec_ids(path):
    assert not mismatches(path)


@pytest.mark.parametrize("plant", [
    lambda s: json.dumps(s, sort_keys=False, separators=(",", ":")),  # key order
    lambda s: json.dumps(s, sort_keys=True),  # separators with spaces
    lambda s: json.dumps(s, sort_keys=True, separators=(",", ":")).replace(".0,", ","),  # floats
    lambda s: json.dumps({**s, "cut": s.get("cut")}, sort_keys=True, separators=(",", ":")),
])
def test_the_check_catches_a_changed_hash(monkeypatch, plant):
    """A planted change to how the spec is written before hashing fails the check on the
    committed records (so the test above can fail)."""
    monkeypatch.setattr(schema, "canonical_json", plant)
    assert sum(bool(mismatches(p)) for p in FILES) >= 10


def rebuilt(spec: dict) -> HandoffSpec:
    """A committed spec made again the way `kvbench p2p` makes it: the run's entries
    (kvbench.p2p.spec.run_entries' keys), then the ones its pattern decided (SpecEntries)."""
    from kvbench.p2p.patterns.base import SpecEntries
    from kvbench.p2p.spec import make_spec

    run = {k: spec[k] for k in ("transport", "transport_options", "layout", "device", "hosts",
                                "block_size", "dtype", "model")}
    entries = SpecEntries(granularity=spec["granularity"],
                          prefill_ranks=spec["world"]["prefill_ranks"],
                          decode_ranks=spec["world"]["decode_ranks"], variant=spec["variant"],
                          pack_kernel=spec["pack_kernel"], block_size=spec["block_size"],
                          cut=spec.get("cut"), compute=spec["compute"],
                          layer_poll=spec["layer_poll"])
    return make_spec(run, spec["pattern"], entries)


def unwritten(path: Path) -> list[str]:
    """Where the writer's path makes a committed whole spec differently (or its id)."""
    out = []
    for where, spec, sid in committed(path):
        if set(spec) >= set(HandoffSpec.model_fields) - {"cut"}:
            again = rebuilt(spec)
            if again.as_dict() != spec or again.spec_id != sid:
                out.append(f"{where}: written again as {again.as_dict()} ({again.spec_id})")
    return out


WHOLE = [p for p in FILES if any(set(s) >= set(HandoffSpec.model_fields) - {"cut"}
                                 for _, s, _ in committed(p))]


def test_every_pattern_has_committed_specs_to_rebuild():
    """Committed runs and tests/data/specs (every pattern's specs as written before the
    patterns returned typed results) hold every pattern, layerwise's own entries included."""
    specs = [s for p in WHOLE for _, s, _ in committed(p)]
    assert {s["pattern"] for s in specs} >= {"sequential", "layerwise", "sharded", "matrix",
                                             "store"}
    assert any(s["compute"] for s in specs) and any(s["pack_kernel"] for s in specs)


@pytest.mark.parametrize("path", WHOLE, ids=[str(p.relative_to(ROOT)) for p in WHOLE])
def test_kvbench_p2p_writes_the_committed_specs_again(path):
    assert not unwritten(path)


@pytest.mark.parametrize("plant", [
    lambda f: {**f, "layer_poll": None},  # a pattern's own entry lost on the way
    lambda f: {**f, "world": {**f["world"], "prefill_ranks": f["world"]["decode_ranks"]}},
    lambda f: {**f, "pack_kernel": None},
])
def test_the_rebuild_catches_a_lost_entry(monkeypatch, plant):
    build = HandoffSpec.build.__func__
    monkeypatch.setattr(HandoffSpec, "build", classmethod(lambda cls, **f: build(cls, **plant(f))))
    assert sum(bool(unwritten(p)) for p in WHOLE) >= 1
