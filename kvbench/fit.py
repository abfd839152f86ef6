"""Fit measured handoff samples into the transfer model.

    time_ms = setup_ms + bytes / (effective_gb_s x 1e9) x 1000

`python -m kvbench.fit RESULTS.jsonl [...]` groups p2p records by what makes a
link-and-method distinct, fits the line to every raw per-iteration sample of each
group (not to means), robustly, with bootstrap 95% intervals, and writes a versioned
JSON file that `kvbench plan` reads. See docs/fit-and-plan.md for the method and
every output field.

Method, in short: each sample is standardized by the robust spread of its own
payload size (large payloads jitter more in absolute terms); the line starts from
the per-size medians, is refined by Huber IRLS and finished with Tukey's bisquare
(a far outlier gets weight zero, so it cannot drag the line). Intervals come from
a bootstrap that resamples samples within each size (the sizes stay fixed).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbench import linkpath
from kvbench.cli import ArgumentParser, UsageError, run_main
from kvbench.results import SCHEMA_P2P, load_records, utc_stamp, write_new_file
from kvbench.units import GB, fmt_bytes

SCHEMA_FIT = "kvbench.fit/1"

# What makes a link-and-method distinct. The optional keys join the group key only
# when some record carries them.
GROUP_KEYS = ("transport", "pattern", "granularity", "layout", "dtype", "device",
              "world_size", "hosts")
OPTIONAL_GROUP_KEYS = ("variant", "nixl_op", "nixl_mode", "nixl_prep", "nixl_batch",
                       "nixl_progress_thread", "tp", "prefill_tp", "decode_tp", "block_size")

HUBER_C = 1.345
BISQUARE_C = 4.685
HUBER_ITERS = 30
BISQUARE_ITERS = 30
MIN_REL_SCALE = 0.01  # a size's spread is taken as at least 1% of its median
TWO_REGIME_MIN_REL = 0.05  # a one-line misfit must be at least 5% of a size's median ...
TWO_REGIME_MIN_SE = 3.0  # ... and at least 3 standard errors of that median ...
TWO_REGIME_GAIN = 4.0  # ... and two lines must cut the squared relative misfit 4-fold
POOR_FIT_REL = 0.10  # a size's median more than 10% (and 3 SE) off the line
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


def r_squared(y: np.ndarray, yhat: np.ndarray) -> float | None:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot <= 0:
        return None
    return 1.0 - float(np.sum((y - yhat) ** 2)) / ss_tot


def _rel_misfit(s: Samples, line: LineResult) -> np.ndarray:
    med = np.array([np.median(s.ms[sl]) for sl in s.slices])
    return (med - line.predict(s.sizes)) / np.maximum(np.abs(med), 1e-9)


# ---------------------------------------------------------------------------
# grouping and the per-group fit


def _key_value(rec: dict, key: str):
    v = rec.get(key)
    if isinstance(v, list):
        return tuple(json.dumps(x, sort_keys=True) if isinstance(x, (dict, list)) else x
                     for x in v)
    if isinstance(v, dict):  # not expected in a key field, but must not break grouping
        return json.dumps(v, sort_keys=True)
    return v


def group_key(rec: dict, keys: Sequence[str]) -> tuple:
    return tuple(_key_value(rec, k) for k in keys)


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v


def group_label(group: dict) -> str:
    parts = []
    for k, v in group.items():
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            v = ",".join(map(str, v))
        parts.append(f"{k}={v}")
    return " ".join(parts)


def _samples_of(rec: dict, where: str) -> tuple[int, list[float]]:
    nbytes = rec.get("bytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise UsageError(f"{where}: 'bytes' must be a positive integer, got {nbytes!r}")
    samples = rec.get("samples_ms")
    if not isinstance(samples, list):
        raise UsageError(f"{where}: 'samples_ms' must be a list of milliseconds")
    out = []
    for v in samples:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UsageError(f"{where}: 'samples_ms' holds {v!r}, not a non-negative time in ms")
        out.append(float(v))
    return nbytes, out


def _warn(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def _r(x: float | None, nd: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{nd}g}")


def _pair(p) -> list | None:
    return None if p is None else [_r(p[0]), _r(p[1])]


def _line_json(line: LineResult, s: Samples) -> dict:
    return {
        "setup_ms": _r(line.setup_ms),
        "setup_ms_ci95": _pair(line.setup_ci),
        "effective_gb_s": _r(line.effective_gb_s),
        "effective_gb_s_ci95": _pair(line.rate_ci()),
        "bytes_min": int(s.sizes[0]),
        "bytes_max": int(s.sizes[-1]),
        "n_sizes": len(s.sizes),
        "n_samples": len(s.ms),
    }


@dataclass
class GroupFit:
    """Everything fitted for one group; `record` is what goes into the JSON file."""

    record: dict
    samples: Samples
    line: LineResult | None = None
    regimes: tuple[LineResult, LineResult, int, Samples, Samples] | None = None


def _two_regimes(s: Samples, one: LineResult, n_boot: int, seed: int):
    """Segmented fit: one line below a break size, another above it, when that is warranted."""
    k = len(s.sizes)
    if k < 5:  # two lines through 2 + 2 sizes fit any four medians exactly: no evidence
        return None
    med = np.array([np.median(s.ms[sl]) for sl in s.slices])
    scale = s.size_scale()
    se = np.array([1.2533 * scale[sl.start] / math.sqrt(sl.stop - sl.start) for sl in s.slices])
    resid = med - one.predict(s.sizes)
    rel = resid / np.maximum(np.abs(med), 1e-9)
    material = (np.abs(rel) > TWO_REGIME_MIN_REL) & (np.abs(resid) > TWO_REGIME_MIN_SE * se)
    if not material.any():
        return None
    sse_one = float(np.sum(rel**2))
    best = None
    for j in range(2, k - 1):  # small = sizes[:j], large = sizes[j:], two sizes at least each
        lo, hi = s.subset(0, j), s.subset(j, k)
        fl, fh = fit_line(lo, n_boot=0), fit_line(hi, n_boot=0)
        sse = float(np.sum(_rel_misfit(lo, fl) ** 2) + np.sum(_rel_misfit(hi, fh) ** 2))
        if best is None or sse < best[0]:
            best = (sse, j)
    if best is None or best[0] * TWO_REGIME_GAIN > sse_one:
        return None
    j = best[1]
    lo, hi = s.subset(0, j), s.subset(j, k)
    fl, fh = fit_line(lo, n_boot, seed), fit_line(hi, n_boot, seed + 1)
    # The break: where the two lines cross, if that lies between the neighbouring sizes;
    # otherwise the geometric middle of the gap.
    a, b = int(s.sizes[j - 1]), int(s.sizes[j])
    brk = math.sqrt(a * b)
    dslope = fl.ms_per_gb - fh.ms_per_gb
    if dslope != 0:
        cross = (fh.setup_ms - fl.setup_ms) / dslope * GB
        if a <= cross <= b:
            brk = cross
    return fl, fh, int(round(brk)), lo, hi, sse_one / max(best[0], 1e-300)


def fit_group(group: dict, records: list[dict], n_boot: int, seed: int,
              line_rate: float | None) -> GroupFit:
    label = group_label(group)
    warnings: list[dict] = []
    bytes_list: list[int] = []
    ms_list: list[float] = []
    meta: dict[int, dict] = {}
    sources: list[str] = []
    n_wrong = n_empty = 0
    models: list[str] = []
    for i, rec in enumerate(records):
        src = rec.get("_source", "?")
        if src not in sources:
            sources.append(src)
        wrong = rec.get("wrong")
        if wrong:  # a run that received wrong elements measured nothing worth fitting
            n_wrong += 1
            continue
        nbytes, samples = _samples_of(rec, f"{src}: record {i + 1} of group [{label}]")
        if not samples:
            n_empty += 1
            continue
        bytes_list += [nbytes] * len(samples)
        ms_list += samples
        m = meta.setdefault(nbytes, {"prompt_tokens": set(), "models": set()})
        if rec.get("prompt_tokens") is not None:
            m["prompt_tokens"].add(rec["prompt_tokens"])
        model = rec.get("model")
        name = model.get("name") if isinstance(model, dict) else None
        if name:
            m["models"].add(str(name))
            if name not in models:
                models.append(str(name))
    if not ms_list:
        why = []
        if n_wrong:
            why.append(f"{n_wrong} with wrong received elements")
        if n_empty:
            why.append(f"{n_empty} without samples")
        raise UsageError(f"group [{label}] is empty: no usable samples in {len(records)} "
                         f"record(s) ({', '.join(why) or 'none'})")
    if n_wrong:
        warnings.append(_warn("excluded_wrong", f"excluded {n_wrong} record(s) whose received "
                              "bytes were wrong: those runs measured nothing"))
    if n_empty:
        warnings.append(_warn("excluded_empty", f"excluded {n_empty} record(s) without samples"))

    s = Samples(np.array(bytes_list, dtype=np.int64), np.array(ms_list, dtype=float))
    sizes_json = []
    for nbytes, sl in zip(s.sizes, s.slices, strict=True):
        v = s.ms[sl]
        m = meta[int(nbytes)]
        p50 = float(np.percentile(v, 50))
        sizes_json.append({
            "bytes": int(nbytes),
            "prompt_tokens": sorted(m["prompt_tokens"]) or None,
            "models": sorted(m["models"]) or None,
            "n": int(len(v)),
            "p50_ms": _r(p50),
            "p95_ms": _r(float(np.percentile(v, 95))),
            "p99_ms": _r(float(np.percentile(v, 99))),
            "mean_ms": _r(float(v.mean())),
            "end_to_end_gb_s": _r(int(nbytes) / GB / (p50 / 1000.0)) if p50 > 0 else None,
        })
    out = {
        "group": {k: _jsonable(v) for k, v in group.items()},
        "label": label,
        "setup_ms": None,
        "setup_ms_ci95": None,
        "effective_gb_s": None,
        "effective_gb_s_ci95": None,
        "r2": None,
        "r2_inliers": None,
        "n_samples": int(len(s.ms)),
        "n_sizes": int(len(s.sizes)),
        "n_records": len(records),
        "n_outliers": None,
        "bytes_min": int(s.sizes[0]),
        "bytes_max": int(s.sizes[-1]),
        "models": models or None,
        "sizes": sizes_json,
        "two_regimes": None,
        "warnings": warnings,
        "sources": sources,
    }
    gf = GroupFit(out, s)
    if len(s.sizes) < 2:
        warnings.append(_warn("fewer_than_two_sizes",
                              f"only one payload size ({int(s.sizes[0]):,} B): setup and rate "
                              "cannot be separated; measure at least two sizes (e.g. --bytes "
                              "with a list) and fit again"))
        return gf

    line = fit_line(s, n_boot, seed)
    gf.line = line
    out.update({k: v for k, v in _line_json(line, s).items()
                if k in ("setup_ms", "setup_ms_ci95", "effective_gb_s", "effective_gb_s_ci95")})
    yhat = line.predict(s.bytes)
    line_scale = s.size_scale()
    out["r2"] = _r(r_squared(s.ms, yhat))
    if line.weights is not None and np.any(line.weights <= 0):
        keep = line.weights > 0
        out["r2_inliers"] = _r(r_squared(s.ms[keep], yhat[keep]))
    else:
        out["r2_inliers"] = out["r2"]
    out["n_outliers"] = int(np.sum(line.weights <= 0)) if line.weights is not None else None
    for row, sl in zip(sizes_json, s.slices, strict=True):
        fitted = float(line.predict(row["bytes"]))
        med = float(np.median(s.ms[sl]))
        row["fitted_ms"] = _r(fitted)
        row["residual_ms"] = _r(med - fitted)
        row["residual_rel"] = _r((med - fitted) / med) if med > 0 else None

    if line.ms_per_gb <= 0:
        warnings.append(_warn("no_rate", "time does not grow with bytes: no effective rate "
                              "can be fitted (are the sizes far too small, or the timer wrong?)"))
    if line.setup_ms < 0:
        warnings.append(_warn("negative_intercept",
                              f"setup_ms {line.setup_ms:.4g} is negative: not a physical setup "
                              "cost (a token-bucket burst, a two-regime link or too few small "
                              "sizes); plan uses 0"))
    elif line.setup_ci is not None and line.setup_ci[0] <= 0:
        warnings.append(_warn("intercept_not_distinguishable_from_zero",
                              f"setup_ms 95% interval [{line.setup_ci[0]:.4g}, "
                              f"{line.setup_ci[1]:.4g}] includes 0: setup is not resolved by "
                              "these sizes (add smaller payloads)"))
    rate = line.effective_gb_s
    if line_rate is not None and rate is not None and rate > line_rate:
        warnings.append(_warn("rate_above_line_rate",
                              f"fitted {rate:.4g} GB/s exceeds the declared line rate "
                              f"{line_rate:g} GB/s: a measurement bug (timing launch instead of "
                              "completion, bytes counted twice, a different path), not a result"))
    rci = line.rate_ci()
    if rate is not None and rci is not None and (
            rci[0] is None or rci[1] is None or rci[1] - rci[0] > 0.5 * rate):
        hi = "unbounded" if rci[1] is None else f"{rci[1]:.4g}"
        warnings.append(_warn("wide_interval",
                              f"the rate's 95% interval [{_fmt(rci[0], '.4g')}, {hi}] GB/s is "
                              "wider than half the estimate: too few iterations, a noisy host, "
                              "or sizes too close together"))
    reg = _two_regimes(s, line, n_boot, seed)
    if reg is not None:
        fl, fh, brk, lo, hi, gain = reg
        gf.regimes = (fl, fh, brk, lo, hi)
        out["two_regimes"] = {
            "break_bytes": brk,
            "break_between_bytes": [int(lo.sizes[-1]), int(hi.sizes[0])],
            "misfit_reduction": _r(gain, 4),
            "small": _line_json(fl, lo),
            "large": _line_json(fh, hi),
        }
        sr, lr = fl.effective_gb_s, fh.effective_gb_s
        warnings.append(_warn("two_regimes",
                              f"residuals show two regimes with a break near {fmt_bytes(brk)}: "
                              f"below it setup {fl.setup_ms:.4g} ms at "
                              f"{'n/a' if sr is None else f'{sr:.4g}'} GB/s, above it setup "
                              f"{fh.setup_ms:.4g} ms at {'n/a' if lr is None else f'{lr:.4g}'} "
                              "GB/s; plan uses the regime its payload falls in"))
        for name, f in (("small", fl), ("large", fh)):
            r = f.effective_gb_s
            if line_rate is not None and r is not None and r > line_rate:
                warnings.append(_warn("rate_above_line_rate",
                                      f"{name}-message regime: fitted {r:.4g} GB/s exceeds the "
                                      f"declared line rate {line_rate:g} GB/s: a measurement bug"))
    if reg is None:
        bad = [row for row, sl in zip(sizes_json, s.slices, strict=True)
               if row["residual_rel"] is not None and abs(row["residual_rel"]) > POOR_FIT_REL
               and abs(row["residual_ms"]) > TWO_REGIME_MIN_SE * 1.2533 * float(
                   line_scale[sl.start]) / math.sqrt(sl.stop - sl.start)]
        if bad:
            worst = max(bad, key=lambda r: abs(r["residual_rel"]))
            warnings.append(_warn("poor_fit",
                                  f"{len(bad)} of {len(s.sizes)} sizes have a median off the line "
                                  f"by more than {100 * POOR_FIT_REL:g}% (worst {worst['bytes']:,} "
                                  f"B: {100 * worst['residual_rel']:+.1f}%): the line does not "
                                  "describe this link well; see the residuals"))
    return gf


# ---------------------------------------------------------------------------
# files and the CLI


def parse_where(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--where expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _as_text(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return "null" if v is None else str(v)


def matches(group: dict, where: dict[str, str]) -> bool:
    return all(_as_text(group.get(k)) == v for k, v in where.items())


def group_records(records: list[dict]) -> tuple[list[str], dict[tuple, list[dict]]]:
    keys = list(GROUP_KEYS) + [k for k in OPTIONAL_GROUP_KEYS if any(k in r for r in records)]
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault(group_key(rec, keys), []).append(rec)
    return keys, groups


def fit_records(records: list[dict], *, where: dict[str, str] | None = None,
                n_boot: int = 1000, seed: int = 0,
                line_rate: float | None = None, expect_link: str | None = None) -> list[GroupFit]:
    keys, groups = group_records(records)
    where = where or {}
    unknown = [k for k in where if k not in keys]
    if unknown:
        raise UsageError(f"--where: unknown key {unknown[0]!r}; group keys are {', '.join(keys)}")
    fits = []
    for gk, recs in groups.items():
        group = dict(zip(keys, gk, strict=True))
        if not matches(group, where):
            continue
        fits.append(fit_group(group, recs, n_boot, seed, line_rate))
        mismatch = linkpath.mismatch(recs, expect_link) if expect_link else None
        if mismatch:  # the path the transport reported is not the declared link
            fits[-1].record["warnings"].append(_warn("link_mismatch", mismatch))
    if not fits:
        labels = "; ".join(group_label(dict(zip(keys, gk, strict=True))) for gk in groups)
        raise UsageError(f"no group matches --where {' '.join(f'{k}={v}' for k, v in where.items())}"
                         f" (groups: {labels})")
    return fits


def default_out(first_input: Path) -> Path:
    stem = first_input.name
    for suffix in (".jsonl", ".json"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    base = first_input.with_name(f"{stem}.fit")
    path, n = base.with_name(base.name + ".json"), 0
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}.json")
    return path


def fit_document(fits: list[GroupFit], inputs: list[str], n_boot: int, seed: int,
                 line_rate: float | None) -> dict:
    return {
        "schema": SCHEMA_FIT,
        "created": utc_stamp(),
        "model_formula": "time_ms = setup_ms + bytes / (effective_gb_s * 1e9) * 1000",
        "method": {
            "estimator": "Huber IRLS (c=1.345) from the per-size medians, then Tukey bisquare "
                         "(c=4.685); residuals standardized by each size's MAD (at least 1% of "
                         "its median)",
            "bootstrap": {"resamples": n_boot, "seed": seed, "scheme": "samples resampled "
                          "within each size", "interval": "95% percentile"},
            "samples": "raw per-iteration samples_ms of records without wrong elements; "
                       "cold (first-transfer) times are not samples",
        },
        "line_rate_gb_s": line_rate,
        "inputs": inputs,
        "groups": [f.record for f in fits],
    }


def _fmt(v, spec: str = ".5g") -> str:
    return "n/a" if v is None else format(v, spec)


def _ci(p, spec: str = ".5g") -> str:
    if p is None:
        return ""
    lo, hi = p
    return f"95% CI [{_fmt(lo, spec)}, {'unbounded' if hi is None else format(hi, spec)}]"


def format_table(doc: dict) -> str:
    lines = [f"kvbench fit: {len(doc['groups'])} group(s); time_ms = setup_ms + bytes / "
             "(GB/s x 1e9) x 1000, robust fit to raw samples"]
    for i, g in enumerate(doc["groups"], 1):
        lines.append("")
        lines.append(f"[{i}] {g['label']}")
        lines.append(f"    {g['n_sizes']} size(s) {fmt_bytes(g['bytes_min'])} .. "
                     f"{fmt_bytes(g['bytes_max'])}, {g['n_samples']} samples, "
                     f"R^2 {_fmt(g['r2'], '.4f')} (without outliers {_fmt(g['r2_inliers'], '.4f')}), "
                     f"outliers {_fmt(g['n_outliers'], 'd')}")
        lines.append(f"    setup_ms         {_fmt(g['setup_ms'], '>10.4g')}  {_ci(g['setup_ms_ci95'], '.4g')}")
        lines.append(f"    effective GB/s   {_fmt(g['effective_gb_s'], '>10.5g')}  "
                     f"{_ci(g['effective_gb_s_ci95'])}")
        tr = g.get("two_regimes")
        if tr:
            for name in ("small", "large"):
                t = tr[name]
                lines.append(f"    {name:<5} regime ({fmt_bytes(t['bytes_min'])} .. "
                             f"{fmt_bytes(t['bytes_max'])}): setup {_fmt(t['setup_ms'], '.4g')} ms, "
                             f"{_fmt(t['effective_gb_s'], '.5g')} GB/s")
        lines.append(f"    {'bytes':>14} {'n':>5} {'p50 ms':>10} {'p99 ms':>10} "
                     f"{'fitted ms':>10} {'resid %':>8} {'p50 GB/s':>10}")
        for row in g["sizes"]:
            rel = row.get("residual_rel")
            lines.append(f"    {row['bytes']:>14,} {row['n']:>5} {_fmt(row['p50_ms'], '>10.4f')} "
                         f"{_fmt(row['p99_ms'], '>10.4f')} {_fmt(row.get('fitted_ms'), '>10.4f')} "
                         f"{'n/a' if rel is None else format(100 * rel, '>8.2f')} "
                         f"{_fmt(row['end_to_end_gb_s'], '>10.4g')}")
        for w in g["warnings"]:
            lines.append(f"    warning ({w['code']}): {w['message']}")
    return "\n".join(lines)


_EPILOG = """\
examples:
  python -m kvbench.fit results/kvbench-p2p-20260101T000000Z.jsonl
  python -m kvbench.fit results/*.jsonl --where transport=gloo --line-rate-gbps 12.5
  python -m kvbench.fit run.jsonl --out run.fit.json --plot run.fit.png

Rates are decimal GB/s (1e9 bytes per second); a 100 Gbit/s NIC is 12.5 GB/s.
"""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kvbench fit",
        description="Fit time_ms = setup_ms + bytes / (effective_gb_s x 1e9) x 1000 to the raw "
                    "samples of p2p results,\none fit per transport/pattern/layout/... group, "
                    "with bootstrap 95% intervals.",
        epilog=_EPILOG,
    )
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl", help="p2p result files")
    p.add_argument("--out", metavar="FILE", help="fitted JSON (default: <first input>.fit.json "
                   "beside it; never overwrites)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw time vs bytes with the fitted "
                   "line and band, and GB/s vs size (needs matplotlib: the 'plot' extra)")
    p.add_argument("--line-rate-gbps", metavar="GB/s", help="declared line rate in decimal GB/s; "
                   "a fitted rate above it is flagged as a measurement bug")
    p.add_argument("--expect-link", choices=linkpath.EXPECTABLE, metavar="KIND",
                   help="the link the bytes should take (nvlink, rdma, tcp, ...): warn "
                   "(link_mismatch) when the path a transport reported says otherwise")
    p.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="fit only groups whose KEY equals VALUE (repeatable; lists as a,b)")
    p.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="bootstrap resamples for the intervals (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    return p


def _check_new(path: Path, what: str) -> None:
    if path.exists():
        raise UsageError(f"refusing to overwrite existing file {path} ({what})")
    if not path.parent.is_dir():
        raise UsageError(f"{what}: directory {path.parent} does not exist")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    line_rate = None
    if args.line_rate_gbps is not None:
        try:
            line_rate = float(args.line_rate_gbps)
        except ValueError:
            raise UsageError(f"--line-rate-gbps must be a number, got {args.line_rate_gbps!r}") from None
        if not (line_rate > 0 and math.isfinite(line_rate)):
            raise UsageError(f"--line-rate-gbps must be positive, got {args.line_rate_gbps}")
    if args.bootstrap < 20:
        raise UsageError(f"--bootstrap must be at least 20 resamples, got {args.bootstrap}")
    where = parse_where(args.where)
    inputs = [str(p) for p in args.results]
    for p in inputs:
        if Path(p).is_dir():
            raise UsageError(f"{p} is a directory; pass the .jsonl result files")
    out = Path(args.out) if args.out else default_out(Path(inputs[0]))
    _check_new(out, "--out")
    plot = Path(args.plot) if args.plot else None
    if plot is not None:
        _check_new(plot, "--plot")
        from kvbench import report

        report.require_matplotlib()
    records = load_records(inputs, schemas={SCHEMA_P2P})
    if not records:
        raise UsageError(f"no records in {', '.join(inputs)}")
    fits = fit_records(records, where=where, n_boot=args.bootstrap, seed=args.seed,
                       line_rate=line_rate, expect_link=args.expect_link)
    doc = fit_document(fits, inputs, args.bootstrap, args.seed, line_rate)
    png = None
    if plot is not None:
        png = report.plot_fits(fits)  # rendered before anything is written
    write_new_file(out, json.dumps(doc, indent=2) + "\n")
    if png is not None:
        write_new_file(plot, png)
    print(format_table(doc))
    print(f"\nwrote {out}" + (f" and {plot}" if plot else ""))
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    return run_main("kvbench fit", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
