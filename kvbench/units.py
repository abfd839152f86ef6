"""Units in one place, so no module invents its own.

Bytes are exact integers; GB and GB/s are decimal (1e9); MiB and GiB are binary.
"""

from __future__ import annotations

import math
import re

MIN_TIME_MS = 1e-9  # a femtosecond: a time below it (zero, denormal) is no time a timer measured,
# and dividing by it overflows; rates from such times are "none", never infinite
GB = 1_000_000_000


def rate_gbps(nbytes: float, ms: float | None) -> float | None:
    """Decimal GB/s of `nbytes` moved in `ms`; None for no time a timer measured (None, zero,
    denormal: below MIN_TIME_MS), never infinite and never a division by zero."""
    return nbytes / GB / (ms / 1e3) if ms is not None and ms >= MIN_TIME_MS else None
MiB = 1 << 20
GiB = 1 << 30

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]{1,20})\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE | re.ASCII)  # ASCII digits


def parse_bytes(text: str) -> int:
    """Parse '4K', '1M', '64MiB', '1G' (binary suffixes, nccl-tests style) into bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 4K, 1M, 64M, 1G)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def fmt_bytes(n: int) -> str:
    """Human form with a binary unit: 655360000 -> '625.0 MiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def gb_per_s(nbytes: int, ms: float) -> float | None:
    """Decimal GB/s for nbytes moved in ms milliseconds; None when no rate follows (a time of
    0, below the clock's resolution, or not a number): never an infinity in a record."""
    if not ms > 0 or not math.isfinite(ms):
        return None
    return nbytes / GB / (ms / 1000.0)


def transfer_ms(nbytes: int, effective_gb_s: float) -> float:
    """Milliseconds to move nbytes at a sustained effective_gb_s (decimal GB/s), no setup."""
    return nbytes / (effective_gb_s * GB) * 1000.0


def handoff_ms(setup_ms: float, nbytes: float, effective_gb_s: float, descriptors: float = 0,
               us_per_desc: float = 0) -> float:
    """One handoff by the model every plan and export uses (ms):

        setup_ms + descriptors x us_per_desc / 1000 + bytes / (GB/s x 1e9) x 1000

    effective_gb_s is a sustained rate without setup (decimal GB/s; the name every fit, plan
    and export uses for it); descriptors are the pieces one handoff posts, each costing
    us_per_desc microseconds (0: a model without that term). Works on numpy arrays too.
    Every `setup + bytes / rate` in kvbench is this function."""
    return setup_ms + descriptors * us_per_desc / 1000.0 + nbytes / (effective_gb_s * GB) * 1000.0


# Rounding for what kvbench writes: two rules, each with one name (fit documents keep
# significant digits, plan and model floors keep decimal places). None, infinities and NaN
# become None: a record holds no number that nothing measured.


def round_sig(x: float | None, digits: int = 6) -> float | None:
    """`x` to `digits` significant digits (fit documents: setup_ms, GB/s, their intervals and
    draws), as `format(x, ".6g")` writes it; None for None or a value that is not finite."""
    if x is None or not math.isfinite(x):
        return None
    return float(format(x, _SIG_FORMATS.get(digits) or f".{digits}g"))


_SIG_FORMATS = {d: f".{d}g" for d in range(1, 18)}  # (a fit writes ~25 a pair: made once)


def round_places(x: float | None, places: int = 6) -> float | None:
    """`x` to `places` decimal places (`round(x, 6)`: plan and model floors in ms, MiB/GiB);
    None for None or a value that is not finite."""
    if x is None or not math.isfinite(x):
        return None
    return round(x, places)
