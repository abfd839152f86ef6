"""Shared command-line plumbing: the argument parser, run_main (one-line errors, stop
signals), argparse types for bounded numbers, --format.

Every number a user types goes through the bounded parsers (kvbench.errors), so no command
sees NaN, an infinity, a denormal or a 310-digit integer: each is refused with one line and
exit 2 before any work starts. The errors, exit codes and number parsers live in
kvbench.errors, which libraries (records, fit, plan) import; they are re-exported here for
the commands.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from kvbench.errors import (  # noqa: F401 (re-exported for commands and older callers)
    DEFAULT_MAX,
    DEFAULT_MIN,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_TERMINATED,
    EXIT_USAGE,
    LIVE_TEMPS,
    MAX_INT_DIGITS,
    PATH_ERRNOS,
    OutputIOError,
    UsageError,
    bounded_float,
    bounded_int,
    list_items,
    non_negative_float,
    one_line,
    parse_int_pair,
    parse_positive_floats,
    parse_positive_ints,
    parse_words,
    path_error,
    read_text,
    remove_live_temps,
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error is one line (no usage dump) and exit status 2; an empty
    --out/--plot is refused (it used to mean the default silently)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {one_line(message)} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            flags = [f for f in action.option_strings if f in PATH_FLAGS]
            if flags and getattr(ns, action.dest, None) == "":
                self.error(f"argument {flags[0]}: an empty path (give a name, or leave the flag "
                           "out for the default)")
        return ns, rest


PATH_FLAGS = ("--out", "--plot", "--out-dir", "-o")


SIGNAL_GRACE_S = 5.0  # a stop signal ends the process this long after it, whatever swallowed it


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that every `finally` (temp files) runs."""


class _Backstop:
    """Ends the process once a stop signal's exception has been lost: SIGNAL_GRACE_S after the
    signal, as soon as the main thread is neither reporting it (run_main disarms) nor
    unwinding with it (a `finally` or `except` that is cleaning up, however long).

    Why: Python runs a signal's handler at the next bytecode, and C code in between may
    swallow the exception it raises. Seen here: SIGTERM landing while `import numpy.random`
    loaded its extension modules was lost, and `kvbench slo synth` ran on for minutes (about
    1 in 8 tries; docs/robustness.md). The backstop removes the writers' temp files, prints
    the same line and exits with the same status. Code that catches the interrupt on purpose
    and carries on calls `stop_signal_handled()`."""

    def __init__(self):
        self.armed: tuple[str, int, str] | None = None

    def arm(self, prog: str, code: int, line: str) -> None:
        if self.armed is None:
            self.armed = (prog, code, line)
            threading.Thread(target=self._watch, name="kvbench-signal-backstop", daemon=True).start()

    def disarm(self) -> None:
        self.armed = None

    def _watch(self) -> None:
        time.sleep(SIGNAL_GRACE_S)
        while self.armed is not None and _main_thread_unwinding():
            time.sleep(0.2)
        armed = self.armed
        if armed is not None:
            prog, code, line = armed
            remove_live_temps()
            print(f"{prog}: {line}", file=sys.stderr, flush=True)
            os._exit(code)


def _main_thread_unwinding() -> bool:
    """Whether the main thread is inside an except or finally block of an interrupt."""
    current = sys._current_exceptions().get(threading.main_thread().ident)
    exc = current[1] if isinstance(current, tuple) else current  # a tuple before Python 3.12
    return isinstance(exc, KeyboardInterrupt)


def stop_signal_handled() -> None:
    """Call where code catches Ctrl-C or SIGTERM on purpose and goes on (e.g. a scrape that
    keeps what it has): the backstop then leaves the process alone."""
    _BACKSTOP.disarm()


_BACKSTOP = _Backstop()
_TERMINATED_LINE = "terminated (SIGTERM); nothing was written"
_INTERRUPTED_LINE = "interrupted (Ctrl-C); nothing was written"


@contextlib.contextmanager
def _stop_signals_raise(prog: str):
    """SIGTERM raises Terminated and Ctrl-C KeyboardInterrupt, each with the backstop armed.
    An inherited SIG_IGN for SIGINT (a script's background job) is kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        _BACKSTOP.arm(prog, EXIT_TERMINATED, _TERMINATED_LINE)
        raise Terminated

    def on_int(signum, frame):
        _BACKSTOP.arm(prog, EXIT_INTERRUPTED, _INTERRUPTED_LINE)
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.getsignal(signal.SIGINT)
    if old_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if old_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, old_int)


def run_main(prog: str, fn: Callable[[Sequence[str] | None], int], argv=None) -> int:
    """Run fn(argv); a UsageError is one stderr line and its exit status (2, or 3 for I/O).

    Ctrl-C is one line and exit 130, SIGTERM one line and 143, each after the writers removed
    their temp files (the signal is an exception, so every `finally` runs). An OSError that no
    reader or writer wrapped is still one line naming its file.
    """
    try:
        try:
            with _stop_signals_raise(prog):
                return fn(argv)
        finally:
            remove_live_temps()
    except UsageError as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `... | head` is not an error
        return 0
    except Terminated:
        _BACKSTOP.disarm()
        print(f"{prog}: {_TERMINATED_LINE}", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        _BACKSTOP.disarm()
        print(f"{prog}: {_INTERRUPTED_LINE}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        err = (path_error(exc.filename, exc, "use") if exc.filename else
               path_error("the output (standard output or a stream with no name)", exc, "write"))
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return err.exit_code


def arg_float(lo: float | None = 0.0, hi: float | None = DEFAULT_MAX, *, lo_open: bool = False):
    """An argparse `type=` for a bounded float: a bad value is argparse's one-line error."""
    def parse(text: str) -> float:
        try:
            return bounded_float(text, "value", lo, hi, lo_open=lo_open)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None
    return parse


def arg_int(lo: int | None = 1, hi: int | None = 10**12):
    """An argparse `type=` for a bounded integer."""
    def parse(text: str) -> int:
        try:
            return bounded_int(text, "value", lo, hi)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None
    return parse


class OldSpelling(argparse.Action):
    """A flag that is gone: given (with or without a value), the parse ends in one usage line,
    `hint(flag, value)`, naming the new spelling, through the parser's own error (so under
    MPI rank 0 speaks and every rank exits 2, and a --cases line names itself)."""

    def __init__(self, option_strings, dest, hint: Callable[[str, object], str], **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.hint(option_string, values))


FORMAT_HELP = "table or json (default: table on a terminal, JSON when piped or redirected)"


def output_format(given: str | None) -> str:
    """--format, or by where stdout goes: a person at a terminal reads the table; a pipe, a
    file or another program gets the JSON."""
    if given:
        return given
    try:
        return "table" if sys.stdout.isatty() else "json"
    except (AttributeError, ValueError):  # a replaced or closed stdout
        return "json"




def each_once(paths: Sequence[str], prog: str) -> list[str]:
    """Each input file once: `f.jsonl ./f.jsonl` (or a link to it) names the same records
    twice, and reading both would count every sample twice. Files are the same when their
    device and inode are (os.path.samefile's test); a note on stderr names each one dropped."""
    kept: list[tuple[str, tuple[int, int] | str]] = []
    for p in paths:
        try:
            st = os.stat(p)
            ident: tuple[int, int] | str = (st.st_dev, st.st_ino)
        except OSError:
            ident = os.path.abspath(p)  # the reader words the error when it opens it
        first = next((q for q, i in kept if i == ident), None)
        if first is not None:
            print(f"{prog}: note: {p} is {first}, given already: read once", file=sys.stderr)
            continue
        kept.append((p, ident))
    return [p for p, _ in kept]
