"""`mpirun -n 2 python -m kvbench.p2p ...` (= `kvbench p2p`); with `--cases FILE`, every
argument line of FILE in turn in one job (kvbench.p2p.cases).

The job needs the `p2p` extra (torch for the KV tensors, mpi4py for the ranks), which
`pip install kvbench` leaves out so that fit, plan, slo, report and model install light.
Without it the job says in one line what to install, before importing anything of its own.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

NEEDS = ("torch", "mpi4py")


def missing_extra() -> list[str]:
    """The modules of the p2p extra this Python cannot import."""
    missing = []
    for name in NEEDS:
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it: not importable either
            found = False
        if not found:
            missing.append(name)
    return missing


def cli(argv=None) -> int:
    missing = missing_extra()
    if missing:
        what = " and ".join(missing)
        print(f"kvbench p2p: error: {what} {'is' if len(missing) == 1 else 'are'} not installed: "
              "pip install 'kvbench[p2p]' (fit, plan, slo, report and model run without it)",
              file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    from kvbench.p2p.args import asks_for_cases

    if asks_for_cases(argv):  # many runs, one job (--cases is declared in p2p's parser)
        from kvbench.p2p.cases import cli as run_cases

        return run_cases(argv)
    from kvbench.p2p.cli import cli as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(cli())
