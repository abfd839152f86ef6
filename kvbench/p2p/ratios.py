"""--baseline's ratios: kvbench's GB/s against each yardstick timed on the same bytes
(kvbench.p2p.baseline), written into the record (`vs_<kind>`, `vs_baseline`) and said in one
line under its row of the table."""

from __future__ import annotations

from kvbench.p2p.baseline import LABELS
from kvbench.p2p.table import num


def add_baseline(rec: dict, yardstick: dict[str, float | None], note: str | None = None,
                 detail: dict | None = None) -> str:
    """Yardstick figures, kvbench's ratio to each (`vs_<kind>`) and to the last one listed
    (`vs_baseline`, `baseline_kind`) added to rec; returns the table line naming them all (or
    why there is none). `detail` (baseline_gbps): the host copy's method and every
    candidate's GB/s, each with kvbench's ratio to it in the line."""
    detail = detail or {}
    cells = []
    for kind, gbps in yardstick.items():
        ratio = _ratio(rec["gbps"], gbps)
        rec[f"baseline_{kind}_gbps"] = gbps
        rec[f"vs_{kind}"] = ratio
        label = LABELS.get(kind, kind)
        if kind == "host_copy" and detail.get("host_copy_method"):
            label = f"{label} ({detail['host_copy_method']}, the fastest)"
        cells.append(f"{label} {num(gbps, '.2f')} GB/s, kvbench/{kind.replace('_', ' ')} = "
                     f"{num(ratio, '.3f')}")
        if kind == "host_copy" and detail.get("host_copy_by_method_gbps"):
            cells[-1] += _by_method(rec, detail)
    if yardstick:
        kind = list(yardstick)[-1]
        rec["baseline_kind"], rec["vs_baseline"] = kind, rec[f"vs_{kind}"]
    if note:
        rec["baseline_note"] = note
        cells.append(note)
    return "; ".join(cells)


def _ratio(gbps: float | None, floor: float | None) -> float | None:
    return gbps / floor if floor and gbps is not None else None


def _by_method(rec: dict, detail: dict) -> str:
    """Record every host-copy candidate and kvbench's ratio to it; the line's bracket."""
    by = detail["host_copy_by_method_gbps"]
    rec["baseline_host_copy_method"] = detail["host_copy_method"]
    rec["baseline_host_copy_by_method_gbps"] = dict(by)
    rec["vs_host_copy_by_method"] = {m: _ratio(rec["gbps"], g) for m, g in by.items()}
    return " [" + ", ".join(f"{m} {num(g, '.2f')} GB/s, kvbench/{m} = "
                            f"{num(rec['vs_host_copy_by_method'][m], '.3f')}"
                            for m, g in by.items()) + "]"
