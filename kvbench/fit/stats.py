"""The statistics behind `kvbench fit`: a line through per-size medians, intervals that resample
what shares a moment's load, and the tests that can say "bad fit".

    time_ms = setup_ms + ms_per_gb x bytes / 1e9          (effective GB/s = 1000 / ms_per_gb)

Why medians: a stall slows single samples by 2-6x; a size's median barely moves, so the line
through the medians needs no outlier rule. Why not resample samples: the samples of a size share
the load of the moment they were taken in (a round, or a back-to-back block), so they are not
independent draws; the unit of independence is the round (every size once, interleaved) or the
(record, size) block. The interval has two parts, both kept as joint draws of (setup, slope):

1. unit bootstrap: rounds (or, per size, blocks) are resampled with all their samples; each
   resample gives new per-size medians and, through the same weighted least squares, a new line;
2. size-level scatter: what the medians scatter around the line beyond what (1) explains
   (a per-size effect no number of rounds averages away) is a variance estimated from K - 2
   residual degrees of freedom. Each draw takes its own value of it from the generalized
   pivotal quantity Q(tau^2) = chi^2_{K-2} (Tian 2008, used for random-effects meta-regression
   with few studies) and adds a per-size shift of that size, so few sizes give heavy tails.

docs/fit-and-plan.md has the method, its coverage on simulated correlated load and the limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import scipy.linalg
from scipy.special import chdtrc  # chi-square survival function

from kvbench.records.schema.types import MAX_GBPS, MIN_GBPS
from kvbench.units import GB

MIN_ROUNDS = 10  # fewer rounds: the round bootstrap undercovers (docs: coverage by rounds)
MIN_BLOCKS = 3  # fewer (record, size) blocks of some size: no interval
MIN_REL_SCALE = 0.01  # a size's spread is taken as at least 1% of its median (weights only)
MAX_TAU2 = 4.0  # size-level relative variance searched up to (200% of a size's median)
DRAW_CHUNK_ELEMS = 2_000_000
MANY_UNITS = 1000  # from this many units in a stratum, resamples are drawn as m picks, counted
GRID_MIN_SAMPLES = 4096  # from this many samples of a size, resampled medians use grid_medians


# ---------------------------------------------------------------------------
# samples, units, and per-size medians


@dataclass
class GroupSamples:
    """One group's raw samples with the unit of resampling each belongs to.

    unit[i] indexes the unit (a round, or a (record, size) block) of sample i;
    stratum[u] is the stratum of unit u: units are resampled within their stratum
    (all rounds together; the blocks of one size together).

    With `desc` (the descriptors each sample's handoff posted: (n,), or (n, 2) with the
    transport's count after joining adjacent ones) a "size" is a point (bytes, descriptors):
    `sizes[k]` its bytes, `descs[k]` its count(s).
    """

    bytes: np.ndarray  # (n,) int
    ms: np.ndarray  # (n,) float
    unit: np.ndarray  # (n,) int
    stratum: np.ndarray  # (U,) int
    stratum_kind: list[str]  # per stratum: "rounds" or "blocks"
    merged: dict | None = None  # when adjacent units were merged (kvbench.fit.data.MAX_UNITS)
    desc: np.ndarray | None = None  # (n,) int: descriptors per sample (the three-term fit)

    def __post_init__(self):
        if self.desc is None:
            self.sizes, self.size_of = np.unique(self.bytes, return_inverse=True)
            self.descs = None
            return
        cols = np.column_stack([self.bytes, self.desc])
        pts, inv = np.unique(cols, axis=0, return_inverse=True)
        self.sizes, self.size_of = pts[:, 0], inv.reshape(-1)
        self.descs = pts[:, 1] if self.desc.ndim == 1 else pts[:, 1:]

    @property
    def x(self) -> np.ndarray:
        """Distinct sizes in GB (decimal), so the slope is ms per GB."""
        return self.sizes / GB

    def of_size(self, k: int) -> np.ndarray:
        return self.ms[self.size_of == k]


def size_summary(g: GroupSamples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per size: median (ms), sample count, and the WLS weight n / scale^2.

    The scale is the size's normal-consistent MAD, at least MIN_REL_SCALE of its median: the
    weights make the fit minimise relative misfit where sizes are equally noisy in relative terms.
    """
    med, n, w = [], [], []
    for k in range(len(g.sizes)):
        v = g.of_size(k)
        m = float(np.median(v))
        mad = 1.4826 * float(np.median(np.abs(v - m)))
        scale = max(mad, MIN_REL_SCALE * abs(m), 1e-9)
        med.append(m)
        n.append(len(v))
        w.append(len(v) / scale**2)
    return np.array(med), np.array(n), np.array(w)


def iid_median_var(g: GroupSamples, med: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Variance of each size's median if its samples were independent (1.2533 x MAD / sqrt n)^2."""
    out = []
    for k in range(len(g.sizes)):
        v = g.of_size(k)
        mad = 1.4826 * float(np.median(np.abs(v - med[k])))
        out.append((1.2533 * max(mad, 1e-12)) ** 2 / n[k])
    return np.array(out)


def interval_refusal(g: GroupSamples) -> str | None:
    """Why these samples cannot support an interval, in one line; None when they can."""
    for s, kind in enumerate(g.stratum_kind):
        m = int(np.sum(g.stratum == s))
        if kind == "rounds" and m < MIN_ROUNDS:
            return (f"only {m} round(s): an interval needs at least {MIN_ROUNDS} rounds "
                    "(raise --iters)")
        if kind == "blocks" and m < MIN_BLOCKS:
            size = _stratum_size(g, s)
            return (f"{m} back-to-back block(s) of {size:,} B: the samples of a block share one "
                    f"moment's load, so an interval needs at least {MIN_BLOCKS} blocks per size "
                    "(repeat the run) or interleaved rounds (--order rounds)")
    return None


def _stratum_size(g: GroupSamples, s: int) -> int:
    units = np.flatnonzero(g.stratum == s)
    return int(g.bytes[np.isin(g.unit, units)][0])


def weighted_medians(vals: np.ndarray, w: np.ndarray) -> np.ndarray:
    """np.median of the multiset where vals[j] (sorted) appears w[b, j] times, for each row b."""
    c = np.cumsum(w, axis=1)
    total = c[:, -1]
    lo = np.floor((total - 1) / 2)
    hi = np.floor(total / 2)
    i_lo = np.minimum((c <= lo[:, None]).sum(1), len(vals) - 1)
    i_hi = np.minimum((c <= hi[:, None]).sum(1), len(vals) - 1)
    out = (vals[i_lo] + vals[i_hi]) / 2
    out[total <= 0] = np.nan
    return out


def grid_medians(vals: np.ndarray, units: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """weighted_medians(vals, counts[:, units]), exactly, without the (B, n) weight matrix.

    vals (n,) sorted, units (n,) the unit of each value, counts (B, U). The middle positions of
    each draw's resampled multiset are found by narrowing down a range of sorted positions:
    the range is cut into GRID_SPLIT pieces, the resampled weight before each cut is one
    matrix product (draws, U) x (U, pieces), and each draw goes on into the piece that holds
    its target; a small range is summed sample by sample. Counts are integers: sums are exact.
    """
    present, local = np.unique(units, return_inverse=True)
    local = local.reshape(-1)
    # float32 holds every integer up to 2^24 exactly: each sum below is at most one draw's
    # resampled sample count (about n), so the products are exact and take half the memory
    exact = np.float32 if counts.max(initial=0) * len(vals) < 2**24 else np.float64
    c = counts[:, present].astype(exact)
    total = (c @ np.bincount(local, minlength=len(present)).astype(exact)).astype(float)
    out = np.full(len(c), np.nan)
    rows = np.flatnonzero(total > 0)
    both = _positions(c, local, np.concatenate([rows, rows]),  # the two middle positions
                      np.concatenate([(total[rows] - 1) // 2, total[rows] // 2]))
    out[rows] = (vals[both[:len(rows)]] + vals[both[len(rows):]]) / 2
    return out


GRID_SPLIT = 16  # pieces a range of sorted positions is cut into per step
GRID_FINE = 256  # a range this short is summed sample by sample


def _positions(c: np.ndarray, local: np.ndarray, rows: np.ndarray,
               target: np.ndarray) -> np.ndarray:
    """Per (row of c, target), the first sorted position whose cumulative weight exceeds target."""
    pos = np.empty(len(rows), dtype=np.int64)
    todo = [(0, len(local), np.arange(len(rows)), np.zeros(len(rows)))]
    while todo:
        start, end, idx, base = todo.pop()
        t, width = target[idx], end - start
        if width <= max(GRID_FINE, c.shape[1] // 2):  # summing is cheaper than another product
            step = max(1, DRAW_CHUNK_ELEMS // width)
            for i in range(0, len(idx), step):
                part = idx[i:i + step]
                cum = base[i:i + step, None] + np.cumsum(c[rows[part]][:, local[start:end]], axis=1)
                pos[part] = start + (cum <= t[i:i + step, None]).sum(axis=1)
            continue
        cuts = start + (np.arange(GRID_SPLIT + 1) * width) // GRID_SPLIT
        piece = np.repeat(np.arange(GRID_SPLIT), np.diff(cuts))
        per = np.bincount(local[start:end] * GRID_SPLIT + piece,
                          minlength=c.shape[1] * GRID_SPLIT).reshape(-1, GRID_SPLIT)
        drawn, inverse = np.unique(rows[idx], return_inverse=True)  # (a row may come twice)
        weights = c if len(drawn) == len(c) else c[drawn]
        before = base[:, None] + (weights @ np.cumsum(per, axis=1).astype(c.dtype))[
            inverse.reshape(-1)]
        which = (before <= t[:, None]).sum(axis=1)  # the piece holding the target
        for g in np.unique(which):
            sel = which == g
            todo.append((int(cuts[g]), int(cuts[g + 1]), idx[sel],
                         base[sel] if g == 0 else before[sel, g - 1]))
    return np.minimum(pos, len(local) - 1)


UNIT_COUNTS_KEPT = 8  # resampling layouts remembered (kvbench matrix: one for every pair)
UNIT_COUNTS_KEPT_BYTES = 16 << 20  # a larger draw is not kept (a big group's, drawn once)
_KEPT_COUNTS: dict = {}


def _rng_key(rng: np.random.Generator) -> str:
    return repr(rng.bit_generator.state)


def unit_counts(g: GroupSamples, n_draws: int, rng: np.random.Generator) -> np.ndarray:
    """(B, U) how often each unit appears in each resample (stratified); int32 (counts <= U).

    The draws depend only on the strata and the generator's state: a group with the same
    strata drawn from the same state (every pair of a matrix is fitted from one seed) gets
    the very same array, read-only, and the generator is left where drawing would have left
    it, so every later draw of the fit is the same as well (identical results, drawn once)."""
    key = (n_draws, str(g.stratum.dtype), g.stratum.tobytes(), tuple(g.stratum_kind),
           _rng_key(rng))
    kept = _KEPT_COUNTS.get(key)
    if kept is not None:
        rng.bit_generator.state = kept[1]
        return kept[0]
    counts = draw_unit_counts(g, n_draws, rng)
    if counts.nbytes > UNIT_COUNTS_KEPT_BYTES:
        return counts
    counts.flags.writeable = False
    if len(_KEPT_COUNTS) >= UNIT_COUNTS_KEPT:
        _KEPT_COUNTS.pop(next(iter(_KEPT_COUNTS)))
    _KEPT_COUNTS[key] = (counts, rng.bit_generator.state)
    return counts


def draw_unit_counts(g: GroupSamples, n_draws: int, rng: np.random.Generator) -> np.ndarray:
    counts = np.zeros((n_draws, len(g.stratum)), dtype=np.int32)
    for s in range(len(g.stratum_kind)):
        idx = np.flatnonzero(g.stratum == s)
        m = len(idx)
        if m < MANY_UNITS:
            counts[:, idx] = rng.multinomial(m, np.full(m, 1 / m), size=n_draws)
        else:  # the same distribution, m draws per resample counted: ~100x faster for m ~ 10^3
            picks = (rng.integers(0, m, size=(n_draws, m), dtype=np.int32)
                     + np.int32(m) * np.arange(n_draws, dtype=np.int32)[:, None])
            counts[:, idx] = np.bincount(picks.reshape(-1), minlength=n_draws * m).reshape(n_draws, m)
    return counts


def _small_sample_factor(g: GroupSamples) -> np.ndarray:
    """Per size sqrt(m/(m-1)) for the smallest stratum it is drawn from: the bootstrap of m
    units underestimates a variance by (m-1)/m."""
    out = np.ones(len(g.sizes))
    for k in range(len(g.sizes)):
        units = np.unique(g.unit[g.size_of == k])
        for s in np.unique(g.stratum[units]):
            m = int(np.sum(g.stratum == s))
            out[k] = max(out[k], math.sqrt(m / (m - 1)) if m > 1 else 1.0)
    return out


def bootstrap_medians(g: GroupSamples, med: np.ndarray, n_draws: int,
                      rng: np.random.Generator) -> np.ndarray:
    """(B, K) per-size medians of resampled units, deviations scaled by the small-sample factor.

    Draws in which some size got no sample (possible when units lack sizes) are dropped.
    """
    counts = unit_counts(g, n_draws, rng)
    out = np.empty((n_draws, len(g.sizes)))
    for k in range(len(g.sizes)):
        sel = np.flatnonzero(g.size_of == k)
        order = np.argsort(g.ms[sel], kind="stable")
        vals, units = g.ms[sel][order], g.unit[sel][order]
        if len(vals) >= GRID_MIN_SAMPLES:
            out[:, k] = grid_medians(vals, units, counts)
            continue
        step = max(1, DRAW_CHUNK_ELEMS // max(len(vals), 1))
        for b0 in range(0, n_draws, step):
            out[b0:b0 + step, k] = weighted_medians(vals, counts[b0:b0 + step, units])
    out = out[np.all(np.isfinite(out), axis=1)]
    return med + (out - med) * _small_sample_factor(g)


# ---------------------------------------------------------------------------
# the line, its lack of fit, and its joint draws


def design(x: np.ndarray) -> np.ndarray:
    """The design matrix: sizes (K,) give [1, x] (setup, slope); a (K, p) matrix is itself
    (the three-term fit: [1, GB, thousands of descriptors])."""
    x = np.asarray(x, dtype=float)
    return np.stack([np.ones_like(x), x], axis=1) if x.ndim == 1 else x


def wls_operator(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """H (p, K) with coefficients = H @ medians for weighted least squares ((setup, slope)
    for sizes (K,), or a design matrix's coefficients)."""
    X = design(x)
    return np.linalg.solve(X.T @ (w[:, None] * X), (X * w[:, None]).T)


@dataclass
class LackOfFit:
    """Do the per-size medians scatter around the line more than their own sampling allows?"""

    q: float  # generalized residual chi-square
    df: int  # K - 2
    p_value: float
    size_scatter_rel: float  # estimated per-size scatter beyond sampling, fraction of a median
    scatter_from: str  # what the medians' sampling covariance was estimated from


class ResidualSpace:
    """Q(tau^2) = e' (M (S + tau^2 D) M')^+ e for residuals e = M m of the WLS line, where S is
    the medians' sampling covariance and D = diag(m^2) a relative per-size effect.

    Why a generalized eigenproblem: in the residual space Q(tau^2) = c' (A + tau^2 B)^-1 c;
    with B v = lam A v (V' A V = I) that is sum_i d_i^2 / (1 + tau^2 lam_i), d = V' c. One
    O(K^3) decomposition, after which Q costs O(K) per tau^2: the grid of 241 values and the
    draws no longer each solve a K x K system (a (241, K, K) stack was 3.8 GB at K = 1000).
    Memory: a few K x K float64 matrices (8 K^2 bytes each).
    """

    def __init__(self, x, med, w, S):
        X = design(x)
        K, p = X.shape
        # the residuals e = M m satisfy X' W e = 0: the residual space is the orthogonal
        # complement of W X, an orthonormal basis of which ends a complete QR of W X
        q_full, _ = np.linalg.qr(w[:, None] * X, mode="complete")
        zm = q_full[:, p:].T  # (K - p, K)
        del q_full
        zm = zm @ (np.eye(K) - X @ wls_operator(x, w))  # Z' M
        c = zm @ med
        # a ridge keeps A invertible when the medians do not vary at all (identical samples)
        ridge = 1e-9 * float(np.mean(np.diag(S))) + 1e-24 * float(np.mean(med**2))
        a_mat = zm @ S @ zm.T + ridge * (zm @ zm.T)
        b_mat = (zm * med**2) @ zm.T
        del zm
        lam, vecs = scipy.linalg.eigh(b_mat, a_mat, overwrite_a=True, overwrite_b=True)
        self.lam = np.maximum(lam, 0.0)  # B is positive semi-definite: below 0 is rounding
        self.d2 = (vecs.T @ c) ** 2
        self.df = K - p

    def q(self, tau2: np.ndarray) -> np.ndarray:
        tau2 = np.asarray(tau2, dtype=float)
        return (self.d2[None, :] / (1.0 + tau2[:, None] * self.lam[None, :])).sum(axis=1)

    def tau2_for(self, target: np.ndarray) -> np.ndarray:
        """tau^2 >= 0 with Q(tau^2) = target (0 where Q(0) is already below target)."""
        grid = np.concatenate([[0.0], np.geomspace(1e-10, MAX_TAU2, 240)])
        qs = self.q(grid)  # decreasing in tau^2
        out = np.interp(-np.asarray(target, dtype=float), -qs, grid)
        return np.where(np.asarray(target) >= qs[0], 0.0, out)


def lack_of_fit(space: ResidualSpace, scatter_from: str) -> LackOfFit | None:
    if space.df < 1:
        return None
    q0 = float(space.q(np.array([0.0]))[0])
    tau2 = float(space.tau2_for(np.array([float(space.df)]))[0])
    return LackOfFit(q0, space.df, float(chdtrc(space.df, q0)), math.sqrt(tau2),
                     scatter_from)


NOISE_ULPS = 64
"""A residual within this many units in the last place of the largest term it was computed
from (the median, the setup, the slope times the size) is floating-point rounding, not data."""


def settled(residual, *terms) -> np.ndarray:
    """`residual` with every element that is zero within the rounding of its `terms` set to 0.0.

    Why: a line through two sizes passes through both medians exactly, and what the solve leaves
    (about 1e-15 of the median) depends on the CPU's BLAS kernels; written as data it made a refit
    of committed records differ from one x86-64 machine to the next (docs/fit-and-plan.md)."""
    res = np.array(residual, dtype=float)
    scale = np.max(np.abs(np.broadcast_arrays(*terms)), axis=0)
    res[np.abs(res) <= NOISE_ULPS * np.finfo(float).eps * scale] = 0.0
    return res


def upper_median(values: np.ndarray) -> np.ndarray:
    """Element n // 2 of each row's sorted values (the last axis): the slope draws' median
    that LineFit.slope_unresolved takes, one line's or a stack's (kvbench.fit.batch) alike."""
    half = values.shape[-1] // 2
    return np.partition(values, half, axis=-1)[..., half]


@dataclass
class LineFit:
    """setup_ms + ms_per_gb x GB through the per-size medians, with joint draws when supported."""

    setup_ms: float
    ms_per_gb: float
    x: np.ndarray  # sizes, GB
    medians: np.ndarray
    draws: np.ndarray | None  # (B, 2): setup_ms, ms_per_gb
    no_interval: str | None  # one line: why there are no draws
    lof: LackOfFit | None

    @property
    def effective_gb_s(self) -> float | None:
        """1000 / ms_per_gb, or None outside the rates every reader takes (MIN_GBPS..MAX_GBPS):
        a slope of rounding noise (constant times) is no rate, not 1.7e13 GB/s."""
        rate = 1000.0 / self.ms_per_gb if self.ms_per_gb > 0 else None
        if rate is None or not MIN_GBPS <= rate <= MAX_GBPS or self.slope_unresolved:
            return None
        return rate

    @cached_property  # (asked by the rate, its warnings and its writer: one partition a line)
    def slope_unresolved(self) -> bool:
        """The line's slope is positive but most of its bootstrap draws' are not: time grows
        with bytes in this sample only (seen in a real matrix job on a loaded machine, sizes of
        a few KB). A rate beside such draws is not one the data support, and readers refuse
        it (kvbench.records.schema.fit.check_draws_hold takes the same median)."""
        if self.ms_per_gb <= 0 or self.draws is None or not len(self.draws):
            return False
        return bool(upper_median(self.draws[:, 1]) <= 0)

    def predict(self, nbytes) -> np.ndarray:
        return self.setup_ms + self.ms_per_gb * np.asarray(nbytes, dtype=float) / GB

    def residual_ms(self) -> np.ndarray:
        """median - fitted per size, with rounding noise written as the zero it is."""
        terms = (self.medians, self.setup_ms, self.ms_per_gb * self.x)
        return settled(self.medians - (self.setup_ms + self.ms_per_gb * self.x), *terms)

    def residual_rel(self) -> np.ndarray:
        return self.residual_ms() / np.maximum(np.abs(self.medians), 1e-12)

    def setup_ci(self) -> tuple[float, float] | None:
        if self.draws is None:
            return None
        lo, hi = np.percentile(self.draws[:, 0], [2.5, 97.5])
        return float(lo), float(hi)

    def rate_ci(self) -> tuple[float | None, float | None] | None:
        """Rate interval from the slope's: a slope interval reaching 0 leaves the rate unbounded."""
        if self.draws is None:
            return None
        lo_s, hi_s = np.percentile(self.draws[:, 1], [2.5, 97.5])
        return (1000.0 / hi_s if hi_s > 0 else None), (1000.0 / lo_s if lo_s > 0 else None)

    def band(self, nbytes, clip_setup: bool = False) -> tuple[float, float] | None:
        """95% interval of setup + slope x bytes from the joint draws (a prediction of the line,
        not of one handoff's scatter)."""
        if self.draws is None:
            return None
        setup = np.maximum(self.draws[:, 0], 0.0) if clip_setup else self.draws[:, 0]
        t = setup + self.draws[:, 1] * float(nbytes) / GB
        lo, hi = np.percentile(t, [2.5, 97.5])
        return float(lo), float(hi)


def size_scatter_draws(space: ResidualSpace, H: np.ndarray, med: np.ndarray, n_draws: int,
                       rng: np.random.Generator) -> np.ndarray:
    """(B, p) coefficient shifts from per-size effects: each draw's tau^2 solves
    Q(tau^2) = chi^2_df."""
    if space.df < 1:
        return np.zeros((n_draws, H.shape[0]))
    tau2 = space.tau2_for(rng.chisquare(space.df, size=n_draws))
    shifts = rng.standard_normal((n_draws, len(med))) * np.sqrt(tau2)[:, None] * med
    return shifts @ H.T


def fit_design(x: np.ndarray, med: np.ndarray, w: np.ndarray, *, mdraws: np.ndarray | None,
               iid_var: np.ndarray, scatter_from: str, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray | None, LackOfFit | None]:
    """WLS coefficients through the medians for a design (sizes, or a (K, p) matrix), their
    joint draws (median draws plus size-level scatter; None without median draws) and the
    lack of fit.

    mdraws: (B, K) bootstrap medians, or None when the units cannot support an interval (then
    the lack-of-fit test uses iid_var, each size's samples taken as independent).
    """
    X = design(x)
    H = wls_operator(X, w)
    coef = H @ med
    S = np.cov(mdraws.T) if mdraws is not None else np.diag(iid_var)
    space = ResidualSpace(X, med, w, np.atleast_2d(S)) if len(X) > X.shape[1] else None
    lof = lack_of_fit(space, scatter_from) if space is not None else None
    draws = None
    if mdraws is not None:
        draws = coef + (mdraws - med) @ H.T
        if space is not None:
            draws = draws + size_scatter_draws(space, H, med, len(draws), rng)
    return coef, draws, lof


def fit_line(x: np.ndarray, med: np.ndarray, w: np.ndarray, *, mdraws: np.ndarray | None,
             iid_var: np.ndarray, no_interval: str | None, scatter_from: str,
             rng: np.random.Generator) -> LineFit:
    """The WLS line through the medians; joint draws from median draws plus size-level scatter."""
    coef, draws, lof = fit_design(x, med, w, mdraws=mdraws, iid_var=iid_var,
                                  scatter_from=scatter_from, rng=rng)
    return LineFit(float(coef[0]), float(coef[1]), x, med, draws, no_interval, lof)
