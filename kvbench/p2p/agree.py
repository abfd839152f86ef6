"""Error agreement across ranks: one rank's bad input ends every rank together, with one
line from rank 0, instead of leaving the others waiting on a collective it never joins."""

from __future__ import annotations

import sys

from kvbench.cli import EXIT_USAGE, UsageError
from kvbench.p2p.args import PROG


def agree(comm, error: UsageError | str | None) -> UsageError | None:
    """Every rank learns the first error any rank hit, and its exit status (2, or 3 for an
    I/O failure), so all can exit together."""
    mine = None if error is None else (str(error), getattr(error, "exit_code", EXIT_USAGE))
    errors = comm.allgather(mine)
    hit = [(rank, e) for rank, e in enumerate(errors) if e]
    if not hit:
        return None
    rank, (message, code) = hit[0]
    if len({e[0] for _, e in hit}) > 1:
        message = f"rank {rank}: {message}"
    exc = UsageError(message)
    exc.exit_code = code
    return exc


def usage_exit(rank: int, error: UsageError | str) -> int:
    """An agreed error's exit: rank 0 prints its one line; every rank returns its status."""
    if rank == 0:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return getattr(error, "exit_code", EXIT_USAGE)
