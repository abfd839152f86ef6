"""The foundation every layer may import: errors with their exit status, the one wording of
a failed path, bounded numbers, and the registry of writers' temp files.

Why here and not in kvbench/cli.py: records, fit and plan raise UsageError and validate
numbers, but they are libraries, not commands; a library that imported the command
plumbing would point the dependency arrow the wrong way. kvbench/cli.py builds on this
module (parsers, run_main, signals) and re-exports its names for older callers.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import sys

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


EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it
EXIT_TERMINATED = 143  # SIGTERM


LIVE_TEMPS: set[str] = set()  # temp files the writers have open (kvbench.records.write)


def remove_live_temps() -> None:
    """Remove every temp file a writer still holds: an interrupt can land between the writer's
    steps (even inside its `finally`), so run_main sweeps up after it."""
    for tmp in list(LIVE_TEMPS):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        LIVE_TEMPS.discard(tmp)


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


def list_items(text: str, what: str, sep: str = ",") -> list[str]:
    """The one empty-value rule of every list flag: the items of `text`, stripped; an empty
    value (`--kv-pages ''`) or an empty item (`4,,16`, `16,`) is refused naming the flag. A
    flag not given is None and never reaches here: its default is the caller's, never ''."""
    parts = [p.strip() for p in str(text).split(sep)]
    if not any(parts):
        raise UsageError(f"{what}: empty list (give at least one item, or leave the flag out "
                         "for its default)")
    if not all(parts):
        raise UsageError(f"{what}: empty item in {_short(text)}")
    return parts


def parse_positive_ints(text: str, what: str, hi: int = 10**12) -> list[int]:
    """'300,2000,8192' -> [300, 2000, 8192]; anything else is a UsageError."""
    return [bounded_int(p, what, 1, hi, plural=True) for p in list_items(text, what)]


def parse_int_pair(text: str, what: str, sep: str, lo: int, hi: int, form: str) -> tuple[int, int]:
    """'2:1' -> (2, 1): two integers in [lo, hi] joined by `sep`, each read by bounded_int
    (ASCII digits only: '２:１' and '²:1' are refused naming the flag, never read as 2:1 or
    a traceback from int()). `form` says what was expected, e.g. 'PREFILL_TP:DECODE_TP'."""
    a, found, b = str(text).strip().partition(sep)
    try:
        if not found:
            raise UsageError("")
        return bounded_int(a, what, lo, hi), bounded_int(b, what, lo, hi)
    except UsageError:
        raise UsageError(f"{what} expects {form}, each an integer {lo:,} .. {hi:,}, got "
                         f"{_short(text)}") from None


def parse_words(text: str, what: str, choices: tuple[str, ...], prefixes: tuple[str, ...] = ()
                ) -> list[str]:
    """A list of named values ('joint,split'), each one of `choices` or starting with one of
    `prefixes` ('file:'); the empty-value rule is list_items'."""
    items = list_items(text, what)
    for item in items:
        if item not in choices and not any(item.startswith(p) and item[len(p):] for p in prefixes):
            extra = "".join(f" or {p}..." for p in prefixes)
            raise UsageError(f"{what}: {_short(item)} is not one of {', '.join(choices)}{extra}")
    return items


def parse_positive_floats(text: str, what: str, lo: float = DEFAULT_MIN,
                          hi: float = DEFAULT_MAX) -> list[float]:
    """'100,25,10' -> [100.0, 25.0, 10.0]; zero, negatives, denormals, inf and junk are refused."""
    return [bounded_float(p, what, lo, hi, plural=True) for p in list_items(text, what)]


def non_negative_float(text: str, what: str, hi: float = DEFAULT_MAX) -> float:
    return bounded_float(text, what, 0.0, hi)


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
