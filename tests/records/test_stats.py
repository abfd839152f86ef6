"""stats: the sample-count rule for percentiles, and the table cells that follow it."""

from __future__ import annotations

import pytest

from kvbench.records.stats import (
    Measurement,
    min_samples_for,
    percentile_cell,
    percentile_if_supported,
    percentile_supported,
)


@pytest.mark.parametrize("q,need", [(0.5, 2), (50, 2), (0.9, 10), (0.95, 20), (95, 20),
                                    (0.99, 100), (99, 100), (0.999, 1000), (0.75, 4)])
def test_min_samples_for(q, need):
    assert min_samples_for(q) == need


@pytest.mark.parametrize("q", [0, 100, -5, 150])
def test_min_samples_for_rejects_nonsense(q):
    with pytest.raises(ValueError):
        min_samples_for(q)


def test_unsupported_percentiles_are_marked_not_printed():
    m = Measurement(list(range(1, 20)))  # 19 samples: p95 is the interpolated maximum
    assert not percentile_supported(95, len(m)) and percentile_supported(50, len(m))
    assert percentile_cell(m.p95, 95, len(m)) == "n/a (n<20)"
    assert percentile_cell(m.p99, 99, len(m)) == "n/a (n<100)"
    assert percentile_cell(m.p50, 50, len(m)) == "10.000"
    m.add(20)
    assert percentile_cell(m.p95, 95, len(m)) == f"{m.p95:.3f}"


def test_percentile_if_supported_takes_fractions_and_percentages():
    nineteen, twenty = list(range(1, 20)), list(range(1, 21))
    assert percentile_if_supported(nineteen, 95) is None
    assert percentile_if_supported(nineteen, 0.95) is None
    assert percentile_if_supported(twenty, 0.95) == percentile_if_supported(twenty, 95) == 19.05
    assert percentile_if_supported(twenty, 99) is None
