"""Shared command-line plumbing: one-line errors with their exit status, bounded numbers.

Every number a user types goes through the parsers here, so no command sees NaN, an
infinity, a denormal or a 310-digit integer: each is refused with one line and exit 2
before any work starts. Bounds are generous physical limits, not taste.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

EXIT_USAGE = 2  # bad input: a value, a file's content, a destination path
EXIT_IO = 3  # the system failed us while writing: disk full, I/O error

MAX_INT_DIGITS = 20
DEFAULT_MIN = 1e-9  # smallest positive value a flag takes unless it says otherwise
DEFAULT_MAX = 1e12  # largest value a flag takes unless it says otherwise


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit status 2."""

    exit_code = EXIT_USAGE


class OutputIOError(UsageError):
    """Writing failed for a reason that is not the user's input (disk full, I/O): exit 3."""

    exit_code = EXIT_IO


# errno values that mean "this path cannot be used" (the user's to fix: exit 2); any other
# OSError (disk full, I/O error) is the system's (exit 3)
PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR,
               errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST, errno.EINVAL, errno.EXDEV}


def path_error(path, exc: OSError, doing: str = "read") -> UsageError:
    """The one wording of a failed file operation, for readers and writers alike: one line
    naming the path and the reason; exit 2 for a bad path, 3 for an I/O failure. (Readers and
    writers reach it through kvbench.records.schema.read.path_kind and records.write.)"""
    cls = UsageError if exc.errno in PATH_ERRNOS else OutputIOError
    return cls(f"cannot {doing} {path}: {exc.strerror or exc}")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str) -> str:
    """text with control characters escaped (a newline in a path or in a file's content shows
    as \\n), so an error stays one line whatever it quotes."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


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
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it
EXIT_TERMINATED = 143  # SIGTERM


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


LIVE_TEMPS: set[str] = set()  # temp files the writers have open (kvbench.records.write)


def remove_live_temps() -> None:
    """Remove every temp file a writer still holds: an interrupt can land between the writer's
    steps (even inside its `finally`), so run_main sweeps up after it."""
    for tmp in list(LIVE_TEMPS):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        LIVE_TEMPS.discard(tmp)


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


# ---------------------------------------------------------------------------
# bounded numbers


def _g(x: float) -> str:
    return f"{x:g}"


def _range_text(lo: float | None, hi: float | None, lo_open: bool, integer: bool,
                plural: bool = False) -> str:
    """'a positive number (>= 1e-06, <= 1e+06)', 'positive integers (<= 1,000)' and the like."""
    noun = ("integers" if plural else "integer") if integer else ("numbers" if plural else "number")
    if lo is not None and (lo > 0 or (lo == 0 and lo_open)):
        kind = f"{'' if plural else 'a '}positive {noun}"
        bounds = [] if (lo == 0 or (integer and lo == 1)) else [f"{'>' if lo_open else '>='} {_g(lo)}"]
    elif lo == 0:
        kind, bounds = f"{'' if plural else 'a '}non-negative {noun}", []
    else:
        article = "" if plural else ("an " if integer else "a ")
        kind, bounds = f"{article}{noun}", [] if lo is None else [f">= {_g(lo)}"]
    if hi is not None:
        bounds.append(f"<= {hi:,}" if integer else f"<= {_g(hi)}")
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _short(text: str) -> str:
    text = str(text)
    return repr(text if len(text) <= 40 else text[:37] + "...")


def bounded_float(text: str, what: str, lo: float | None = 0.0, hi: float | None = DEFAULT_MAX, *,
                  lo_open: bool = False, plural: bool = False) -> float:
    """A finite float within [lo, hi] (or (lo, hi] with lo_open), else a UsageError line."""
    expected = _range_text(lo, hi, lo_open, False, plural)
    s = str(text).strip()
    try:
        if len(s) > 64 or not s.isascii() or "_" in s:  # float() also reads '１２' and '1_0'
            raise ValueError
        value = float(s)
    except ValueError:
        raise UsageError(f"{what} must be {expected}, got {_short(text)}") from None
    if not math.isfinite(value) or (lo is not None and (value < lo or (lo_open and value == lo))) \
            or (hi is not None and value > hi):
        raise UsageError(f"{what} must be {expected}, got {_short(text)}")
    if 0 < abs(value) < sys.float_info.min:  # a denormal: no unit kvbench uses is that small
        raise UsageError(f"{what} must be {expected}, got {_short(text)} (a denormal number)")
    return value


def bounded_int(text: str, what: str, lo: int | None = 1, hi: int | None = 10**12, *,
                plural: bool = False) -> int:
    """An integer within [lo, hi]; at most 20 digits are read (no 310-digit int() calls)."""
    expected = _range_text(lo, hi, False, True, plural)
    s = str(text).strip()
    digits = s[1:] if s[:1] in ("+", "-") else s  # one sign at most: int('--1') raises
    if not digits.isdigit() or len(digits) > MAX_INT_DIGITS or not digits.isascii():
        raise UsageError(f"{what} must be {expected}, got {_short(text)}")
    value = int(s)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise UsageError(f"{what} must be {expected}, got {_short(text)}")
    return value


def _items(text: str, what: str) -> list[str]:
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise UsageError(f"{what}: empty list")
    return parts


def parse_positive_ints(text: str, what: str, hi: int = 10**12) -> list[int]:
    """'300,2000,8192' -> [300, 2000, 8192]; anything else is a UsageError."""
    return [bounded_int(p, what, 1, hi, plural=True) for p in _items(text, what)]


def parse_positive_floats(text: str, what: str, lo: float = DEFAULT_MIN,
                          hi: float = DEFAULT_MAX) -> list[float]:
    """'100,25,10' -> [100.0, 25.0, 10.0]; zero, negatives, denormals, inf and junk are refused."""
    return [bounded_float(p, what, lo, hi, plural=True) for p in _items(text, what)]


def non_negative_float(text: str, what: str, hi: float = DEFAULT_MAX) -> float:
    return bounded_float(text, what, 0.0, hi)


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


def read_text(path, missing: str = "no such file") -> str:
    """A user-named file's text; a missing or unreadable file is a one-line UsageError."""
    from pathlib import Path

    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise UsageError(f"{missing}: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {p}: {exc}") from None
