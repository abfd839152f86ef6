"""`kvbench fit` / `python -m kvbench.fit`: flags, inputs and outputs checked first, then the fit."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int, bounded_float, each_once, run_main
from kvbench.fit.data import (
    read_groups,
)
from kvbench.fit.fitting import (
    MAX_BOOTSTRAP,
    default_out,
    dumps,
    fit_document,
    fit_groups,
    format_table,
    skipped_note,
)
from kvbench.links import linkpath
from kvbench.records.schema.read import path_kind
from kvbench.records.schema.types import MAX_GBPS, MIN_GBPS
from kvbench.records.select import parse_where
from kvbench.records.write import (
    check_new_file,
    plot_format,
    write_files,
)

_EPILOG = """\
examples:
  python -m kvbench.fit results/kvbench-p2p-20260101T000000Z.jsonl
  python -m kvbench.fit results/*.jsonl --where transport=gloo --line-rate-gbps 12.5
  python -m kvbench.fit run.jsonl --out run.fit.json --plot run.fit.png

Rates are decimal GB/s (1e9 bytes per second); a 100 Gbit/s NIC is 12.5 GB/s.
Groups that are not a link (compute included, zero bytes, sharded isolated) are skipped
with a note naming them.
"""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kvbench fit",
        description="Fit time_ms = setup_ms + bytes / (effective_gb_s x 1e9) x 1000 through the "
                    "per-size medians of p2p results,\none fit per measured spec, with 95% "
                    "intervals from resampling rounds (or blocks) and joint draws for plan.",
        epilog=_EPILOG,
    )
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl", help="p2p result files")
    p.add_argument("--out", metavar="FILE", help="fitted JSON (default: <first input>.fit.json "
                   "beside it; never overwrites)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw time vs bytes with the fitted "
                   "line and band, and GB/s vs size; .png, .svg or .pdf by the suffix (needs "
                   "matplotlib: the 'plot' extra). Written together with the JSON or not at all")
    p.add_argument("--line-rate-gbps", metavar="GB/s", help="declared line rate in decimal GB/s; "
                   "a fitted rate above it is flagged as a measurement bug")
    p.add_argument("--expect-link", choices=linkpath.EXPECTABLE, metavar="KIND",
                   help="the link the KV's bytes should take (nvlink, rdma, tcp, ...): warn "
                   "(link_mismatch) when the path a transport reported says otherwise or is "
                   "UCX's software emulation, with the cause and fix where the record tells "
                   "(docs/nixl.md)")
    p.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="fit only groups whose KEY equals VALUE (repeatable; lists as a,b)")
    p.add_argument("--bootstrap", type=arg_int(100, MAX_BOOTSTRAP), default=1000, metavar="N",
                   help="bootstrap resamples for the intervals (default 1000, at least 100)")
    p.add_argument("--seed", type=arg_int(0, 2**32 - 1), default=0, help="bootstrap seed (default 0)")
    return p


def _line_rate(text: str | None) -> float | None:
    if text is None:
        return None
    return bounded_float(text, "--line-rate-gbps", MIN_GBPS, MAX_GBPS)


def _once(paths: list[str]) -> list[str]:
    """Each file once (kvbench.cli.each_once)."""
    return each_once(paths, "kvbench fit")


def _paths(args) -> tuple[list[str], Path, Path | None, str | None]:
    """(inputs, --out, --plot, the plot's format), both targets checked before any work."""
    inputs = _once([str(p) for p in args.results])
    for p in inputs:
        if path_kind(p) == "dir":
            raise UsageError(f"{p} is a directory; pass the .jsonl result files")
    out = Path(args.out) if args.out else default_out(Path(inputs[0]))
    plot = Path(args.plot) if args.plot else None
    fmt = None
    if plot is not None:
        fmt = plot_format(plot)
        if plot.resolve() == out.resolve():
            raise UsageError(f"--plot {plot} is the same file as --out")
        from kvbench.fit import plots as report

        report.require_matplotlib()
    check_new_file(out)
    if plot is not None:
        check_new_file(plot)
    return inputs, out, plot, fmt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    line_rate = _line_rate(args.line_rate_gbps)
    where = parse_where(args.where)
    inputs, out, plot, fmt = _paths(args)
    groups, n_records = read_groups(inputs, keep_paths=bool(args.expect_link))
    if not n_records:
        raise UsageError(f"no records in {', '.join(inputs)}")
    fits, skipped = fit_groups(groups, where=where, n_boot=args.bootstrap, seed=args.seed,
                               line_rate=line_rate, expect_link=args.expect_link)
    doc = fit_document(fits, skipped, inputs, args.bootstrap, args.seed, line_rate)
    files = [(out, dumps(doc) + "\n")]
    if plot is not None:
        from kvbench.fit import plots as report

        files.append((plot, report.plot_fits(fits, fmt=fmt)))  # rendered before anything is written
    write_files(files)  # the JSON and its plot appear together or not at all
    if skipped:  # one line, on stderr: what was not fitted and why
        print(f"kvbench fit: note: {skipped_note(skipped)}", file=sys.stderr)
    print(format_table(doc))
    print(f"\nwrote {out}" + (f" and {plot}" if plot else ""))
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    return run_main("kvbench fit", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
