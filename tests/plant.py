"""Run p2p configurations in one MPI job, optionally with one of the protocol's device orderings
planted out, and report what each run saw. Used by tests/p2p/test_engine.py:

    mpirun -n N python -m tests.plant FAULT CASES_FILE

Each line of CASES_FILE is `name<TAB>p2p arguments`; the cases run in one job through
kvbench.p2p.cases (what `kvbench p2p --cases` runs; records go where each --out says) and
rank 0 prints one JSON line per case:
{"case": name, "rc": exit status, "waits": host waits per rank, "seconds": wall time}.

Faults (each removes exactly one ordering the engine owes the device; see kvbench/p2p/engine.py):
    none                  the code as it is
    no-readiness          the engine hands transports no readiness event after producing
    no-order-before-post  fills/wipes (set-up and data check) are not synchronised before posting
    no-device-completion  the receiver sends its notice without synchronising its device
    sync-per-post         NIXL synchronises the device at every post (the old behaviour)
    host-wait-per-step    a held post (mpi device-direct and host-staged, gloo host-staged,
                          nixl) waits on its step's event on the host first (before issue 40
                          item 6: no overlap)
"""

from __future__ import annotations

import json
import shlex
import sys

from kvbench.p2p import engine
from kvbench.p2p import run as p2p
from kvbench.p2p.cases import run_cases


def plant(fault: str) -> None:
    if fault == "no-readiness":
        engine.Engine._readiness = lambda self: None
    elif fault == "no-order-before-post":
        engine.Engine._order_before_first_post = lambda self: None
    elif fault == "no-device-completion":
        engine.Engine._complete_on_device = lambda self: None
    elif fault == "sync-per-post":
        from kvbench.p2p.transports.nixl import channel as nixl

        post = nixl.NIXLChannel.post

        def post_and_sync(self, i, ready=None):
            self.t.ctx.dev.synchronize()
            return post(self, i, ready)

        nixl.NIXLChannel.post = post_and_sync
    elif fault == "host-wait-per-step":
        from kvbench.p2p.transports.base import HeldPosts

        hold = HeldPosts.hold

        def wait_then_hold(self, gate, post):
            if gate is not None:
                gate.wait()
            return hold(self, gate, post)

        HeldPosts.hold = wait_then_hold
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault}")


def host_waits(dev) -> int:
    """The host's waits on the device, its copy stream's included (cpu-async keeps that
    stream's count on its own second device)."""
    side = getattr(dev, "_copy", None)
    return dev.host_waits + (side.host_waits if side is not None else 0)


def main() -> None:
    """Read the named cases, plant the fault, and run them as one job (kvbench.p2p.cases);
    after each, rank 0 prints its JSON line with every rank's host waits."""
    fault, path = sys.argv[1], sys.argv[2]
    named = [line.rstrip("\n").split("\t") for line in open(path) if line.strip()]
    plant(fault)
    made = []
    make = p2p.make_device

    def recording(name):
        made.append(make(name))
        return made[-1]

    p2p.make_device = recording

    def report(case, comm) -> None:
        waits = comm.gather(host_waits(made[-1]) if made else None, root=0)
        if comm.Get_rank() == 0:
            print(json.dumps({"case": named[case.index - 1][0], "rc": case.rc, "waits": waits,
                              "seconds": round(case.seconds, 2)}), flush=True)

    run_cases([shlex.split(args) for _, args in named], after=report)


if __name__ == "__main__":
    main()
