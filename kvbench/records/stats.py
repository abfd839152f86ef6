"""A measurement keeps its raw samples and knows its own statistics, and the one rule for when
a percentile means what it says (printing lives elsewhere)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100."""
    if len(samples) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(samples, dtype=float), q))


def min_samples_for(q: float) -> int:
    """Fewest samples for which a q-quantile is more than the sample maximum: n >= ceil(1/(1-q)).

    With fewer, the top 1-q of the distribution holds less than one sample and the
    "percentile" is an interpolation towards the largest value seen. q is a fraction in
    (0, 1) (0.95) or a percentage in [1, 100) (95): p50 needs 2, p95 20, p99 100."""
    frac = q / 100 if q >= 1 else q
    if not 0 < frac < 1:
        raise ValueError(f"quantile must lie in (0, 1) or [1, 100), got {q}")
    return math.ceil(round(1 / (1 - frac), 9))  # round: 1/(1-0.99) is 100.00000000000009


def percentile_if_supported(samples: Sequence[float], q: float) -> float | None:
    """The q-quantile of the samples (q as in min_samples_for), or None where their number
    cannot support it (a p99 of 20 samples is about their maximum)."""
    if len(samples) < min_samples_for(q):
        return None
    return percentile(samples, q if q >= 1 else 100 * q)


def percentile_supported(q: float, n: int) -> bool:
    return n >= min_samples_for(q)


def percentile_cell(value: float, q: float, n: int, fmt: str = ".3f") -> str:
    """A table cell: the value, or 'n/a (n<20)' where n samples cannot support the q-quantile."""
    need = min_samples_for(q)
    return format(value, fmt) if n >= need else f"n/a (n<{need})"


@dataclass
class Measurement:
    """Raw per-iteration times in milliseconds, plus the summary every report needs."""

    samples_ms: list[float] = field(default_factory=list)

    def add(self, ms: float) -> None:
        self.samples_ms.append(float(ms))

    def __len__(self) -> int:
        return len(self.samples_ms)

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p95(self) -> float:
        return percentile(self.samples_ms, 95)

    @property
    def p99(self) -> float:
        return percentile(self.samples_ms, 99)

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples_ms)) if self.samples_ms else float("nan")

    @property
    def min(self) -> float:
        return float(np.min(self.samples_ms)) if self.samples_ms else float("nan")

    @property
    def max(self) -> float:
        return float(np.max(self.samples_ms)) if self.samples_ms else float("nan")

    @property
    def iqr(self) -> float:
        return percentile(self.samples_ms, 75) - percentile(self.samples_ms, 25)

    def summary(self) -> dict[str, float]:
        """The properties' values, the five percentiles from one np.percentile call (each q is
        computed as alone: the same bits; a matrix job's rank 0 summarises millions)."""
        if not self.samples_ms:
            nan = float("nan")
            return {"p50_ms": nan, "p95_ms": nan, "p99_ms": nan, "mean_ms": nan, "min_ms": nan,
                    "max_ms": nan, "iqr_ms": nan}
        a = np.asarray(self.samples_ms, dtype=float)
        p50, p95, p99, p25, p75 = (float(x) for x in np.percentile(a, [50, 95, 99, 25, 75]))
        return {"p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "mean_ms": float(np.mean(a)),
                "min_ms": float(np.min(a)), "max_ms": float(np.max(a)), "iqr_ms": p75 - p25}
