"""`kvbench matrix`: every ordered pair of ranks measured, fitted and judged.

Under MPI (srun, mpirun) with N ranks it runs the p2p benchmark's matrix pattern (the same
engine, data check and records as `kvbench p2p`; kvbench.p2p.patterns.matrix), then, on rank
0 once MPI is down, fits every pair and writes the matrix beside the records:

    kvbench-matrix-<stamp>.json   the typed document (kvbench.records.schema.matrix)
    kvbench-matrix-<stamp>.png    the heatmap of GB/s, named pairs framed in red
    kvbench-matrix-<stamp>.md     verdict, GB/s grid, every pair's fit and path
    kvbench-matrix-<stamp>.csv    one row per pair
    kvbench-matrix-<stamp>.draws.npy, .pairs.jsonl   beyond 240 pairs: the pairs' draws, and
                                  every pair's entry a line (the .json keeps the named ones);
                                  that report is streamed as the pairs are fitted
                                  (kvbench.matrix.stream), its draws float32

`kvbench matrix report RECORDS.jsonl...` does the second half again on records already
written (other rules, another --expect-link), without MPI.

Exit status: 0; 1 when a pair's path is not the --expect-link kind or its data check failed
(one line per such pair on stderr), and with --fail-on-outliers also when a pair is named
slow or on an odd path; 2 for bad input; the benchmark's own status when it failed.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int, bounded_float, each_once, run_main
from kvbench.links import linkpath
from kvbench.matrix.analyze import (
    DEFAULT_SLOW_FRACTION,
    DRAWS_CHOICES,
    MAX_INLINE_DRAW_PAIRS,
    analyze,
)
from kvbench.matrix.report import SUFFIXES
from kvbench.p2p.watchdog import env_rank
from kvbench.records.schema.matrix import DRAWS_SUFFIX, PAIRS_SUFFIX, MatrixDocument
from kvbench.records.write import check_destination, fresh_stem, write_files

PROG = "kvbench matrix"
FAILING = ("expect_link", "wrong_data")
OUTLIERS = ("slow", "path_differs")

_EPILOG = """\
Every other flag is kvbench p2p's (python -m kvbench.p2p --help): the sizes (--bytes,
--sizes), --seconds-per-point, --iters, --transport, --device, --out, ... The pattern is
matrix; its schedule is --schedule rounds (default: round-robin rounds of pairs that share
no rank, at the same time) or serial (one pair at a time).

examples:
  mpirun -n 4 kvbench matrix --device cpu --transport nixl --bytes 1M,4M,16M,64M --out runs/
  srun --mpi=pmix kvbench matrix --transport nccl --sizes 300,2000,8192 --expect-link rdma
  kvbench matrix report runs/kvbench-p2p-*.jsonl --expect-link tcp     # again, offline
docs/matrix.md: how to read the matrix, the schedule, the cost for N ranks.
"""


def _add_rules(p: ArgumentParser) -> None:
    g = p.add_argument_group("verdict")
    g.add_argument("--expect-link", choices=linkpath.EXPECTABLE, metavar="KIND",
                   help="the kind of link every pair's bytes must take (nvlink, pcie, "
                        "same-device, shm, rdma, rdma-host-staged, tcp, host): a pair whose "
                        "transport says otherwise, or emulates it, fails the run")
    g.add_argument("--expect-local-link", choices=linkpath.EXPECTABLE, metavar="KIND",
                   help="the kind for pairs within one host (default: --expect-link)")
    g.add_argument("--slow-fraction", default=str(DEFAULT_SLOW_FRACTION), metavar="F",
                   help="a pair is slow only when its rate is also below F x the other pairs' "
                        f"median (default {DEFAULT_SLOW_FRACTION:g})")
    g.add_argument("--fail-on-outliers", action="store_true",
                   help="exit 1 also when a pair is named slow or on an odd path")
    g.add_argument("--bootstrap", type=arg_int(100, 100_000), default=1000, metavar="N",
                   help="bootstrap resamples per pair (default 1000)")
    g.add_argument("--seed", type=arg_int(0, 2**32 - 1), default=0, help="bootstrap seed")
    g.add_argument("--draws", choices=DRAWS_CHOICES, default="auto",
                   help="each pair's bootstrap draws (what plan --pair draws its band from): "
                        "inline in the .json, or in a .draws.npy file beside it; auto "
                        f"(default): the file beyond {MAX_INLINE_DRAW_PAIRS} pairs")


class _RankParser(ArgumentParser):
    """Parsed on every rank before MPI starts: only rank 0 (by the launcher's variables) speaks."""

    def error(self, message: str):  # type: ignore[override]
        if _speaker():
            super().error(message)
        raise SystemExit(2)

    def print_help(self, file=None):
        if _speaker():
            super().print_help(file)


def _speaker() -> bool:
    """Rank 0 by the launcher's variables, or no launcher at all."""
    return env_rank() in (None, 0)


def measure_parser() -> ArgumentParser:
    p = _RankParser(prog=PROG, description="Measure every ordered pair of MPI ranks (run under "
                    "mpirun or srun), fit each pair and name the slow and odd-path ones.",
                    epilog=_EPILOG)
    _add_rules(p)
    return p


def report_parser() -> ArgumentParser:
    p = ArgumentParser(prog=f"{PROG} report", description="The matrix of records already "
                       "written by kvbench matrix: fits, heatmap, tables and verdict.",
                       epilog="docs/matrix.md: how to read the matrix.")
    p.add_argument("records", nargs="+", metavar="RECORDS.jsonl", help="a matrix run's records")
    p.add_argument("--out", metavar="DIR", help="folder for the report (default: the first "
                   "records file's folder)")
    _add_rules(p)
    return p


# ---------------------------------------------------------------------------
# the report


def render(doc: MatrixDocument, draws=None) -> list[tuple[str, str | bytes]]:
    """(suffix, content) of every file, rendered before anything is written."""
    from kvbench.fit.fitting import dumps  # indented, each pair's draws on one line
    from kvbench.fit.plots import require_matplotlib
    from kvbench.matrix import report

    require_matplotlib()
    whole = doc.model_dump(by_alias=True)
    every = whole["pairs"]
    if doc.pairs_file is not None:  # every pair on its line beside; the named ones here
        whole["pairs"] = [p for p in every if p["findings"]]
    out = [(".json", dumps(whole) + "\n"),
           (".png", report.heatmap_png(doc)), (".md", report.markdown(doc)),
           (".csv", report.csv_table(doc))]
    if draws is not None:
        import io

        import numpy as np

        buf = io.BytesIO()
        np.save(buf, draws, allow_pickle=False)
        out.append((DRAWS_SUFFIX, buf.getvalue()))
    if doc.pairs_file is not None:
        out.append((PAIRS_SUFFIX, pair_lines(every)))
    return out


def pair_lines(pairs: list[dict]):
    """The pairs file, streamed: each pair's entry (as dumped) on one line, "pair" first
    (the start records.schema.matrix.read_pairs finds a pair by)."""
    from kvbench.records.write import dumps_json  # compact: ',' and ':' without spaces

    for p in pairs:
        yield dumps_json(p, indent=None) + "\n"


def write_report(doc: MatrixDocument, out_dir: Path, draws=None) -> list[Path]:
    """The files together or none, under a fresh name (never overwriting); the document
    names its draws file (`draws`: the array analyze gave) by that name."""
    stem = fresh_stem(out_dir, "kvbench-matrix", (*SUFFIXES, DRAWS_SUFFIX, PAIRS_SUFFIX))
    for key, suffix in (("draws_file", DRAWS_SUFFIX), ("pairs_file", PAIRS_SUFFIX)):
        side = getattr(doc, key)
        if side is not None:  # (typed models are frozen: a copy with the name)
            doc = doc.model_copy(update={key: side.model_copy(
                update={"file": stem.name + suffix})})
    rendered = render(doc, draws)
    return write_files([(stem.with_name(stem.name + s), c) for s, c in rendered])


MAX_PRINTED = 50  # named pairs printed on stdout; the rest are in the report's files


def conclude(doc: MatrixDocument, files: Sequence[Path], table=None,
             fail_on_outliers: bool = False) -> int:
    """Print the verdict, the pairs' rates in one line and each named pair with its
    findings (not a line per pair: every pair is in the CSV); one stderr line per failing
    pair; the status. `table`: every pair's row, when the document holds the named ones."""
    from kvbench.matrix.report import rates_line

    print(f"{PROG}: {doc.verdict}")
    for kind, path in doc.majority_path.items():
        print(f"  majority path {kind}: {path or 'none (no path held by more than half)'}")
    print(f"  {rates_line(doc, table)}")
    named = [p for p in doc.pairs if p.findings]
    for p in named[:MAX_PRINTED]:
        rate = "no rate" if p.effective_gb_s is None else f"{p.effective_gb_s:.4g} GB/s"
        print(f"  [{p.pair[0]},{p.pair[1]}] {p.sender.host} -> {p.receiver.host}: {rate}, "
              f"{p.path}" + "".join(f"\n      {f.code}: {f.message}" for f in p.findings))
    if len(named) > MAX_PRINTED:
        print(f"  ... and {len(named) - MAX_PRINTED} more named pairs (the .md and .csv)")
    print("wrote " + ", ".join(str(f) for f in files))
    failing = [(p, f) for p in doc.pairs for f in p.findings
               if f.code in FAILING or (fail_on_outliers and f.code in OUTLIERS)]
    for p, f in failing:
        print(f"{PROG}: error: pair [{p.pair[0]},{p.pair[1]}] {p.sender.host} -> "
              f"{p.receiver.host}: {f.code}: {f.message}", file=sys.stderr)
    return 1 if failing else 0


def _rules(args) -> dict:
    return {"expect_link": args.expect_link, "expect_local_link": args.expect_local_link,
            "slow_fraction": bounded_float(args.slow_fraction, "--slow-fraction", 0, 1,
                                           lo_open=True),
            "n_boot": args.bootstrap, "seed": args.seed, "draws": args.draws}


def report_main(argv: Sequence[str] | None) -> int:
    args = report_parser().parse_args(argv)
    rules = _rules(args)
    out = check_destination(Path(args.out) if args.out else Path(args.records[0]).parent)
    return conclude(*report_files(each_once(args.records, f"{PROG} report"), out, rules),
                    args.fail_on_outliers)


def report_files(paths: Sequence[str], out: Path, rules: dict,
                 stream_above: int = MAX_INLINE_DRAW_PAIRS):
    """(the document, its files, every pair's row or None): beyond `stream_above` pairs
    (unless --draws inline) streamed as the pairs are fitted (kvbench.matrix.stream: memory
    and disk that stay small at N = 1,024), else every entry held and rendered at once."""
    from kvbench.matrix.analyze import read_run

    with cycle_collection_paused():
        run = read_run(paths)
        if rules["draws"] != "inline" and len(run.pairs) > stream_above:
            from kvbench.matrix.stream import write_streamed

            doc, table, files = write_streamed(run, paths, out, **{
                k: v for k, v in rules.items() if k != "draws"})
            return doc, files, table
        draws: list = []
        doc = analyze(paths, draws_out=draws, run=run, **rules)
        return doc, write_report(doc, out, *draws), None


@contextmanager
def cycle_collection_paused():
    """Python's cycle collector off while a matrix is read and fitted, back on after (its
    garbage then collected). The read holds millions of objects (a group and a pair's data for
    each of a million pairs at N = 1,024) that form no cycles, and every full collection walks
    all of them: 5 of the 46 s at N = 256, more as N grows. Memory freed by reference counting
    is freed as before; only cycles wait for the end."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------------
# under MPI


def _p2p_argv(rest: list[str]) -> list[str]:
    for flag in ("--pattern", "--no-write", "--cases"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise UsageError(f"{flag}: kvbench matrix runs the matrix pattern and writes its "
                             "records and report; leave it out")
    return ["--pattern", "matrix", *rest]


def measure_main(argv: Sequence[str]) -> int:
    """Every rank: the matrix measured by kvbench p2p; then rank 0 alone, after MPI is down,
    fits and writes the report (a slow analysis keeps no rank waiting in MPI)."""
    try:
        args, rest = measure_parser().parse_known_args(list(argv))
        rules = _rules(args)
        p2p_argv = _p2p_argv(rest)
        if env_rank() is None:
            raise UsageError("run it under MPI with 2 or more ranks: mpirun -n N kvbench matrix "
                             "... or srun --mpi=pmix kvbench matrix ...; `kvbench matrix report` "
                             "judges records already written")
    except SystemExit as exc:
        return _leave_together(int(exc.code or 0))
    except UsageError as exc:
        if _speaker():
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return _leave_together(exc.exit_code)
    from kvbench.p2p import cli as p2p  # (torch, MPI: after the flags are known to be good)

    written: dict = {}
    code = p2p.cli(p2p_argv, written)
    if "records" not in written:  # not rank 0, or nothing was written
        return code

    def finish(_argv) -> int:
        return conclude(*report_files([str(written["records"])],
                                      Path(written["records"]).parent, rules),
                        args.fail_on_outliers)

    return max(code, run_main(PROG, finish, []))


def _leave_together(code: int) -> int:
    """Every rank refused the same flags before MPI: meet once in MPI_Finalize (a fence,
    bounded by the watchdog) so no rank exits, and has the launcher kill the job, before
    rank 0's line is out. Without a launcher there is no one to wait for."""
    if env_rank() is None or code == 0:
        return code
    from kvbench.p2p import world
    from kvbench.p2p.watchdog import WATCHDOG

    WATCHDOG.start(PROG, 60.0)
    if world.init():
        world.finalize()
    return code


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        return run_main(f"{PROG} report", report_main, argv[1:])
    return measure_main(argv)


if __name__ == "__main__":
    sys.exit(cli())
