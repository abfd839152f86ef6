"""Fit documents (kvbench.fit/1 and /2) as rows: one per fitted group, one per (group, size)
(`fit-sizes`), or one per joint bootstrap draw (`samples=True`). Read through the typed fit
document (kvbench.records.schema.fit).

The rate is `effective_gb_s` (and `effective_gb_s_ci95_lo`/`_hi`), the fit document's own
name. Until issue 41 these columns were `effective_gbps...`, a name docs/results.md
published: the old names stay as alias columns (`OLD_RATE_NAMES`, the same values, last in
the row) so code written against them keeps reading the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvbench.records.frames.p2p import _flat
from kvbench.records.schema.fit import FitDocument, FitGroup, load_fit_document
from kvbench.units import MIN_TIME_MS

DTYPES = {
    "source": "category", "group": "Int64", "label": "category", "spec_id": "category",
    "transport": "category", "pattern": "category", "variant": "category",
    "granularity": "category", "layout": "category", "dtype": "category", "device": "category",
    "hosts": "category", "world_size": "Int64", "block_size": "Int64",
    "setup_ms": "float64", "setup_ms_ci95_lo": "float64", "setup_ms_ci95_hi": "float64",
    "effective_gb_s": "float64", "effective_gb_s_ci95_lo": "float64",
    "effective_gb_s_ci95_hi": "float64", "ms_per_gb": "float64", "n_samples": "Int64",
    "n_sizes": "Int64", "n_records": "Int64", "min_bytes": "Int64", "max_bytes": "Int64",
    "lack_of_fit_p": "float64", "size_scatter_rel": "float64", "two_regimes": "boolean",
    "break_bytes": "Int64", "no_interval": "category", "n_draws": "Int64",
    "warning_codes": "category", "line_rate_gbps": "float64", "fit_schema": "category",
    "payload_bytes": "Int64", "n": "Int64", "p50_ms": "float64", "p95_ms": "float64",
    "p99_ms": "float64", "mean_ms": "float64", "p50_gbps": "float64", "fitted_ms": "float64",
    "residual_ms": "float64", "residual_rel": "float64", "draw": "Int64",
    "effective_gbps": "float64", "effective_gbps_ci95_lo": "float64",
    "effective_gbps_ci95_hi": "float64",
}
# the rate columns' names before issue 41 (published in docs/results.md): kept as aliases
OLD_RATE_NAMES = {"effective_gbps": "effective_gb_s",
                  "effective_gbps_ci95_lo": "effective_gb_s_ci95_lo",
                  "effective_gbps_ci95_hi": "effective_gb_s_ci95_hi"}
_NAMED = ("transport", "pattern", "variant", "granularity", "layout", "dtype", "device",
          "block_size")


def _ci(pair, i: int):
    return None if pair is None else pair[i]


def _identity(doc: FitDocument, g: FitGroup, index: int, source: str) -> dict:
    """Which group this is: label, spec_id, the usual columns and spec_* (or group_*) columns."""
    fields, spec = g.group, g.spec
    named = spec if spec is not None else fields
    row = {"source": source, "fit_schema": doc.schema_, "group": index, "label": g.label,
           "spec_id": g.spec_id}
    row.update({k: named.get(k) for k in _NAMED})
    world = named.get("world") if spec is not None else None
    row["world_size"] = world.get("size") if isinstance(world, dict) else fields.get("world_size")
    hosts = named.get("hosts")
    row["hosts"] = ",".join(map(str, hosts)) if isinstance(hosts, list) else hosts
    if spec is not None:
        _flat("spec", spec, row)
    else:
        for k, v in fields.items():
            if k not in _NAMED and k not in ("world_size", "hosts"):
                _flat(f"group_{k}", v, row)
    return row


def _group_row(doc: FitDocument, g: FitGroup, index: int, source: str) -> dict:
    lof, tr, rs = g.lack_of_fit, g.two_regimes, g.resampling
    row = _identity(doc, g, index, source)
    row.update({
        "setup_ms": g.setup_ms, "setup_ms_ci95_lo": _ci(g.setup_ms_ci95, 0),
        "setup_ms_ci95_hi": _ci(g.setup_ms_ci95, 1),
        "effective_gb_s": g.effective_gb_s,
        "effective_gb_s_ci95_lo": _ci(g.effective_gb_s_ci95, 0),
        "effective_gb_s_ci95_hi": _ci(g.effective_gb_s_ci95, 1),
        "ms_per_gb": g.ms_per_gb, "n_samples": g.n_samples,
        "n_sizes": g.n_sizes, "n_records": g.n_records,
        "min_bytes": g.bytes_min, "max_bytes": g.bytes_max,
        "lack_of_fit_p": lof.p_value if lof else None,
        "size_scatter_rel": lof.size_scatter_rel if lof else None,
        "two_regimes": tr is not None, "break_bytes": tr.break_bytes if tr else None,
        "no_interval": g.no_interval, "n_draws": rs.n_draws if rs else None,
        "warning_codes": ",".join(w.code for w in g.warnings) or None,
        "line_rate_gbps": doc.line_rate_gb_s,
    })
    return _with_old_names(row)


def _with_old_names(row: dict) -> dict:
    """The row with the rate's pre-issue-41 column names added, holding the same values."""
    row.update({old: row[new] for old, new in OLD_RATE_NAMES.items() if new in row})
    return row


def _size_rows(doc: FitDocument, g: FitGroup, index: int, source: str) -> list[dict]:
    ident = _identity(doc, g, index, source)
    return [{**ident, "payload_bytes": s.bytes, "n": s.n, "p50_ms": s.p50_ms,
             "p95_ms": s.p95_ms, "p99_ms": s.p99_ms, "mean_ms": s.mean_ms,
             "p50_gbps": s.end_to_end_gb_s, "fitted_ms": s.fitted_ms,
             "residual_ms": s.residual_ms, "residual_rel": s.residual_rel}
            for s in g.sizes]


def _draw_rows(doc: FitDocument, g: FitGroup, index: int, source: str) -> list[dict]:
    if g.draws is None or not g.draws.values:
        return []
    ident = _identity(doc, g, index, source)
    return [_with_old_names({**ident, "draw": i, "setup_ms": a, "ms_per_gb": b,
                             "effective_gb_s": 1000.0 / b if b >= MIN_TIME_MS else None})
            for i, (a, b) in enumerate(g.draws.values)]


def rows(path: Path, what: str) -> Iterator[list[dict]]:
    """Rows of one fit file: what = "groups", "sizes" or "draws"."""
    doc = load_fit_document(path)
    for i, g in enumerate(doc.groups):
        if what == "groups":
            yield [_group_row(doc, g, i, str(path))]
        elif what == "sizes":
            yield _size_rows(doc, g, i, str(path))
        else:
            yield _draw_rows(doc, g, i, str(path))
