"""One line or two? A penalised choice (BIC) between a single line and two lines with a break.

Links often have two regimes (an eager protocol for small messages, rendezvous for large
ones). Two lines and a break always fit at least as well as one, so the extra parameters must
pay for themselves: with K per-size medians and the misfit scale profiled out,

    BIC = K ln(RSS_w / K) + p ln K,     p = 3 for one line (setup, slope, scale),
                                        p = 6 for two (two setups, two slopes, break, scale)

and two regimes are reported only when BIC says so *and* some size's median is materially off
the single line (more than 5% and 3 standard errors). The search needs at least six sizes:
two lines through five leave one residual degree of freedom, which is no evidence. The break's
interval comes from the same bootstrap draws as the lines: each resample picks its own best
break, and the spread of those breaks is the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbench.fit.stats import LineFit, fit_line, wls_operator
from kvbench.units import GB

MIN_SIZES = 6
MIN_PER_SIDE = 2
MATERIAL_REL = 0.05  # a single line must miss some size's median by 5% ...
MATERIAL_SE = 3.0  # ... and by 3 standard errors of that median


@dataclass
class TwoRegimes:
    split: int  # small regime = sizes[:split], large = sizes[split:]
    small: LineFit
    large: LineFit
    break_bytes: int
    break_ci: tuple[int, int] | None
    split_share: float | None  # share of bootstrap draws whose best break is in the same gap
    bic_one: float
    bic_two: float


def _rss(x: np.ndarray, rows: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted RSS of the WLS line for each row of medians (B, K) -> (B,), and theta (B, 2)."""
    H = wls_operator(x, w)
    theta = rows @ H.T
    resid = rows - theta[:, :1] - theta[:, 1:] * x[None]
    return (w * resid**2).sum(1), theta


def _bic(rss: np.ndarray, k: int, p: int) -> np.ndarray:
    return k * np.log(np.maximum(rss, 1e-300) / k) + p * math.log(k)


def _split_fits(x, rows, w, j):
    rss_lo, lo = _rss(x[:j], rows[:, :j], w[:j])
    rss_hi, hi = _rss(x[j:], rows[:, j:], w[j:])
    return rss_lo + rss_hi, lo, hi


def _break_bytes(sizes: np.ndarray, j: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Where the two lines cross, if that lies in the gap sizes[j-1]..sizes[j]; else the gap's
    geometric middle."""
    a, b = float(sizes[j - 1]), float(sizes[j])
    dslope = lo[:, 1] - hi[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = (hi[:, 0] - lo[:, 0]) / dslope * GB
    ok = np.isfinite(cross) & (cross >= a) & (cross <= b)
    return np.where(ok, cross, math.sqrt(a * b))


def _best_split(x, rows, w, splits) -> tuple[np.ndarray, np.ndarray, list]:
    """Per row: the lowest two-line RSS, the split that gives it, and every split's fits."""
    fits = [_split_fits(x, rows, w, j) for j in splits]
    rss = np.stack([f[0] for f in fits], axis=1)
    best = rss.argmin(axis=1)
    return rss[np.arange(len(rows)), best], np.asarray(splits)[best], fits


def _break_interval(sizes, x, mdraws, w, splits, j):
    """The break of each bootstrap draw's own best split: 95% interval and the share in gap j."""
    _, chosen, fits = _best_split(x, mdraws, w, splits)
    brk = np.empty(len(mdraws))
    for jj, (_, lo, hi) in zip(splits, fits, strict=True):
        sel = chosen == jj
        brk[sel] = _break_bytes(sizes, jj, lo[sel], hi[sel])
    lo_b, hi_b = np.percentile(brk, [2.5, 97.5])
    return (int(round(lo_b)), int(round(hi_b))), float(np.mean(chosen == j))


def _material(one: LineFit, se: np.ndarray) -> bool:
    resid = one.medians - (one.setup_ms + one.ms_per_gb * one.x)
    rel = np.abs(resid) / np.maximum(np.abs(one.medians), 1e-12)
    return bool(np.any((rel > MATERIAL_REL) & (np.abs(resid) > MATERIAL_SE * se)))


def find_two_regimes(sizes: np.ndarray, one: LineFit, w: np.ndarray, se: np.ndarray, *,
                     mdraws: np.ndarray | None, iid_var: np.ndarray, scatter_from: str,
                     rng: np.random.Generator) -> TwoRegimes | None:
    """Two regimes when BIC prefers them and the single line's misfit is material; else None."""
    K = len(sizes)
    if K < MIN_SIZES or not _material(one, se):
        return None
    x, med = one.x, one.medians
    splits = list(range(MIN_PER_SIDE, K - MIN_PER_SIDE + 1))
    rss1, _ = _rss(x, med[None], w)
    rss2, best, fits = _best_split(x, med[None], w, splits)
    bic1, bic2 = float(_bic(rss1, K, 3)[0]), float(_bic(rss2, K, 6)[0])
    if bic2 >= bic1:
        return None
    j = int(best[0])
    _, lo, hi = fits[splits.index(j)]
    brk = int(round(float(_break_bytes(sizes, j, lo, hi)[0])))
    ci, share = (None, None)
    if mdraws is not None:
        ci, share = _break_interval(sizes, x, mdraws, w, splits, j)
    parts = []
    for sl in (slice(0, j), slice(j, K)):
        parts.append(fit_line(x[sl], med[sl], w[sl], iid_var=iid_var[sl], rng=rng,
                              mdraws=None if mdraws is None else mdraws[:, sl],
                              no_interval=one.no_interval, scatter_from=scatter_from))
    return TwoRegimes(j, parts[0], parts[1], brk, ci, share, bic1, bic2)
