"""Many groups of one layout fitted at once: `kvbench matrix` at N = 1,024 fits a million
pairs, and one `fit_group` call (about 5 ms) per pair is hours.

The pairs of a matrix are measured alike: the same sizes, the same rounds, one sample per round
and size. After `collect` their groups differ only in the times. Every fit starts a generator
from the same seed, so the bootstrap's unit counts (kvbench.fit.stats.unit_counts), and the
chi-square and normal draws of the size-level scatter that follow them, are the same arrays for
every pair of a layout. So they are drawn once, and each step of `fit_group` is done as one
array operation over a stack of pairs:

- per-size medians, MADs, WLS weights and iid variances (np.median along the stack);
- the resampled medians: per pair and size the samples are ranked once, and one scan over the
  ranks with the shared counts (int8 where they fit) finds, for every draw at once, the two
  middle positions weighted_medians finds (the same order statistics, so the same values);
- the WLS operator, the line, the medians' covariance, the joint draws and their percentiles,
  with the same numpy and LAPACK calls on stacked arrays (one call per matrix inside numpy,
  so the same bits as the calls one pair at a time);
- with three sizes or more, the lack-of-fit's residual space: its matrices on the stack, its
  (K - 2) x (K - 2) generalized eigenproblem and the scatter's tau^2 (np.interp) per pair.

What must equal `fit_group` is checked by tests/fit/test_fit_batch.py: the records are the same
dicts, draws equal to the last bit. Whatever this path does not reproduce goes through
`fit_group` unchanged: groups with cuts (descriptors), an error, no samples, merged units, no
interval (too few rounds or blocks), more than MAX_SIZES sizes; and single pairs whose medians
are all below the timer (no_rate), whose resampled medians are not finite, or whose misfit
would make find_two_regimes look for two lines (six sizes or more).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg

from kvbench.errors import UsageError
from kvbench.fit import stats
from kvbench.fit.data import Collected, Group, collect
from kvbench.fit.fitting import (
    MAX_SIZES,
    _base_record,
    _exclusion_warnings,
    _resampling,
    _warn,
    fit_group,
    line_json,
    line_warnings,
    lof_warnings,
    poor_fit_warnings,
)
from kvbench.fit.regimes import MIN_SIZES, _material
from kvbench.fit.stats import (
    MIN_REL_SCALE,
    NOISE_ULPS,
    GroupSamples,
    LineFit,
    ResidualSpace,
    _small_sample_factor,
    design,
    interval_refusal,
    lack_of_fit,
    upper_median,
)
from kvbench.records.select import min_samples_for
from kvbench.units import GB, MIN_TIME_MS, round_sig

CHUNK_ELEMS = 1 << 17  # pairs x draws per step of the rank scan (int8: ~128 KiB, in cache)
CHUNK_SAMPLES = 1 << 22  # ... and at most this many times per step (32 MiB of float64)
TABLE_MAX_SAMPLES = 64  # a size's (i, j) table per pair: 32 KiB at 64 samples
SOURCE = "unit bootstrap"  # fit_group's scatter_from when the units support an interval


def fit_groups_batched(groups: list[Group], n_boot: int, seed: int, raw_draws: bool = False,
                       line_rate: float | None = None) -> list[dict | UsageError]:
    """For each group, what `fit_group(g, n_boot, seed, line_rate, raw_draws).record` gives,
    or the UsageError it raises; groups of one layout fitted together (module doc)."""
    out: list = [None] * len(groups)
    layouts: dict = {}
    for i, g in enumerate(groups):
        key = _layout_key(g)
        if key is None:
            out[i] = _one(g, n_boot, seed, raw_draws, line_rate)
        else:
            layouts.setdefault(key, []).append(i)
    for idx in layouts.values():
        lay = _Layout.of(groups[idx[0]], n_boot, seed)
        step = max(1, min(CHUNK_ELEMS // max(1, n_boot),
                          CHUNK_SAMPLES // len(groups[idx[0]]._ms)))
        for c0 in range(0, len(idx), step):
            part = idx[c0:c0 + step]
            recs = (lay.fit([groups[i] for i in part], raw_draws, line_rate) if lay is not None
                    else [None] * len(part))
            for i, rec in zip(part, recs, strict=True):
                out[i] = rec if rec is not None else _one(groups[i], n_boot, seed, raw_draws,
                                                          line_rate)
    return out


def _one(g: Group, n_boot: int, seed: int, raw_draws: bool, line_rate) -> dict | UsageError:
    try:
        return fit_group(g, n_boot, seed, line_rate, raw_draws).record
    except UsageError as exc:
        return exc


def _layout_key(g: Group) -> tuple[bytes, bytes] | None:
    """Groups whose samples' sizes and units (as read: run and round, or block) are the same
    arrays have the same samples after `collect` but for the times; None: fitted alone."""
    if g.cuts is not None or g.error or g.not_link or not len(g._ms):
        return None
    return bytes(g._bytes), bytes(g._unit)


def _collected(g: Group, s: GroupSamples) -> Collected:
    """What collect(g) gives for a group of the layout whose samples are `s`."""
    return Collected(s, g.n_wrong, g.n_empty, g.meta, g.sources, g.orders)


@dataclass
class _Scan:
    """One size's resampling, shared by the pairs of a layout: its samples, their units, and
    per kept draw the two middle positions (weighted_medians' lo and hi) of its multiset."""

    sel: np.ndarray  # indices of the size's samples, in sample order
    units: np.ndarray  # unit of each
    lo: np.ndarray | int  # (B,) or one value for every draw
    hi: np.ndarray | int
    dtype: type  # holds every cumulative count of a draw


@dataclass
class _Layout:
    """What the pairs of one layout share: the representative's samples, each size's scan,
    the kept draws' unit counts (transposed: a unit's counts in every draw are one row),
    the small-sample factor and the size-level scatter's draws."""

    s: GroupSamples
    scans: list[_Scan]
    counts_t: np.ndarray | None  # (U, kept draws)
    factor: np.ndarray | None
    chi: np.ndarray | None  # (kept,) chi-square draws, df = K - 2 (K > 2)
    z: np.ndarray | None  # (kept, K) standard normals
    resampling: dict | None

    @classmethod
    def of(cls, g: Group, n_boot: int, seed: int) -> _Layout | None:
        """The layout of g's samples, or None where fit_group must fit each group alone."""
        try:
            s = collect(g).samples
        except UsageError:
            return None
        if s is None or s.merged or len(s.sizes) > MAX_SIZES:
            return None
        if len(s.sizes) < 2:  # fit_group stops before any draw: the base record only
            return cls(s, [], None, None, None, None, None)
        if interval_refusal(s) is not None:
            return None
        rng = np.random.default_rng(seed)
        counts = stats.unit_counts(s, n_boot, rng)  # (looked up when called: tests swap it)
        totals = [counts[:, s.unit[np.flatnonzero(s.size_of == k)]].sum(axis=1)
                  for k in range(len(s.sizes))]
        kept = np.all(np.stack(totals) > 0, axis=0)
        n_kept = int(kept.sum())
        if n_kept < 2:  # no covariance to take (fit_group's own warnings and errors)
            return None
        K = len(s.sizes)
        chi = z = None
        if K > 2:  # size_scatter_draws: from the generator where the counts left it
            chi = rng.chisquare(K - 2, size=n_kept)
            z = rng.standard_normal((n_kept, K))
        scans = [_scan(s, k, t[kept]) for k, t in enumerate(totals)]
        top = max(int(t.max()) for t in totals)
        ct = np.ascontiguousarray(counts[kept].T).astype(_int_for(top))
        return cls(s, scans, ct, _small_sample_factor(s), chi, z,
                   _resampling(s, None, n_kept))

    def fit(self, groups: list[Group], raw_draws: bool, line_rate) -> list[dict | None]:
        """Each group's record (None: this one must go through fit_group)."""
        ms = np.stack([np.frombuffer(g._ms, dtype=np.float64) for g in groups])
        recs = []
        for g, rows in zip(groups, size_rows_batched(self.s, ms, _metas(groups)), strict=True):
            c = _collected(g, self.s)
            recs.append(_base_record(g, c, _exclusion_warnings(c), rows))
        if len(self.s.sizes) < 2:
            return [_one_size(r, self.s) for r in recs]
        return _fit_lines(self, ms, recs, raw_draws, line_rate)


def _one_size(rec: dict, s: GroupSamples) -> dict:
    rec["warnings"].append(_warn(
        "fewer_than_two_sizes", f"only one payload size ({int(s.sizes[0]):,} B): setup and "
        "rate cannot be separated; measure at least two sizes (e.g. --bytes with a list) and "
        "fit again"))
    return rec


def _int_for(top: int) -> type:
    for t in (np.int8, np.int16, np.int32):
        if top <= np.iinfo(t).max:
            return t
    return np.int64


def _scan(s: GroupSamples, k: int, total: np.ndarray) -> _Scan:
    sel = np.flatnonzero(s.size_of == k)
    lo, hi = (total - 1) // 2, total // 2  # weighted_medians' floor((t - 1) / 2), floor(t / 2)
    dt = _int_for(max(int(total.max()), len(sel)))
    if np.all(lo == lo[0]) and np.all(hi == hi[0]):
        return _Scan(sel, s.unit[sel], int(lo[0]), int(hi[0]), dt)
    return _Scan(sel, s.unit[sel], lo.astype(dt), hi.astype(dt), dt)


def _metas(groups: list[Group]) -> list[dict]:
    return [g.meta for g in groups]


def size_rows_batched(s: GroupSamples, ms: np.ndarray, metas: list[dict]) -> list[list[dict]]:
    """fitting.size_rows for each row of ms (the times of groups of s's layout): the same
    percentiles (np.percentile along the stack) and means (each row summed as one array)."""
    P = len(ms)
    rows: list[list[dict]] = [[] for _ in range(P)]
    for k, nbytes in enumerate(s.sizes):
        # C order: each row summed as one contiguous array is summed as fit_group's (pairwise);
        # ms[:, idx] alone is Fortran-ordered, and its row sums differ in the last bit
        v = np.ascontiguousarray(ms[:, np.flatnonzero(s.size_of == k)])
        n, b = v.shape[1], int(nbytes)
        p50 = np.percentile(v, 50, axis=1).tolist()
        tails = [np.percentile(v, q if q >= 1 else 100 * q, axis=1).tolist()
                 if n >= min_samples_for(q) else [None] * P for q in (0.95, 0.99)]
        mean = v.mean(axis=1).tolist()
        for p in range(P):
            m = metas[p][b]
            rows[p].append({
                "bytes": b, "prompt_tokens": sorted(m["prompt_tokens"]) or None,
                "models": sorted(m["models"]) or None, "n": n, "p50_ms": round_sig(p50[p]),
                "p95_ms": round_sig(tails[0][p]), "p99_ms": round_sig(tails[1][p]),
                "mean_ms": round_sig(mean[p]),
                "end_to_end_gb_s": round_sig(b / GB / (p50[p] / 1000.0))
                if p50[p] >= MIN_TIME_MS else None})
    return rows


def _pow2(a: np.ndarray) -> np.ndarray:
    """x ** 2 as Python computes it for a float (the C library's pow, which differs from x * x
    in about one value of a thousand): fit_group squares Python floats."""
    return np.array([v ** 2 for v in a.tolist()], dtype=np.float64).reshape(a.shape)


def _summary(lay: _Layout, ms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """size_summary's medians and weights and iid_median_var's variances, (P, K) each."""
    med, w, iid = (np.empty((len(ms), len(lay.scans))) for _ in range(3))
    for k, sc in enumerate(lay.scans):
        v = np.ascontiguousarray(ms[:, sc.sel])
        m = np.median(v, axis=1)
        mad = 1.4826 * np.median(np.abs(v - m[:, None]), axis=1)
        scale = np.maximum(np.maximum(mad, MIN_REL_SCALE * np.abs(m)), 1e-9)
        med[:, k] = m
        w[:, k] = len(sc.sel) / _pow2(scale)
        iid[:, k] = _pow2(1.2533 * np.maximum(mad, 1e-12)) / len(sc.sel)
    return med, w, iid


def _boot(lay: _Layout, ms: np.ndarray, med: np.ndarray) -> np.ndarray:
    """bootstrap_medians for each row of ms: (P, kept draws, K).

    A draw's value is med + ((v[i] + v[j]) / 2 - med) x factor for its two middle positions
    i, j among the pair's sorted times v: up to TABLE_MAX_SAMPLES samples of a size, those
    elementwise steps are taken once per (i, j) (a table of n x n per pair) and each draw
    gathers its entry; beyond, each draw's two values are gathered and the steps taken."""
    P = len(ms)
    out = np.empty((P, lay.counts_t.shape[1], len(lay.scans)))
    for k, sc in enumerate(lay.scans):
        v = np.ascontiguousarray(ms[:, sc.sel])
        n = v.shape[1]
        order = np.argsort(v, axis=1, kind="stable")
        vals = np.take_along_axis(v, order, axis=1)
        i_lo, i_hi = _positions(lay.counts_t, sc.units[order], sc)
        if n <= TABLE_MAX_SAMPLES:
            m = med[:, k, None, None]
            table = m + ((vals[:, :, None] + vals[:, None, :]) / 2 - m) * lay.factor[k]
            i_lo *= n
            i_lo += i_hi  # the entry (lo, hi) of the pair's n x n table
            out[:, :, k] = np.take_along_axis(table.reshape(P, n * n), i_lo, axis=1)
            continue
        m = med[:, k, None]
        both = (np.take_along_axis(vals, i_lo, axis=1) + np.take_along_axis(vals, i_hi, axis=1))
        out[:, :, k] = m + (both / 2 - m) * lay.factor[k]
    return out


def _positions(counts_t: np.ndarray, ranked: np.ndarray, sc: _Scan
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per pair and draw, the sorted positions of the resampled multiset's lo-th and hi-th
    elements: how many ranks' cumulative counts are <= lo (hi), at most n - 1, as
    weighted_medians counts them. One pass over the ranks, every draw at once."""
    P, n = ranked.shape
    run = np.zeros((P, counts_t.shape[1]), dtype=sc.dtype)
    buf, le = np.empty_like(run), np.empty(run.shape, dtype=bool)
    c_lo = np.zeros_like(run)
    same = np.array_equal(sc.lo, sc.hi)
    c_hi = c_lo if same else np.zeros_like(run)
    for r in range(n):
        np.take(counts_t, ranked[:, r], axis=0, out=buf)
        run += buf
        np.less_equal(run, sc.lo, out=le)
        c_lo += le
        if not same:
            np.less_equal(run, sc.hi, out=le)
            c_hi += le
    top = n - 1
    return np.minimum(c_lo, top).astype(np.intp), np.minimum(c_hi, top).astype(np.intp)


@dataclass
class _DrawnLine(LineFit):
    """A LineFit whose intervals were taken for a stack of lines at once (np.percentile along
    the stack): the same values setup_ci and rate_ci compute from its draws."""

    cis: tuple = ()
    unresolved: bool = False  # slope_unresolved, from the stack's one partition

    @property
    def slope_unresolved(self) -> bool:  # type: ignore[override]
        return self.unresolved

    def setup_ci(self):
        return self.cis[0]

    def rate_ci(self):
        return self.cis[1]


def _lines(X: np.ndarray, med: np.ndarray, w: np.ndarray, mdraws: np.ndarray):
    """fit_design's H, coefficients, the medians' covariance (np.cov's steps) and the draws
    from the medians' draws, for a stack of pairs; the same calls on stacked arrays."""
    H = np.linalg.solve(X.T @ (w[:, :, None] * X[None]),
                        (X[None] * w[:, :, None]).transpose(0, 2, 1))
    coef = (H @ med[:, :, None])[:, :, 0]
    d = np.array(mdraws.transpose(0, 2, 1))  # np.cov's copy of mdraws.T, in its layout
    d -= d.mean(axis=2)[:, :, None]
    S = np.matmul(d, d.transpose(0, 2, 1))
    S *= np.true_divide(1, mdraws.shape[1] - 1)
    draws = coef[:, None, :] + (mdraws - med[:, None, :]) @ H.transpose(0, 2, 1)
    return H, coef, S, draws


def _scatter(lay: _Layout, X: np.ndarray, med, w, S, H, draws) -> list:
    """With K > 2 sizes: each pair's residual space and lack of fit, and its size-level
    scatter added to its draws (size_scatter_draws with the layout's shared draws)."""
    if lay.z is None:
        return [None] * len(med)
    lofs, shifts = [], np.empty(draws.shape[:2] + (med.shape[1],))
    for p, space in enumerate(_spaces(X, med, w, S, H)):
        lofs.append(lack_of_fit(space, SOURCE))
        tau2 = space.tau2_for(lay.chi)
        shifts[p] = lay.z * np.sqrt(tau2)[:, None] * med[p]
    draws += shifts @ H.transpose(0, 2, 1)
    return lofs


def _fit_lines(lay: _Layout, ms: np.ndarray, recs: list[dict], raw_draws: bool,
               line_rate) -> list[dict | None]:
    s = lay.s
    med, w, _iid = _summary(lay, ms)
    mdraws = _boot(lay, ms, med)
    ok = (np.isfinite(ms).all(axis=1) & (np.abs(med).max(axis=1) >= MIN_TIME_MS)
          & np.isfinite(mdraws).all(axis=(1, 2)))
    X = design(s.x)
    H, coef, S, draws = _lines(X, med, w, mdraws)
    lofs = _scatter(lay, X, med, w, S, H, draws)
    # (2, P, 2); each column's draws contiguous: the same order statistics, a faster partition
    cols = np.ascontiguousarray(draws.transpose(0, 2, 1))
    pc = np.percentile(cols, [2.5, 97.5], axis=2)
    unresolved = (coef[:, 1] > 0) & (upper_median(cols[:, 1]) <= 0)  # slope_unresolved, stacked
    se = np.sqrt(np.diagonal(S, axis1=1, axis2=2))
    resid = _residuals(s, coef, med)
    out: list[dict | None] = []
    for p, rec in enumerate(recs):
        lo_s, hi_s = pc[0, p, 1], pc[1, p, 1]
        line = _DrawnLine(float(coef[p, 0]), float(coef[p, 1]), s.x, med[p], draws[p], None,
                          lofs[p], cis=((float(pc[0, p, 0]), float(pc[1, p, 0])), (
                              1000.0 / hi_s if hi_s > 0 else None,
                              1000.0 / lo_s if lo_s > 0 else None)), unresolved=bool(unresolved[p]))
        if not ok[p] or len(s.sizes) >= MIN_SIZES and _material(line, se[p]):
            out.append(None)  # no_rate, values past float, or two regimes to look for
            continue
        out.append(_record(rec, line, lay, se[p], [r[p] for r in resid], raw_draws,
                           line_rate))
    return out


def _record(out: dict, line: LineFit, lay: _Layout, se: np.ndarray, resid: list,
            raw_draws: bool, line_rate) -> dict:
    """The rest of fit_group's record, in its order, from the pair's line and residuals."""
    warnings = out["warnings"]
    out.update({k: v for k, v in line_json(line, lay.s.sizes, raw_draws).items() if k in out})
    out["resampling"] = dict(lay.resampling)
    for row, fitted, res, rel in zip(out["sizes"], *resid, strict=True):  # _add_residuals
        row["fitted_ms"] = round_sig(fitted)
        row["residual_ms"] = round_sig(res)
        row["residual_rel"] = round_sig(rel, 4)
    warnings += line_warnings(line, line_rate) + lof_warnings(line, out["sizes"])
    warnings += poor_fit_warnings(out["sizes"], se)
    return out


def _residuals(s: GroupSamples, coef: np.ndarray, med: np.ndarray) -> list[list]:
    """Per pair and size: LineFit.predict at the size, residual_ms and residual_rel, as
    _add_residuals takes them from each line (the same operations, on (P, K) arrays)."""
    setup, slope = coef[:, :1], coef[:, 1:]
    fitted = setup + slope * s.sizes.astype(float) / GB
    sx = slope * s.x
    res = med - (setup + sx)
    scale = np.maximum(np.maximum(np.abs(med), np.abs(setup)), np.abs(sx))
    res[np.abs(res) <= NOISE_ULPS * np.finfo(float).eps * scale] = 0.0  # stats.settled
    rel = res / np.maximum(np.abs(med), 1e-12)
    return [fitted.tolist(), res.tolist(), rel.tolist()]


STACKED_SPACE_MAX_K = 7  # np.mean of a diagonal of K < 8 terms: summed in order, stacked or not


def _spaces(X: np.ndarray, med: np.ndarray, w: np.ndarray, S: np.ndarray, H: np.ndarray):
    """Each pair's ResidualSpace(X, med, w, S): its matrices built on the stack (the same calls:
    complete QR, products, the ridge), then per pair the generalized eigenproblem as the class
    solves it (scipy.linalg.eigh, (K - 2) x (K - 2)); from 8 sizes the class itself."""
    K, p = X.shape
    if K > STACKED_SPACE_MAX_K:
        yield from (ResidualSpace(X, med[i], w[i], S[i]) for i in range(len(med)))
        return
    q_full, _ = np.linalg.qr(w[:, :, None] * X[None], mode="complete")
    zm = q_full[:, :, p:].transpose(0, 2, 1)
    zm = zm @ (np.eye(K) - X @ H)  # H: wls_operator(x, w) of each pair
    c = (zm @ med[:, :, None])[:, :, 0]
    ridge = (1e-9 * np.diagonal(S, axis1=1, axis2=2).mean(axis=1)
             + 1e-24 * (med**2).mean(axis=1))
    zt = zm.transpose(0, 2, 1)
    a_mat = zm @ S @ zt + ridge[:, None, None] * (zm @ zt)
    b_mat = (zm * (med**2)[:, None, :]) @ zt
    for i in range(len(med)):
        lam, vecs = scipy.linalg.eigh(b_mat[i], a_mat[i], overwrite_a=True, overwrite_b=True)
        space = ResidualSpace.__new__(ResidualSpace)
        space.lam = np.maximum(lam, 0.0)
        space.d2 = (vecs.T @ c[i]) ** 2
        space.df = K - p
        yield space
