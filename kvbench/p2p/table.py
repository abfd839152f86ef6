"""The table `kvbench p2p` prints on rank 0: one row per record, a record's note under its
row (the layerwise overlap, the sharded plan, --baseline's ratios: printed, never written),
and the lines after it (peak memory, UCX's software emulation)."""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.links import linkpath
from kvbench.p2p import transports
from kvbench.records.stats import percentile_cell
from kvbench.units import GiB, MiB


def num(value: float | None, spec: str) -> str:
    """A number as `spec` formats it, or '-' where there is none."""
    return "-" if value is None else format(value, spec)


def cut_text(r: dict) -> str:
    """A record's cut for the table: block size, and for the page plan pages, ids and TP pair."""
    cut = r.get("cut") or {}
    bs = f"bs {r['block_size']}" if r.get("block_size") else ""
    tp = "" if cut.get("tp") in (None, "1:1") else f" tp {cut['tp']}"
    return (bs + (f" {cut['kv']} {cut['blocks']}" if cut else "") + tp).strip() or "-"


def format_table(records: list[dict], notes: Sequence[str | None] | None = None) -> str:
    """The table of records; `notes` (one per record, or None) printed under their rows."""
    notes = notes or [None] * len(records)
    w = max([11] + [len(r["pattern"]) + 1 + len(r["variant"]) for r in records if r.get("variant")])
    cuts = [cut_text(r) for r in records]
    show_cut = any(r.get("cut") for r in records) or len(set(cuts)) > 1
    wc = max(len(c) for c in cuts) if show_cut else 0
    head = (f"{'pattern':<{w}} {'transport':<9} {'gran':<6} " + (f"{'cut':<{wc}} " if show_cut else "")
            + f"{'tokens':>7} {'bytes':>14} {'MiB':>9} {'desc':>8} "
            f"{'n':>4} {'p50 ms':>9} {'p95 ms':>11} {'p99 ms':>12} {'GB/s':>7} {'cold ms':>9} "
            f"{'wrong':>6}")
    lines = [head, "-" * len(head)]
    for r, cut, note in zip(records, cuts, notes, strict=True):
        lines.append(row(r, w, cut if show_cut else None, wc))
        if note:
            lines.append(f"    {note}")
    return "\n".join(lines)


def row(r: dict, w: int, cut: str | None, wc: int) -> str:
    """One record's row (`cut`: its cut column, None where the table shows none)."""
    tok = "-" if r["prompt_tokens"] is None else str(r["prompt_tokens"])
    wrong = "-" if r["wrong"] is None else str(r["wrong"])
    variant = r.get("variant")
    name = r["pattern"] + (f"/{variant}" if variant else "")
    n = r["n_samples"]
    # a bytes/time rate only where the record is a transfer (not compute, not summed edges)
    rate = f"{num(r['gbps'] if r.get('fit_as_link', True) else None, '.2f'):>7}"
    return (f"{name:<{w}} {r['transport']:<9} {r['granularity']:<6} "
            + (f"{cut:<{wc}} " if cut is not None else "") + f"{tok:>7} {r['bytes']:>14,} "
            f"{r['bytes'] / MiB:>9.1f} {num(r.get('descriptors'), ','):>8} {n:>4} {r['p50_ms']:>9.3f} "
            f"{percentile_cell(r['p95_ms'], 95, n):>11} {percentile_cell(r['p99_ms'], 99, n):>12} "
            f"{rate} {num(r['cold_ms'], '.3f'):>9} {wrong:>6}")


def peak_memory_line(records: list[dict]) -> str | None:
    """Peak memory per rank against the largest payload: host RSS, and on CUDA the device's
    peak (where the KV lives; RSS there is the staging and the interpreter)."""
    largest = max((r["bytes"] for r in records), default=0)
    parts = []
    for key, what in (("peak_device_bytes", "GPU (torch peak allocated)"),
                      ("peak_rss_bytes", "host RSS")):
        vals = [v for r in records for v in (r.get(key) or []) if v is not None]
        if vals and largest:
            parts.append(f"{what} {max(vals) / GiB:.2f} GiB = {max(vals) / largest:.2f}x")
    if not parts:
        return None
    return f"peak memory per rank: {'; '.join(parts)} the largest payload ({largest / GiB:.2f} GiB)"


def emulation_line(records: list[dict]) -> str | None:
    """One line when a record's KV went over UCX's software emulation, with its causes and
    fixes (kvbench.links.linkcauses); None otherwise."""
    return linkpath.emulation_note(transports.classify_record(r) for r in records)
