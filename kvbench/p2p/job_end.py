"""How a job ends after a failure on one rank: the failing rank's one line, then a barrier
every rank can reach (a normal exit), or MPI_Abort where a peer may never learn of it. No
rank is left waiting; the watchdog (kvbench.p2p.watchdog) bounds every wait here too."""

from __future__ import annotations

import sys

from kvbench.p2p.args import PROG
from kvbench.p2p.transports.base import Reported
from kvbench.p2p.watchdog import EXIT_STALLED, WATCHDOG


def await_the_end(comm) -> int:
    """A peer reports this failure in its own line: wait for the end without a second line.
    The peer either joins this barrier (the failure is known to every rank: both then exit
    normally, after the launcher has forwarded its line) or aborts the job; should neither
    come, the watchdog ends this rank after --timeout."""
    with WATCHDOG.bounded("the job's end after a peer's error"):
        comm.Barrier()
    return EXIT_STALLED


def report_and_end(comm, exc: Reported) -> int:
    """This rank's failure, known to its peer: one line, then a barrier with every rank when
    every rank knows (the pair is the job, or the error was agreed over MPI), else the abort.
    A normal exit lets the launcher forward the line; MPI_Abort may end the job first."""
    if not (exc.everyone or comm.Get_size() == 2):
        abort_job(comm, str(exc), EXIT_STALLED)
    print(f"{PROG}: error: rank {comm.Get_rank()}: {WATCHDOG.current}: {exc}; ending the job",
          file=sys.stderr, flush=True)
    with WATCHDOG.bounded("the job's end after this rank's error"):
        comm.Barrier()
    return EXIT_STALLED


def abort_job(comm, message: str, code: int) -> None:
    print(f"{PROG}: error: rank {comm.Get_rank()}: {WATCHDOG.current}: {message}; aborting the "
          "job", file=sys.stderr, flush=True)
    comm.Abort(code)
