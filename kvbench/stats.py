"""A measurement keeps its raw samples and knows its own statistics (printing lives elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100."""
    if len(samples) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(samples, dtype=float), q))


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
        return {"p50_ms": self.p50, "p95_ms": self.p95, "p99_ms": self.p99, "mean_ms": self.mean,
                "min_ms": self.min, "max_ms": self.max, "iqr_ms": self.iqr}
