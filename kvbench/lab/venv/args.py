"""Command-line parsing for the modules that run inside the lab venv (standard library only).

They import no kvbench module outside lab.venv (kvbench.cli may grow imports the lab venv
lacks), but a bad flag must still read as kvbench's do: one line on stderr, exit status 2,
no usage dump.
"""

from __future__ import annotations

import argparse
import math
import sys

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse whose parse error is a single escaped line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {_escaped(message)} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _escaped(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def number(kind: type, lo: float, hi: float, lo_open: bool = False):
    """An argparse `type=` for an int or a finite float within [lo, hi] ((lo, hi] if lo_open)."""
    def parse(text: str):
        s = text.strip()
        try:  # int() and float() also read '1_0' and full-width digits; refuse both
            value = kind(s) if len(s) <= 40 and s.isascii() and "_" not in s else None
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value > hi or value < lo \
                or (lo_open and value == lo) or 0 < abs(value) < sys.float_info.min:
            show = (lambda v: str(int(v))) if kind is int else (lambda v: f"{v:g}")
            bound = f"{'(' if lo_open else '['}{show(lo)}, {show(hi)}]"
            raise argparse.ArgumentTypeError(f"must be a{'n integer' if kind is int else ' number'} "
                                             f"in {bound}, got {text[:40]!r}")
        return value
    return parse
