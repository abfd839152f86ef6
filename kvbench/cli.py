"""Shared command-line plumbing: one-line errors with exit status 2, list parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit status 2."""


EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error is one line (no usage dump) and exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def run_main(prog: str, fn: Callable[[Sequence[str] | None], int], argv=None) -> int:
    """Run fn(argv); turn UsageError into one stderr line and exit status 2."""
    try:
        return fn(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `... | head` is not an error
        return 0


def parse_positive_ints(text: str, what: str) -> list[int]:
    """'300,2000,8192' -> [300, 2000, 8192]; anything else is a UsageError."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"{what} must be positive integers, got {part!r}") from None
        if value <= 0:
            raise UsageError(f"{what} must be positive integers, got {value}")
        out.append(value)
    if not out:
        raise UsageError(f"{what}: empty list")
    return out


def parse_positive_floats(text: str, what: str) -> list[float]:
    """'100,25,10' -> [100.0, 25.0, 10.0]; zero, negatives and junk are a UsageError."""
    out = []
    for part in str(text).split(","):
        try:
            value = float(part)
        except ValueError:
            raise UsageError(f"{what} must be positive numbers, got {part.strip()!r}") from None
        if not value > 0 or value == float("inf"):
            raise UsageError(f"{what} must be positive numbers, got {part.strip()}")
        out.append(value)
    return out


def non_negative_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{what} must be a number, got {text!r}") from None
    if not value >= 0:
        raise UsageError(f"{what} must not be negative, got {text}")
    return value


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
