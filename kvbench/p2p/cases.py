"""`mpirun -n 2 python -m kvbench.p2p --cases FILE`: many p2p runs in one MPI job.

Starting torch, MPI and NIXL costs seconds per rank, so a set of configurations (lab agree's
factorial, a test's matrix) runs as one job: FILE holds one p2p argument line per line (the
flags `kvbench p2p` takes, shell-quoted as on a command line; blank lines and `#` comments
are skipped). Each case runs in turn in the same MPI world, exactly as `kvbench p2p` with
those flags would (same validation, same records, same table), and rank 0 prints one line
after it:

    case 2/5: exit 0 in 3.1 s: --transport nixl --sizes 16 --out runs/a

A case that fails (a data check, a flag its run refuses) is reported and the next one runs;
the job exits with the first failing case's status, 0 when all pass. A FILE that cannot be
read, a line that does not parse (quoting, an unknown flag, a bad value, a nested --cases)
or ranks that read different cases end the job in one line before any case runs (exit 2).

This module: reading and checking the cases, and the loop (`run_cases`, which tests with a
planted fault call with their own per-case hook).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvbench.errors import EXIT_USAGE, UsageError, one_line
from kvbench.p2p import cli as p2p
from kvbench.p2p import world as mpi_world
from kvbench.p2p.agree import agree
from kvbench.p2p.args import CASES, CASES_ALONE, PROG, build_parser, cases_file, prescan
from kvbench.p2p.watchdog import WATCHDOG, env_rank
from kvbench.records.schema.read import path_kind

FLAG = CASES


@dataclass(frozen=True)
class CaseResult:
    """One case's outcome on this rank: its place (1-based), its flags, exit status, wall time."""

    index: int
    total: int | None  # None: the cases came from a generator
    argv: tuple[str, ...]
    rc: int
    seconds: float

    def line(self) -> str:
        return (f"case {self.index}/{self.total or '?'}: exit {self.rc} in {self.seconds:.1f} s: "
                f"{shlex.join(self.argv)}")


def check_case(argv: Sequence[str], where: str) -> None:
    """The case's flags parse as `kvbench p2p`'s; else a UsageError naming the line."""
    if FLAG in argv or any(a.startswith(FLAG + "=") for a in argv):
        raise UsageError(f"{where}: a case cannot hold {FLAG}")
    parser = build_parser(rank=1)  # silent: the error is raised, and printed once by rank 0

    def refuse(message: str):
        raise UsageError(f"{where}: {one_line(message)}")

    parser.error = refuse  # type: ignore[method-assign]
    try:
        ns = parser.parse_args(list(argv))
    except SystemExit:  # --help in a case
        raise UsageError(f"{where}: a case cannot ask for --help") from None
    if ns.cases is not None:  # an abbreviation of it (--case FILE)
        raise UsageError(f"{where}: a case cannot hold {FLAG}")


MAX_CASES_BYTES = 1 << 20  # 1 MiB: thousands of lines; a bigger file is not a list of runs
MAX_CASES = 1000  # each case is checked by p2p's parser first (about 1 ms) and then run


def read_cases(path: str) -> list[list[str]]:
    """FILE's cases, each checked; a UsageError line for the first bad one. Only a regular
    file is read (every rank reads it on its own: a FIFO could serve one reader and would
    block the others forever), at most MAX_CASES_BYTES, at most MAX_CASES."""
    if path_kind(path) not in ("file", "missing"):
        raise UsageError(f"{FLAG} {path}: cannot read it (not a regular file: a folder, FIFO, "
                         "socket or device)")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CASES_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{FLAG} {path}: cannot read it ({exc.__class__.__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc})") from None
    if len(data) > MAX_CASES_BYTES:
        raise UsageError(f"{FLAG} {path}: larger than {MAX_CASES_BYTES >> 20} MiB; a cases file "
                         f"holds at most {MAX_CASES} argument lines")
    cases = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{FLAG} {path} line {lineno}"
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"{where}: {exc}") from None
        if len(cases) == MAX_CASES:
            raise UsageError(f"{where}: more than {MAX_CASES} cases; split them over several jobs")
        check_case(argv, where)
        cases.append(argv)
    if not cases:
        raise UsageError(f"{FLAG} {path}: no cases (one p2p argument line per line)")
    return cases


def _agreed_cases(comm, path: str) -> list[list[str]]:
    """Every rank reads FILE; all end together, in one line, if any could not or if they differ."""
    cases, error = [], None
    try:
        cases = read_cases(path)
    except UsageError as exc:
        error = exc
    error = agree(comm, error)
    if error is None:
        digest = hashlib.sha256(repr(cases).encode()).hexdigest()
        if len(set(comm.allgather(digest))) > 1:
            error = UsageError(f"{FLAG} {path}: the ranks read different cases (one file per job)")
    if error is not None:
        raise error
    return cases


def case_status(comm, rc: int) -> int:
    """One exit status for a case on every rank: the lowest rank's non-zero status (a data
    check that fails on the decode rank alone was 1 there and 0 on rank 0, so the job's
    status was whichever rank mpirun saw end first). Collective, bounded by the watchdog."""
    return next((r for r in comm.allgather(rc) if r), 0)


def run_cases(cases: Iterable[Sequence[str]],
              after: Callable[[CaseResult, object], None] | None = None) -> int:
    """Each case through `kvbench p2p` in this MPI job (started here unless the caller runs
    it); `after(result, comm)` on every rank after each case (default: rank 0 prints its line).
    `cases` may be a generator (then read lazily: a case can depend on the ones before it)."""
    if not hasattr(cases, "__next__"):
        cases = list(cases)
    total = len(cases) if isinstance(cases, list) else None
    WATCHDOG.start(PROG, prescan([])[0])
    owned = mpi_world.init()
    comm = mpi_world.world()
    first_failure = 0
    try:
        for index, argv in enumerate(cases, 1):
            t0 = time.perf_counter()
            rc = case_status(comm, p2p.cli(list(argv)))
            result = CaseResult(index, total, tuple(argv), rc, time.perf_counter() - t0)
            if after is not None:
                after(result, comm)
            elif comm.Get_rank() == 0:
                print(result.line(), flush=True)
            first_failure = first_failure or rc
    finally:
        if owned:
            WATCHDOG.phase("tear-down")
            mpi_world.finalize()
    return first_failure


def cli(argv: Sequence[str]) -> int:
    """`kvbench p2p --cases FILE` (nothing else on the command line: flags go on each line)."""
    path = cases_file(list(argv))
    if path is None:
        if env_rank() in (None, 0):
            print(f"{PROG}: error: {CASES_ALONE}", file=sys.stderr)
        return EXIT_USAGE
    WATCHDOG.start(PROG, prescan([])[0])
    owned = mpi_world.init()
    try:
        comm = mpi_world.world()
        try:
            cases = _agreed_cases(comm, path)
        except UsageError as exc:
            if comm.Get_rank() == 0:
                print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return run_cases(cases)
    finally:
        if owned:
            WATCHDOG.phase("tear-down")
            mpi_world.finalize()
