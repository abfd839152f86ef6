"""The per-sample bootstrap kvbench fit used before issue 12, kept only to show in CI that the
coverage test can fail: a robust line (Huber IRLS, then Tukey's bisquare) through every raw
sample, with intervals from resampling single samples within each size. Samples of one size
share the load of the moment they were taken in, so this bootstrap treats correlated samples as
independent and its "95%" intervals are far too narrow (tests/fit/test_fit_coverage.py).

Moved here unchanged from kvbench/fit/fitting.py (commit b579da5); not used by kvbench itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GB = 1e9
HUBER_C = 1.345
BISQUARE_C = 4.685
HUBER_ITERS = 30
BISQUARE_ITERS = 30
MIN_REL_SCALE = 0.01  # a size's spread is taken as at least 1% of its median
BOOT_CHUNK_ELEMS = 2_000_000


# ---------------------------------------------------------------------------
# the robust line


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares for y = a + b x along the last axis (closed form)."""
    sw = w.sum(-1)
    xm = (w * x).sum(-1) / sw
    ym = (w * y).sum(-1) / sw
    dx = x - xm[..., None]
    sxx = (w * dx * dx).sum(-1)
    sxy = (w * dx * (y - ym[..., None])).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        b = sxy / sxx
    a = ym - b * xm
    return a, b


def _robust_line(x: np.ndarray, y: np.ndarray, scale: np.ndarray,
                 a0: np.ndarray, b0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Huber IRLS then Tukey bisquare, batched over the leading axis.

    x, y, scale: (B, n); a0, b0: (B,) start. Returns (a, b, final weights (B, n)).
    Residuals are standardized by each sample's size scale and by one robust
    residual scale per batch row (MAD), fixed before the bisquare steps.
    """
    base = 1.0 / scale**2
    a, b = a0.copy(), b0.copy()
    sig = np.ones_like(a)
    w = base
    for _ in range(HUBER_ITERS):
        r = (y - a[:, None] - b[:, None] * x) / scale
        sig = np.maximum(1.4826 * np.median(np.abs(r), axis=1), 1e-9)
        u = np.abs(r) / sig[:, None]
        w = base * np.where(u <= HUBER_C, 1.0, HUBER_C / np.maximum(u, 1e-300))
        na, nb = _wls(x, y, w)
        ok = np.isfinite(na) & np.isfinite(nb)
        na, nb = np.where(ok, na, a), np.where(ok, nb, b)
        done = _converged(a, b, na, nb)
        a, b = na, nb
        if done:
            break
    for _ in range(BISQUARE_ITERS):
        r = (y - a[:, None] - b[:, None] * x) / scale
        u = r / (sig[:, None] * BISQUARE_C)
        w = base * np.where(np.abs(u) < 1.0, (1.0 - u * u) ** 2, 0.0)
        na, nb = _wls(x, y, w)
        ok = np.isfinite(na) & np.isfinite(nb) & ((w > 0).sum(1) >= 2)
        na, nb = np.where(ok, na, a), np.where(ok, nb, b)
        done = _converged(a, b, na, nb)
        a, b = na, nb
        if done:
            break
    return a, b, w


def _converged(a, b, na, nb, tol: float = 1e-9) -> bool:
    return bool(np.all(np.abs(na - a) <= tol * (np.abs(a) + np.abs(b) + 1e-12))
                and np.all(np.abs(nb - b) <= tol * (np.abs(b) + 1e-12)))


@dataclass
class Samples:
    """One group's raw samples, sorted by payload size."""

    bytes: np.ndarray  # (n,) int
    ms: np.ndarray  # (n,) float
    sizes: np.ndarray = field(init=False)  # distinct sizes, ascending
    slices: list[slice] = field(init=False)  # samples of each size

    def __post_init__(self):
        order = np.argsort(self.bytes, kind="stable")
        self.bytes, self.ms = self.bytes[order], self.ms[order]
        self.sizes, starts = np.unique(self.bytes, return_index=True)
        ends = list(starts[1:]) + [len(self.bytes)]
        self.slices = [slice(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]

    @property
    def x(self) -> np.ndarray:  # GB, so the slope is ms per GB and the rate 1000/slope
        return self.bytes / GB

    def size_scale(self) -> np.ndarray:
        """Per-sample robust spread of its own size (floored at 1% of the size's median)."""
        return _size_scales(self.ms[None], self.slices)[0][0]

    def subset(self, lo: int, hi: int) -> Samples:
        """The samples of sizes[lo:hi]."""
        s = slice(self.slices[lo].start, self.slices[hi - 1].stop)
        return Samples(self.bytes[s].copy(), self.ms[s].copy())


def _size_scales(y: np.ndarray, slices: list[slice]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For (B, n) samples: per-sample scale (B, n), per-size scale (B, K), medians (B, K).

    A size's scale is its MAD (normal-consistent), floored at 1% of its median.
    """
    per_sample = np.empty_like(y)
    k_scale, k_med = [], []
    for sl in slices:
        v = y[:, sl]
        med = np.median(v, axis=1)
        mad = 1.4826 * np.median(np.abs(v - med[:, None]), axis=1)
        sc = np.maximum(np.maximum(mad, MIN_REL_SCALE * np.abs(med)), 1e-6)
        per_sample[:, sl] = sc[:, None]
        k_scale.append(sc)
        k_med.append(med)
    return per_sample, np.stack(k_scale, axis=1), np.stack(k_med, axis=1)


def _median_start(x: np.ndarray, ymed: np.ndarray, wsize: np.ndarray):
    """Line through per-size medians (weighted by n/scale^2): a start no outlier can move."""
    return _wls(x, ymed, wsize)


@dataclass
class LineResult:
    setup_ms: float
    ms_per_gb: float
    setup_ci: tuple[float, float] | None = None
    slope_ci: tuple[float, float] | None = None
    weights: np.ndarray | None = None
    boot: np.ndarray | None = None  # (B, 2): setup_ms, ms_per_gb

    @property
    def effective_gb_s(self) -> float | None:
        return 1000.0 / self.ms_per_gb if self.ms_per_gb > 0 else None

    def rate_ci(self) -> tuple[float | None, float | None] | None:
        if self.slope_ci is None:
            return None
        lo_s, hi_s = self.slope_ci
        hi = 1000.0 / lo_s if lo_s > 0 else None  # a slope interval reaching 0: no upper bound
        lo = 1000.0 / hi_s if hi_s > 0 else None
        return lo, hi

    def predict(self, nbytes) -> np.ndarray:
        return self.setup_ms + self.ms_per_gb * np.asarray(nbytes, dtype=float) / GB


def fit_line(s: Samples, n_boot: int = 1000, seed: int = 0) -> LineResult:
    """Robust fit of ms = setup + slope x GB, with a size-stratified bootstrap."""
    if len(s.sizes) < 2:
        raise ValueError("a line needs at least two distinct sizes")
    x, y = s.x, s.ms
    xs = s.sizes / GB
    counts = np.array([sl.stop - sl.start for sl in s.slices], dtype=float)
    scale, kscale, ymed = _size_scales(y[None], s.slices)
    a0, b0 = _median_start(xs[None], ymed, counts / kscale**2)
    a, b, w = _robust_line(x[None], y[None], scale, a0, b0)
    res = LineResult(float(a[0]), float(b[0]), weights=w[0])
    if n_boot <= 0:
        return res
    rng = np.random.default_rng(seed)
    n = len(y)
    chunk = max(1, min(n_boot, BOOT_CHUNK_ELEMS // max(n, 1)))
    draws = []
    done = 0
    while done < n_boot:
        nb = min(chunk, n_boot - done)
        idx = np.concatenate(
            [sl.start + rng.integers(0, sl.stop - sl.start, size=(nb, sl.stop - sl.start))
             for sl in s.slices], axis=1)
        yb = y[idx]
        # Each resample estimates its own size scales: their variability is part of the fit's.
        sb, ksb, ymb = _size_scales(yb, s.slices)
        ba0, bb0 = _median_start(np.broadcast_to(xs, ymb.shape), ymb, counts / ksb**2)
        ba, bb, _ = _robust_line(np.broadcast_to(x, yb.shape), yb, sb, ba0, bb0)
        draws.append(np.stack([ba, bb], axis=1))
        done += nb
    boot = np.concatenate(draws)
    boot = boot[np.all(np.isfinite(boot), axis=1)]
    res.boot = boot
    if len(boot):
        lo, hi = np.percentile(boot, [2.5, 97.5], axis=0)
        res.setup_ci = (float(lo[0]), float(hi[0]))
        res.slope_ci = (float(lo[1]), float(hi[1]))
    return res

