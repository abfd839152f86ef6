"""Record assembly: what the patterns measured (kvbench.p2p.patterns.base.Measured) becomes
`kvbench.p2p/1` records, each built as its contract (P2PRecord) with its spec and spec id,
the run's shared fields, and --baseline's yardsticks timed per point."""

from __future__ import annotations

import sys

from kvbench.p2p.baseline import baseline_gbps, baseline_kinds
from kvbench.p2p.patterns.base import Measured, Point
from kvbench.p2p.ratios import add_baseline
from kvbench.p2p.spec import make_spec, run_entries
from kvbench.p2p.watchdog import WATCHDOG
from kvbench.records.schema.p2p import SCHEMA_P2P, P2PRecord
from kvbench.records.write import contract_dump
from kvbench.units import gb_per_s

NOT_LINK_ZERO = "moves no bytes"


def make_record(base: dict, point: Point, measured: Measured, notice_ms: float | None) -> dict:
    """One `kvbench.p2p/1` line, built as its contract (P2PRecord, the class fit and
    results.load read it back into) and dumped from it."""
    loop, fields = measured.loop, measured.fields
    s = loop.samples
    nbytes = fields["bytes"]
    if nbytes == 0:
        fields["fit_as_link"], fields["not_link_reason"] = False, NOT_LINK_ZERO
    summary = s.summary()
    rec = {
        "schema": SCHEMA_P2P,
        **base,
        "prompt_tokens": point.prompt_tokens,
        **fields,
        "iters": loop.iters,
        "n_samples": len(s),
        "samples_ms": s.samples_ms,
        "sample_rounds": loop.rounds,
        **summary,
        "gbps": gb_per_s(nbytes, summary["p50_ms"]),
        "gbps_best": gb_per_s(nbytes, summary["min_ms"]),
        "cold_ms": loop.cold_ms,
        "warmup_ms": loop.warmup_ms,
        "notice_ms": notice_ms,
    }
    return contract_dump(P2PRecord, rec, "the p2p record being written")


def common_fields(args, argv, comm, hosts, gpus, dev, model, dtype, transport, points
                  ) -> tuple[dict, dict]:
    """(the spec entries every record of the run shares, the record fields they share)."""
    raw = points[0].raw_bytes is not None
    spec_common = run_entries(args, hosts, dev.name, model, dtype, transport, raw)
    base_common = {
        "transport": type(transport).name, "layout": spec_common["layout"],
        "dtype": spec_common["dtype"], "device": dev.name,
        "model": None if raw else {"name": model.name, **model.geometry()},
        "block_size": spec_common["block_size"],
        "world_size": comm.Get_size(), "hosts": hosts,
        "gpus": gpus,
        "argv": [sys.executable, "-m", "kvbench.p2p", *argv],
        **transport.record_fields(),
    }
    return spec_common, base_common


def assemble(args, comm, device: str, measured, spec_common: dict, base_common: dict,
             notice: float | None, transport=None) -> tuple[list[dict], list[str | None]]:
    """(records, the note under each one's row) from what was measured (rank 0; others get
    empty lists), with the yardstick of --baseline timed per point (collective), the
    transport's own last."""
    records, notes = [], []
    for pat, pt, results in measured:
        yardstick, detail, note = (yardsticks(args, comm, device, base_common, results, transport)
                                   if args.baseline else (None, {}, None))
        for m in results:
            spec = make_spec(spec_common, pat.name, m.spec)
            rec = make_record({**base_common, "pattern": pat.name}, pt, m, notice)
            rec.update(spec=spec.as_dict(), spec_id=spec.spec_id)
            line = m.note
            if args.baseline and comm.Get_rank() == 0:
                more = add_baseline(rec, yardstick, note, detail)
                line = f"{line}\n    {more}" if line else more
            records.append(rec)
            notes.append(line)
    return records, notes


def yardsticks(args, comm, device: str, base_common: dict, results: list[Measured], transport
               ) -> tuple[dict | None, dict, str | None]:
    """(--baseline's GB/s per kind on rank 0, the host copy's detail, why a kind is missing)
    for one point's bytes (collective)."""
    WATCHDOG.phase("baseline")
    first = results[0].fields if comm.Get_rank() == 0 else None
    kinds, note = baseline_kinds(device, base_common.get("gpus"))
    yardstick = baseline_gbps(comm, first["bytes"] if first is not None else None,
                              kinds, args, base_common.get("gpus"))
    yardstick, detail = yardstick if yardstick is not None else (None, {})
    own = transport.yardsticks(first) if transport is not None else {}
    if comm.Get_rank() == 0:
        yardstick = {**yardstick, **own}
    return yardstick, detail, note

