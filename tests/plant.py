"""Run p2p configurations in one MPI job, optionally with one of the protocol's device orderings
planted out, and report what each run saw. Used by tests/p2p/test_engine.py:

    mpirun -n N python -m tests.plant FAULT CASES_FILE

Each line of CASES_FILE is `name<TAB>p2p arguments`; the driver runs `kvbench.p2p.cli` on it
(records go where its --out says) and rank 0 prints one JSON line per case:
{"case": name, "rc": exit status, "waits": host waits per rank, "seconds": wall time}.

Faults (each removes exactly one ordering the engine owes the device; see kvbench/p2p/engine.py):
    none                  the code as it is
    no-readiness          the engine hands transports no readiness event after producing
    no-order-before-post  fills/wipes (set-up and data check) are not synchronised before posting
    no-device-completion  the receiver sends its notice without synchronising its device
    sync-per-post         NIXL synchronises the device at every post (the old behaviour)
"""

from __future__ import annotations

import json
import shlex
import sys
import time

from mpi4py import MPI

from kvbench.p2p import cli as p2p
from kvbench.p2p import engine


def plant(fault: str) -> None:
    if fault == "no-readiness":
        engine.Engine._readiness = lambda self: None
    elif fault == "no-order-before-post":
        engine.Engine._order_before_first_post = lambda self: None
    elif fault == "no-device-completion":
        engine.Engine._complete_on_device = lambda self: None
    elif fault == "sync-per-post":
        from kvbench.p2p.transports import nixl

        post = nixl.NIXLChannel.post

        def post_and_sync(self, i, ready=None):
            self.t.ctx.dev.synchronize()
            return post(self, i, ready)

        nixl.NIXLChannel.post = post_and_sync
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault}")


def main() -> None:
    fault, cases = sys.argv[1], sys.argv[2]
    plant(fault)
    made = []
    make = p2p.make_device

    def recording(name):
        made.append(make(name))
        return made[-1]

    p2p.make_device = recording
    comm = MPI.COMM_WORLD
    for line in open(cases):
        if not line.strip():
            continue
        name, args = line.rstrip("\n").split("\t")
        t0 = time.perf_counter()
        rc = p2p.cli(shlex.split(args))
        waits = comm.gather(made[-1].host_waits if made else None, root=0)
        if comm.Get_rank() == 0:
            print(json.dumps({"case": name, "rc": rc, "waits": waits,
                              "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


if __name__ == "__main__":
    main()
