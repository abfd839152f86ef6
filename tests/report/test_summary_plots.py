"""Fit plots (kvbench/fit/plots.py): what a reader sees must be what was measured and fitted."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.fit.fitting import fit_records
from tests.conftest import committed
from tests.helpers import rounds_records

pytest.importorskip("matplotlib")


def _fits(setup_ms: float, sizes):
    fits, _ = fit_records(rounds_records(sizes, setup_ms, 1.0, seed=3), n_boot=200)
    return fits


def _rate_curve_max(ax) -> float:
    ys = [np.nanmax(line.get_ydata()) for line in ax.get_lines()
          if str(line.get_label()).startswith("model:")]
    return max(ys)


SLURM_SWEEP = "tests/data/runs/slurm-tcp-12/kvbench-p2p-20261203T094907Z.jsonl"


def test_a_negative_setup_draws_no_rate_spike():
    """The committed Slurm raw sweep (Gloo, 256 KiB .. 64 MiB) fits setup -0.29 ms: drawn as
    fitted, bytes / (setup + bytes / rate) passes its pole just above 256 KiB, a spike of tens
    to hundreds of GB/s on a panel whose samples sit below 3 GB/s."""
    from kvbench.fit import plots as report
    from kvbench.fit.data import read_groups
    from kvbench.fit.fitting import fit_groups

    groups, _ = read_groups([committed(SLURM_SWEEP)])
    (gf,), _ = fit_groups(groups, n_boot=200)
    assert gf.line.setup_ms < 0
    fig = report.figure([gf])
    try:
        ax_t, ax_r = fig.axes[:2]
        rate = gf.line.effective_gb_s
        assert _rate_curve_max(ax_r) <= rate * (1 + 1e-9)  # setup drawn as 0: never above it
        s = gf.samples
        fastest = float(np.max(s.bytes / 1e9 / (s.ms / 1e3)))
        top = ax_r.get_ylim()[1]
        assert fastest / 1.15 < top <= 1.15 * fastest, (top, fastest)  # the data, not a pole
        labels = [str(line.get_label()) for line in ax_t.get_lines()]
        assert any("setup 0" in lab for lab in labels), labels
        assert ax_t.get_ylim()[0] >= 0.5 * float(s.ms.min())  # not down to where the line hits 0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_positive_setup_keeps_its_model_curve():
    from kvbench.fit import plots as report

    (gf,) = _fits(0.5, [1 << 18, 1 << 20, 1 << 22, 1 << 24])
    fig = report.figure([gf])
    try:
        ax_r = fig.axes[1]
        curve = _rate_curve_max(ax_r)
        size = (1 << 24)
        want = size / 1e9 / (gf.line.predict(size) / 1000)
        assert curve == pytest.approx(want, rel=1e-6)  # the largest size's model rate
        assert "setup 0" not in " ".join(str(x.get_label()) for x in ax_r.get_lines())
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
