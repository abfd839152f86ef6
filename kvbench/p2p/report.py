"""Rank 0's end of a run: the records finished (their transport's path, every rank's
environment once, a matrix job's per-job fields once: kvbench.records.schema.job, the time), the table printed, the files written, and the exit status
(1 when the data check found wrong elements)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvbench.cli import UsageError
from kvbench.p2p.args import PROG
from kvbench.p2p.table import emulation_line, format_table, peak_memory_line
from kvbench.records.schema.job import make_lean
from kvbench.records.stats import min_samples_for
from kvbench.records.write import write_records


def finish(records: list[dict], info: dict, envs: list[dict]) -> None:
    """Each record's transport_info (where it has none of its pair's), environment and time."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary = {k: envs[0][k] for k in ("torch", "mpi4py", "mpi_library", "nccl", "nixl", "gpu",
                                       "cpu")}
    for k, rec in enumerate(records):
        rec.setdefault("transport_info", info)
        # every rank's environment once per job: a matrix's N(N-1) pair records would
        # otherwise carry N of them each (N^3 in the file); its later records carry rank 0's
        once = k > 0 and rec.get("pair") is not None
        rec["env"] = ({"ranks": envs[:1], "ranks_in": "the first record", **summary} if once
                      else {"ranks": envs, **summary})
        if once and isinstance(rec.get("clock"), dict):  # its pair's two offsets, not N
            clock, (s, d) = rec["clock"], rec["pair"]
            rec["clock"] = {"method": clock.get("method"), "ranks_in": "the first record",
                            "pair_offset_ms": [clock["offset_ms"][s], clock["offset_ms"][d]]}
        rec["timestamp"] = stamp
    # a matrix job's later records leave what is per job (hosts, GPUs, rank 0's environment,
    # the schedule's pairs) to its first: a record's size does not grow with N
    make_lean(records)


def print_table(records: list[dict], notes: Sequence[str | None] | None, notice: float) -> None:
    print(format_table(records, notes))
    print(f"notice one-way latency {notice:.4f} ms (included once in every sample); "
          f"GB/s = bytes / p50 (decimal); n = samples; p95 needs n >= "
          f"{min_samples_for(95)}, p99 n >= {min_samples_for(99)}; order {records[0]['order']}")
    line = peak_memory_line(records)
    if line:
        print(line)
    line = emulation_line(records)
    if line:  # once per run, with or without --expect-link: the figures are not the link's
        print(f"{PROG}: warning: {line}", file=sys.stderr)


def report(args, records: list[dict], info: dict, envs: list[dict], notice: float,
           written: dict | None = None, notes: Sequence[str | None] | None = None) -> int:
    """Rank 0: finish the records, print the table (`notes` under their rows), write the
    files, return the exit status."""
    finish(records, info, envs)
    print_table(records, notes, notice)
    if not args.no_write:
        try:  # the .jsonl and its .csv appear together or not at all
            jpath, cpath = write_records(Path(args.out), records, "kvbench-p2p")
        except UsageError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exc.exit_code
        print(f"records: {jpath}  (csv: {cpath.name})")
        if written is not None:
            written["records"] = jpath
    wrong = sum(r["wrong"] or 0 for r in records)
    if wrong:
        print(f"{PROG}: error: data check failed: {wrong} wrong elements received", file=sys.stderr)
        return 1
    return 0
