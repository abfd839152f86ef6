"""`kvbench p2p`: the job's run on every rank: MPI up under the watchdog, the run
(kvbench.p2p.run), and the exit protocol: however a rank fails, every rank ends, with one
line (kvbench.p2p.job_end), and MPI down."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from kvbench.cli import UsageError
from kvbench.p2p import world as mpi_world
from kvbench.p2p.args import PROG, prescan
from kvbench.p2p.job_end import abort_job, await_the_end, report_and_end
from kvbench.p2p.run import run
from kvbench.p2p.transports.base import PeerReported, Reported, TransportError
from kvbench.p2p.watchdog import EXIT_STALLED, WATCHDOG


def cli(argv: Sequence[str] | None = None, written: dict | None = None) -> int:
    """`python -m kvbench.p2p`: MPI started and ended here (unless the caller already runs
    it), every wait on a peer bounded by --timeout (kvbench.p2p.watchdog). `written`: see
    kvbench.p2p.run.run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    timeout, stop_at = prescan(argv)
    WATCHDOG.start(PROG, timeout, stop_at)
    owned = mpi_world.init()
    comm = mpi_world.world()
    WATCHDOG.rank = comm.Get_rank()
    code = 1
    try:
        code = run(argv, comm, written)
    except SystemExit as exc:
        code = int(exc.code or 0)
    except PeerReported:
        code = await_the_end(comm)
    except Reported as exc:
        code = report_and_end(comm, exc)
    except TransportError as exc:
        abort_job(comm, str(exc), EXIT_STALLED)
    except UsageError as exc:  # found by one rank alone: the others may be waiting on it
        abort_job(comm, str(exc), exc.exit_code)
    except BaseException:  # a bug on one rank must not leave the others waiting forever
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    if owned:
        WATCHDOG.phase("tear-down")
        mpi_world.finalize()
    return code


if __name__ == "__main__":
    sys.exit(cli())
