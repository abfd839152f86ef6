"""Every wait on a peer ends: a watchdog thread that aborts the job when one does not.

The handoff itself is polled against a deadline (kvbench.p2p.engine, kvbench.p2p.harness). What is
left is every *blocking* call on other ranks: MPI start-up, collectives that gather records
or agree on an error, communicator set-up, a transport's rendezvous, MPI_Finalize. Each of
those runs inside `WATCHDOG.bounded(what)`: a deadline `--timeout` seconds ahead that a
separate thread watches. If the call has not returned by then, the thread prints one line
naming the phase and the call, and aborts the whole job (`MPI_Abort`, or `_exit` before MPI
is up), so a stopped or dead peer costs `--timeout` plus the abort, never a hang.

This works because the calls it guards release Python's GIL while they wait (mpi4py does for
every blocking call kvbench makes, except the pickle-based `allreduce`, which kvbench does
not use, and `MPI.Init_thread`/`MPI.Finalize`, which kvbench.p2p.world calls through ctypes
instead). As a backstop for a library that keeps the GIL while it waits, each bounded call
also arms the kernel's alarm clock (SIGALRM, default action) a few seconds past the
deadline: the process then dies without its line, but the job still ends.

Phases are named for the user (`phase(name)`); a hidden p2p flag (`--debug-stop RANK:PHASE`)
makes a rank SIGSTOP itself when it enters a phase, which is how the tests stop a peer at a
chosen moment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

EXIT_STALLED = 3  # the environment failed (a peer stopped answering), not the user's input
BACKSTOP_S = 5.0  # SIGALRM this long after a missed deadline, if the watchdog could not act
ABORT_GRACE_S = 10.0  # _exit if MPI_Abort itself has not ended the process by then
HELD_S = 1.0  # a rank held this long at the door of MPI start-up (stopped, starved) ...
RESUME_GRACE_S = 2.0  # ... waits this long before it connects to the launcher

# in the order a run goes through them (set-up .. gathering records repeat per point in
# --order blocks)
PHASES = ("MPI start-up", "validation", "preparation", "connect", "set-up", "warm-up", "timing",
          "gathering samples", "data check", "gathering records", "baseline", "tear-down")


def slug(phase: str) -> str:
    return phase.lower().replace(" ", "-")


def env_rank() -> int | None:
    """This process's rank from the launcher's environment (before MPI is up)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


class Watchdog:
    """One per process (`WATCHDOG`). Inactive until `start()`: library code that calls
    `bounded()` without a running job (tests, other commands) pays nothing."""

    def __init__(self):
        self.prog = "kvbench"
        self.rank: int | None = None
        self.timeout_s = 120.0
        self.current = "start-up"
        self.entered = time.monotonic()  # when the current phase began (counts time stopped)
        self.stop_at: tuple[int, str] | None = None
        self._deadline: float | None = None
        self._what = ""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.abort = _abort

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self, prog: str, timeout_s: float, stop_at: tuple[int, str] | None = None) -> None:
        self.prog, self.timeout_s, self.stop_at = prog, timeout_s, stop_at
        if self.rank is None:
            self.rank = env_rank()
        if self._thread is None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the backstop: the alarm kills
            self._thread = threading.Thread(target=self._watch, name="kvbench-watchdog", daemon=True)
            self._thread.start()

    def phase(self, name: str) -> None:
        """Enter a phase (named in the line a timeout prints). Cheap: two assignments."""
        self.current, self.entered = name, time.monotonic()
        if self.stop_at is not None and self.stop_at == (self.rank, slug(name)):
            print(f"{self.prog}: debug: rank {self.rank} stops itself (SIGSTOP) entering the "
                  f"{name} phase", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def leave_if_held(self, what: str) -> None:
        """Call right before `what` connects this rank to the launcher. If more than
        HELD_S passed since the rank entered the phase (the code between takes
        microseconds: it was stopped and continued, or starved), wait RESUME_GRACE_S; then
        exit 3 if it was held for longer than --timeout.

        Why: a peer that waited on this rank gave up after --timeout and the launcher is
        tearing the job down. Open MPI 5's prterun does that by SIGCONT, then SIGTERM
        0.25 s later; a rank resumed in between went on into MPI_Init, connected to
        prterun's PMIx server and was killed mid-handshake, and prterun then hung for good
        (PMIX_ERR_UNREACH, no child left; 1 to 4 of 4 loaded runs, strace in
        docs/robustness.md). The wait lets that SIGTERM (default action) land first; a rank
        a person continued goes on 2 s later. (A SIGCONT handler would say "stopped" more
        exactly, but Python runs it on the main thread some bytecodes after the resume,
        and in the strace the rank had connected by then.) Joining a job its peers have
        left serves no one."""
        if self._thread is None or time.monotonic() - self.entered <= HELD_S:
            return
        time.sleep(RESUME_GRACE_S)
        held = time.monotonic() - self.entered
        if held <= self.timeout_s:
            return
        who = "" if self.rank is None else f"rank {self.rank}: "
        print(f"{self.prog}: error: {who}{self.current}: held {held:.1f} s before "
              f"{what} (stopped or starved), past --timeout {self.timeout_s:g} s; its peers "
              "have given up: leaving the job", file=sys.stderr, flush=True)
        os._exit(EXIT_STALLED)

    @contextlib.contextmanager
    def bounded(self, what: str):
        """Run the body with a deadline --timeout ahead (nested: the inner one counts, and
        the outer one starts afresh when it ends)."""
        if self._thread is None:
            yield
            return
        outer = self._deadline is not None
        saved = self._what
        self._arm(what)
        try:
            yield
        finally:
            if outer:
                self._arm(saved)
            else:
                self._disarm()

    def kick(self) -> None:
        """Progress inside a long bounded region: the deadline starts afresh."""
        if self._deadline is not None:
            self._deadline = time.perf_counter() + self.timeout_s
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s + BACKSTOP_S)

    def _arm(self, what: str) -> None:
        with self._cond:
            self._what = what
            self._deadline = time.perf_counter() + self.timeout_s
            self._cond.notify()
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s + BACKSTOP_S)

    def _disarm(self) -> None:
        self._deadline = None
        signal.setitimer(signal.ITIMER_REAL, 0)

    def _watch(self) -> None:
        with self._cond:
            while True:
                deadline = self._deadline
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fire()

    def message(self) -> str:
        who = "" if self.rank is None else f"rank {self.rank}: "
        return (f"{self.prog}: error: {who}{self.current}: {self._what} got no answer within "
                f"--timeout {self.timeout_s:g} s (a peer stopped answering or died); aborting "
                "the job")

    def _fire(self) -> None:
        print(self.message(), file=sys.stderr, flush=True)
        self.abort(EXIT_STALLED)


def _abort(code: int) -> None:
    """End the whole job from the watchdog thread: MPI_Abort once MPI is up (the launcher
    then kills every rank, stopped ones included), else this process alone (the launcher
    sees it die and ends the job)."""
    threading.Timer(ABORT_GRACE_S, os._exit, (code,)).start()
    MPI = sys.modules.get("mpi4py.MPI")  # never imported here: importing may start MPI
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)
    except Exception:  # noqa: BLE001 - nothing left to try but leaving
        pass
    os._exit(code)


WATCHDOG = Watchdog()
