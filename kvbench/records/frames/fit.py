"""Fit documents (kvbench.fit/1 and /2) as rows: one per fitted group, one per (group, size)
(`fit-sizes`), or one per joint bootstrap draw (`samples=True`). Read through the typed fit
document (kvbench.records.schema.fit)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvbench.records.frames.p2p import _flat
from kvbench.records.schema.fit import load_fit_document
from kvbench.units import MIN_TIME_MS

DTYPES = {
    "source": "category", "group": "Int64", "label": "category", "spec_id": "category",
    "transport": "category", "pattern": "category", "variant": "category",
    "granularity": "category", "layout": "category", "dtype": "category", "device": "category",
    "hosts": "category", "world_size": "Int64", "block_size": "Int64",
    "setup_ms": "float64", "setup_ms_ci95_lo": "float64", "setup_ms_ci95_hi": "float64",
    "effective_gbps": "float64", "effective_gbps_ci95_lo": "float64",
    "effective_gbps_ci95_hi": "float64", "ms_per_gb": "float64", "n_samples": "Int64",
    "n_sizes": "Int64", "n_records": "Int64", "min_bytes": "Int64", "max_bytes": "Int64",
    "lack_of_fit_p": "float64", "size_scatter_rel": "float64", "two_regimes": "boolean",
    "break_bytes": "Int64", "no_interval": "category", "n_draws": "Int64",
    "warning_codes": "category", "line_rate_gbps": "float64", "fit_schema": "category",
    "payload_bytes": "Int64", "n": "Int64", "p50_ms": "float64", "p95_ms": "float64",
    "p99_ms": "float64", "mean_ms": "float64", "p50_gbps": "float64", "fitted_ms": "float64",
    "residual_ms": "float64", "residual_rel": "float64", "draw": "Int64",
}
_NAMED = ("transport", "pattern", "variant", "granularity", "layout", "dtype", "device",
          "block_size")


def _ci(pair, i: int):
    return None if pair is None else pair[i]


def _identity(doc: dict, g: dict, index: int, source: str) -> dict:
    """Which group this is: label, spec_id, the usual columns and spec_* (or group_*) columns."""
    fields = g.get("group") or {}
    spec = g.get("spec")
    named = spec if isinstance(spec, dict) else fields
    row = {"source": source, "fit_schema": doc["schema"], "group": index, "label": g["label"],
           "spec_id": g.get("spec_id")}
    row.update({k: named.get(k) for k in _NAMED})
    world = named.get("world") if isinstance(spec, dict) else None
    row["world_size"] = world.get("size") if isinstance(world, dict) else fields.get("world_size")
    hosts = named.get("hosts")
    row["hosts"] = ",".join(map(str, hosts)) if isinstance(hosts, list) else hosts
    if isinstance(spec, dict):
        _flat("spec", spec, row)
    else:
        for k, v in fields.items():
            if k not in _NAMED and k not in ("world_size", "hosts"):
                _flat(f"group_{k}", v, row)
    return row


def _group_row(doc: dict, g: dict, index: int, source: str) -> dict:
    lof = g.get("lack_of_fit") or {}
    tr = g.get("two_regimes")
    rs = g.get("resampling") or {}
    row = _identity(doc, g, index, source)
    row.update({
        "setup_ms": g.get("setup_ms"), "setup_ms_ci95_lo": _ci(g.get("setup_ms_ci95"), 0),
        "setup_ms_ci95_hi": _ci(g.get("setup_ms_ci95"), 1),
        "effective_gbps": g.get("effective_gb_s"),
        "effective_gbps_ci95_lo": _ci(g.get("effective_gb_s_ci95"), 0),
        "effective_gbps_ci95_hi": _ci(g.get("effective_gb_s_ci95"), 1),
        "ms_per_gb": g.get("ms_per_gb"), "n_samples": g.get("n_samples"),
        "n_sizes": g.get("n_sizes"), "n_records": g.get("n_records"),
        "min_bytes": g.get("bytes_min"), "max_bytes": g.get("bytes_max"),
        "lack_of_fit_p": lof.get("p_value"), "size_scatter_rel": lof.get("size_scatter_rel"),
        "two_regimes": tr is not None, "break_bytes": tr.get("break_bytes") if tr else None,
        "no_interval": g.get("no_interval"), "n_draws": rs.get("n_draws"),
        "warning_codes": ",".join(w["code"] for w in g.get("warnings") or []) or None,
        "line_rate_gbps": doc.get("line_rate_gb_s"),
    })
    return row


def _size_rows(doc: dict, g: dict, index: int, source: str) -> list[dict]:
    ident = _identity(doc, g, index, source)
    return [{**ident, "payload_bytes": s["bytes"], "n": s["n"], "p50_ms": s.get("p50_ms"),
             "p95_ms": s.get("p95_ms"), "p99_ms": s.get("p99_ms"), "mean_ms": s.get("mean_ms"),
             "p50_gbps": s.get("end_to_end_gb_s"), "fitted_ms": s.get("fitted_ms"),
             "residual_ms": s.get("residual_ms"), "residual_rel": s.get("residual_rel")}
            for s in g["sizes"]]


def _draw_rows(doc: dict, g: dict, index: int, source: str) -> list[dict]:
    draws = g.get("draws")
    values = draws.get("values") if isinstance(draws, dict) else draws
    if not values:
        return []
    ident = _identity(doc, g, index, source)
    return [{**ident, "draw": i, "setup_ms": a, "ms_per_gb": b,
             "effective_gbps": 1000.0 / b if b >= MIN_TIME_MS else None} for i, (a, b) in enumerate(values)]


def rows(path: Path, what: str) -> Iterator[list[dict]]:
    """Rows of one fit file: what = "groups", "sizes" or "draws"."""
    doc = load_fit_document(path).model_dump(by_alias=True)
    for i, g in enumerate(doc["groups"]):
        if what == "groups":
            yield [_group_row(doc, g, i, str(path))]
        elif what == "sizes":
            yield _size_rows(doc, g, i, str(path))
        else:
            yield _draw_rows(doc, g, i, str(path))
