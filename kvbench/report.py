"""Plots of fitted handoff measurements (matplotlib, from the `plot` extra).

One row per group: time against bytes with every raw sample, the fitted line and its
bootstrap 95% band; and the end-to-end GB/s of each sample against payload size, with
the curve the fitted model implies and its asymptote (the effective rate).
"""

from __future__ import annotations

import io
import textwrap

import numpy as np

from kvbench.cli import UsageError
from kvbench.units import GB, fmt_bytes

MAX_GROUPS = 8


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvbench[plot]'") from None


def _size_ticks(ax, sizes) -> None:
    ticks = list(sizes) if len(sizes) <= 8 else list(sizes[:: max(1, len(sizes) // 8)])
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt_bytes(int(t)).replace(".0 ", " ") for t in ticks], rotation=30,
                       ha="right", fontsize=8)
    ax.minorticks_off()


def plot_fits(fits, title: str | None = None) -> bytes:
    """PNG bytes for up to MAX_GROUPS GroupFit objects (kvbench.fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = list(fits)[:MAX_GROUPS]
    fig, axes = plt.subplots(len(fits), 2, figsize=(12, 4.4 * len(fits)), squeeze=False)
    for (ax_t, ax_r), gf in zip(axes, fits, strict=True):
        s, rec, line = gf.samples, gf.record, gf.line
        outlier = np.zeros(len(s.ms), dtype=bool)
        if line is not None and line.weights is not None:
            outlier = line.weights <= 0
        ax_t.scatter(s.bytes[~outlier], s.ms[~outlier], s=12, alpha=0.45, color="tab:blue",
                     label="samples", zorder=2)
        if outlier.any():
            ax_t.scatter(s.bytes[outlier], s.ms[outlier], s=22, marker="x", color="tab:red",
                         label=f"outliers (weight 0): {int(outlier.sum())}", zorder=3)
        gbs = np.divide(s.bytes / GB, s.ms / 1000.0, out=np.full(len(s.ms), np.nan),
                        where=s.ms > 0)
        ax_r.scatter(s.bytes[~outlier], gbs[~outlier], s=12, alpha=0.45, color="tab:blue",
                     label="samples (bytes / time)", zorder=2)
        if outlier.any():
            ax_r.scatter(s.bytes[outlier], gbs[outlier], s=22, marker="x", color="tab:red",
                         label="outliers (weight 0)", zorder=3)
        p50 = np.array([np.median(s.ms[sl]) for sl in s.slices])
        ax_t.plot(s.sizes, p50, "o", mfc="none", mec="k", ms=7, label="p50 per size", zorder=4)
        ax_r.plot(s.sizes, s.sizes / GB / (p50 / 1000.0), "o", mfc="none", mec="k", ms=7,
                  label="p50 per size", zorder=4)
        grid = np.geomspace(s.sizes[0], s.sizes[-1], 200)
        if line is not None:
            pred = line.predict(grid)
            rate = line.effective_gb_s
            lab = (f"fit: {line.setup_ms:.3g} ms + bytes / {rate:.4g} GB/s" if rate
                   else "fit (no positive rate)")
            ax_t.plot(grid, pred, color="tab:orange", lw=2, label=lab, zorder=5)
            if line.boot is not None and len(line.boot):
                band = line.boot[:, :1] + line.boot[:, 1:] * grid[None, :] / GB
                lo, hi = np.percentile(band, [2.5, 97.5], axis=0)
                ax_t.fill_between(grid, lo, hi, color="tab:orange", alpha=0.25,
                                  label="bootstrap 95% band", zorder=1)
            if rate:
                with np.errstate(divide="ignore", invalid="ignore"):
                    curve = grid / GB / (pred / 1000.0)
                ax_r.plot(grid, np.where(pred > 0, curve, np.nan), color="tab:orange", lw=2,
                          label="model: bytes / (setup + bytes / rate)", zorder=5)
                ax_r.axhline(rate, color="tab:orange", ls="--", lw=1.2,
                             label=f"effective rate {rate:.4g} GB/s")
        if gf.regimes is not None:
            fl, fh, brk, lo_s, hi_s = gf.regimes
            for f, sub, color, name in ((fl, lo_s, "tab:green", "small"),
                                        (fh, hi_s, "tab:purple", "large")):
                g = np.geomspace(sub.sizes[0], sub.sizes[-1], 50)
                ax_t.plot(g, f.predict(g), ls="--", color=color, lw=1.5,
                          label=f"{name} regime: {f.setup_ms:.3g} ms, "
                                f"{(f.effective_gb_s or float('nan')):.4g} GB/s")
            for ax in (ax_t, ax_r):
                ax.axvline(brk, color="grey", ls=":", lw=1)
        doc_rate = None
        for w in rec["warnings"]:
            if w["code"] == "rate_above_line_rate":
                doc_rate = w
        if doc_rate is not None:
            ax_r.set_title("fitted rate exceeds the declared line rate", color="tab:red",
                           fontsize=9)
        for ax in (ax_t, ax_r):
            ax.set_xscale("log")
            ax.grid(True, which="major", alpha=0.3)
            _size_ticks(ax, s.sizes)
            ax.set_xlabel("payload (bytes, binary units)")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("handoff time (ms)")
        ax_r.set_ylabel("end-to-end rate (decimal GB/s)")
        ax_r.set_ylim(bottom=0)
        ax_t.legend(fontsize=7, loc="upper left")
        ax_r.legend(fontsize=7, loc="best", framealpha=0.85)
        label = textwrap.fill(rec["label"], 95)
        r2 = rec.get("r2")
        ax_t.set_title(f"{label}\n{rec['n_samples']} samples, {rec['n_sizes']} sizes"
                       + (f", R² {r2:.4f}" if r2 is not None else ""), fontsize=9, loc="left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
