"""Plots of fitted handoff measurements (matplotlib, from the `plot` extra).

One row per group: time against bytes with every raw sample, each size's median, the fitted
line and its 95% band from the joint draws (and two regimes with the break's interval when
found); and the end-to-end GB/s of each sample against payload size, with the curve the fitted
model implies and its asymptote (the effective rate). A link's cuts fitted together (the
three-term fit) get time against descriptors at each payload size instead.
"""

from __future__ import annotations

import io
import textwrap

import numpy as np

from kvbench.errors import UsageError
from kvbench.units import GB, MIN_TIME_MS, fmt_bytes

MAX_GROUPS = 8
MAX_POINTS = 20_000  # raw samples drawn per group (a file of many runs holds millions)


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


def _samples_panels(ax_t, ax_r, s) -> None:
    """Every raw sample (time and bytes/time; a fixed random MAX_POINTS of a bigger group)
    and each size's median."""
    shown, what = np.arange(len(s.ms)), "samples"
    if len(shown) > MAX_POINTS:
        shown = np.sort(np.random.default_rng(0).choice(len(s.ms), MAX_POINTS, replace=False))
        what = f"samples ({MAX_POINTS:,} of {len(s.ms):,} shown)"
    b, ms = s.bytes[shown], s.ms[shown]
    ax_t.scatter(b, ms, s=12, alpha=0.45, color="tab:blue", label=what, zorder=2)
    gbs = np.divide(b / GB, ms / 1000.0, out=np.full(len(ms), np.nan), where=ms > 0)
    ax_r.scatter(b, gbs, s=12, alpha=0.45, color="tab:blue", label=f"{what}: bytes / time",
                 zorder=2)
    p50 = np.array([np.median(s.of_size(k)) for k in range(len(s.sizes))])
    ax_t.plot(s.sizes, p50, "o", mfc="none", mec="k", ms=7, label="median per size", zorder=4)
    ax_r.plot(s.sizes, s.sizes / GB / (p50 / 1000.0), "o", mfc="none", mec="k", ms=7,
              label="median per size", zorder=4)


def _line_panels(ax_t, ax_r, line, grid) -> None:
    pred = line.predict(grid)
    rate = line.effective_gb_s
    lab = (f"fit: {line.setup_ms:.3g} ms + bytes / {rate:.4g} GB/s" if rate
           else "fit (no positive rate)")
    ax_t.plot(grid, np.where(pred > 0, pred, np.nan), color="tab:orange", lw=2, label=lab,
              zorder=5)
    # A negative setup is no cost (plan uses 0): the model curves use max(setup, 0). Drawn as
    # fitted, bytes / time would pass through a pole where the line crosses 0 (a spike of
    # hundreds of GB/s on a rate panel whose samples are at 1 GB/s).
    setup = max(line.setup_ms, 0.0)
    if line.setup_ms < 0:
        pred = setup + line.ms_per_gb * grid / GB
        ax_t.plot(grid, np.where(pred > 0, pred, np.nan), color="tab:orange", ls=":", lw=1.5,
                  label="with setup 0 (negative setup: plan uses 0)", zorder=5)
    if line.draws is not None and len(line.draws):
        band = line.draws[:, :1] + line.draws[:, 1:] * grid[None, :] / GB
        lo, hi = np.percentile(band, [2.5, 97.5], axis=0)
        ax_t.fill_between(grid, lo, hi, color="tab:orange", alpha=0.25,
                          label="95% band (joint draws)", zorder=1)
    if rate:
        with np.errstate(divide="ignore", invalid="ignore"):
            curve = grid / GB / (pred / 1000.0)
        ax_r.plot(grid, np.where(pred > 0, curve, np.nan), color="tab:orange", lw=2,
                  label="model: bytes / (setup + bytes / rate)"
                  + (" with setup 0" if line.setup_ms < 0 else ""), zorder=5)
        ax_r.axhline(rate, color="tab:orange", ls="--", lw=1.2,
                     label=f"effective rate {rate:.4g} GB/s")


def _regime_panels(ax_t, ax_r, gf) -> None:
    tr = gf.regimes
    sizes = gf.samples.sizes
    for f, sub, color, name in ((tr.small, sizes[:tr.split], "tab:green", "small"),
                                (tr.large, sizes[tr.split:], "tab:purple", "large")):
        g = np.geomspace(sub[0], sub[-1], 50)
        ax_t.plot(g, f.predict(g), ls="--", color=color, lw=1.5,
                  label=f"{name} regime: {f.setup_ms:.3g} ms, "
                        f"{(f.effective_gb_s or float('nan')):.4g} GB/s")
    for ax in (ax_t, ax_r):
        ax.axvline(tr.break_bytes, color="grey", ls=":", lw=1)
        if tr.break_ci is not None:
            ax.axvspan(*tr.break_ci, color="grey", alpha=0.12, label="break 95% interval")


def _rate_top(gf) -> float:
    """Upper end of the rate axis: what was measured and fitted, never a curve's pole.

    The highest of: each size's median rate, the 99th percentile of the samples' rates and
    the fitted effective rate (and each regime's), plus 15% headroom.
    """
    s = gf.samples
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = s.bytes / GB / (s.ms / 1000.0)
    rates = rates[np.isfinite(rates) & (s.ms >= MIN_TIME_MS)]
    p50 = np.array([np.median(s.of_size(k)) for k in range(len(s.sizes))])
    tops = [float(np.percentile(rates, 99))] if len(rates) else []
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tops += [float(r) for r, t in zip(s.sizes / GB / (p50 / 1000.0), p50, strict=True)
                 if np.isfinite(r) and t >= MIN_TIME_MS]
    fits = [gf.line] + ([gf.regimes.small, gf.regimes.large] if gf.regimes else [])
    tops += [f.effective_gb_s for f in fits if f is not None and f.effective_gb_s]
    return 1.15 * max(tops) if tops else 1.0


def _dress(ax_t, ax_r, gf) -> None:
    rec, s = gf.record, gf.samples
    if any(w["code"] == "rate_above_line_rate" for w in rec["warnings"]):
        ax_r.set_title("fitted rate exceeds the declared line rate", color="tab:red", fontsize=9)
    for ax in (ax_t, ax_r):
        ax.set_xscale("log")
        ax.grid(True, which="major", alpha=0.3)
        _size_ticks(ax, s.sizes)
        ax.set_xlabel("payload (bytes, binary units)")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("handoff time (ms)")
    ax_r.set_ylabel("end-to-end rate (decimal GB/s)")
    ax_r.set_ylim(0, _rate_top(gf))
    timed = s.ms[s.ms >= MIN_TIME_MS]  # (zero or denormal times: no log-scale limit)
    ax_t.set_ylim(bottom=0.5 * float(timed.min()) if len(timed) else None)
    ax_t.legend(fontsize=7, loc="upper left")
    ax_r.legend(fontsize=7, loc="best", framealpha=0.85)
    lof = rec.get("lack_of_fit")
    fit_q = (f", lack of fit p {lof['p_value']:.2g}" if lof else "")
    ax_t.set_title(f"{textwrap.fill(rec['label'], 95)}\n{rec['n_samples']} samples, "
                   f"{rec['n_sizes']} sizes{fit_q}", fontsize=9, loc="left")


def _desc_panels(ax_t, ax_r, gf) -> None:
    """A link's cuts fitted together: time against descriptors at each payload size (every
    sample, each point's median, the fitted plane and its 95% band), and the part of each
    median beyond setup and bytes against the per-descriptor line."""
    from kvbench.fit.descriptors import counts

    s, plane, rec = gf.samples, gf.plane, gf.record
    posted, joined = counts(s)
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:red", "tab:olive"]
    p50 = np.array([np.median(s.of_size(k)) for k in range(len(s.sizes))])
    us, draws = plane.get("us_per_desc"), plane.draws
    for i, nbytes in enumerate(np.unique(s.sizes)[:len(colors)]):
        c, on = colors[i], s.sizes == nbytes
        pts = np.flatnonzero(on)
        idx = np.flatnonzero(np.isin(s.size_of, pts))[:MAX_POINTS]
        ax_t.scatter(posted[s.size_of[idx]], s.ms[idx], s=10, alpha=0.35, color=c)
        kinds = [pts] if joined is None else [pts[joined[pts] == posted[pts]],
                                              pts[joined[pts] != posted[pts]]]
        for kind, sub in zip(("", " (the transport joined them)"), kinds, strict=False):
            if not len(sub):
                continue
            sub = sub[np.argsort(posted[sub])]
            ax_t.plot(posted[sub], p50[sub], "o" if not kind else "s", mfc="none", mec=c, ms=7,
                      label=f"{fmt_bytes(int(nbytes))}: median per cut{kind}")
            fitted = plane.predict(np.full(len(sub), nbytes), posted[sub],
                                   None if joined is None else joined[sub])
            ax_t.plot(posted[sub], fitted, "-", color=c, lw=1.2, alpha=0.8)
        grid = np.linspace(posted[pts].min(), posted[pts].max(), 100)
        if draws is not None and us is not None and joined is None:
            cols = plane.columns
            t = draws[:, [cols.index("setup_ms")]] + draws[:, [cols.index("us_per_desc")]] * grid / 1e3
            if "ms_per_gb" in cols:
                t = t + draws[:, [cols.index("ms_per_gb")]] * nbytes / 1e9
            lo, hi = np.percentile(t, [2.5, 97.5], axis=0)
            ax_t.fill_between(grid, lo, hi, color=c, alpha=0.15)
        base = plane.predict(np.full(len(pts), nbytes), np.zeros(len(pts)),
                             None if joined is None else joined[pts])
        ax_r.plot(posted[pts], p50[pts] - base, "o", mfc="none", mec=c, ms=7,
                  label=f"{fmt_bytes(int(nbytes))}: median - (setup + bytes / rate"
                        + (" + joined descriptors)" if joined is not None else ")"))
    if us is not None:
        grid = np.linspace(0, posted.max(), 100)
        ci = rec.get("us_per_desc_ci95") or [None, None]
        ax_r.plot(grid, us * grid / 1e3, color="tab:orange", lw=2,
                  label=f"{us:.3g} us per descriptor, 95% CI [{ci[0]}, {ci[1]}]")
    for ax in (ax_t, ax_r):  # linear: the model is a straight line in descriptors
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("descriptors per handoff (posted)")
        ax.legend(fontsize=7, loc="upper left")
    ax_t.set_ylim(0, 1.5 * float(p50.max()))  # (stalled samples above it are not drawn)
    ax_t.set_ylabel("handoff time (ms)")
    ax_r.set_ylabel("time beyond setup and bytes (ms)")
    term = rec["descriptor_term"]
    head = ("cannot separate: " + term["reason"]) if not term["separable"] else \
        f"{len(rec.get('cuts') or [])} cuts, {rec['n_samples']} samples"
    ax_t.set_title(f"{textwrap.fill(rec['label'], 95)}\n{textwrap.fill(head, 95)}", fontsize=9,
                   loc="left")


def plot_fits(fits, title: str | None = None, fmt: str = "png") -> bytes:
    """The plot of up to MAX_GROUPS GroupFit objects (kvbench.fit) as bytes in matplotlib's
    `fmt` (png, svg or pdf: kvbench.results.plot_format picks it from the file's suffix)."""
    import matplotlib.pyplot as plt

    fig = figure(fits, title)
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    plt.close(fig)
    return buf.getvalue()


def figure(fits, title: str | None = None):
    """The matplotlib figure of plot_fits (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = list(fits)[:MAX_GROUPS]
    fig, axes = plt.subplots(len(fits), 2, figsize=(12, 4.4 * len(fits)), squeeze=False)
    for (ax_t, ax_r), gf in zip(axes, fits, strict=True):
        if gf.plane is not None:
            _desc_panels(ax_t, ax_r, gf)
            continue
        _samples_panels(ax_t, ax_r, gf.samples)
        if gf.line is not None:
            sizes = gf.samples.sizes
            _line_panels(ax_t, ax_r, gf.line, np.geomspace(sizes[0], sizes[-1], 200))
        if gf.regimes is not None:
            _regime_panels(ax_t, ax_r, gf)
        _dress(ax_t, ax_r, gf)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
