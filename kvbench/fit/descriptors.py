"""The three-term fit: one link whose records differ only in how the KV was cut.

    handoff_ms = setup_ms + descriptors x us_per_desc / 1000 + bytes / (effective_gb_s x 1e6)

`kvbench fit` groups records of one link that differ only in their cut (block size, K/V
pages, block ids, TP pair: kvbench.fit.data.merge_cuts) and that carry `descriptors`, and
fits this plane through the medians of each point (bytes, descriptors) with the same
machinery as the line (kvbench.fit.stats.fit_design): weighted least squares, rounds (or
per-point blocks) resampled with every sample, per-point scatter from the generalized pivot,
lack of fit on K - 3 degrees of freedom.

Where the transport joins adjacent descriptors itself (NIXL: `descriptors_merged` below
`descriptors` in some cuts), the records hold two counts and the cost has two parts: each
entry of the transfer list (`us_per_desc`, what preparing and walking the list costs) and
each descriptor left after the join (`us_per_merged_desc`, what the backend posts); a fourth
column fits the second, when the points separate it.

A per-descriptor cost can only be told from a per-byte one when the descriptor count varies
on its own. Where it does not (one count everywhere, or a count that moves with the bytes:
descriptors proportional to bytes, R^2 of the count on bytes >= 0.99, a variance inflation
factor >= 100) the fit says "cannot separate" with the figures, writes no us_per_desc, and
fits setup and rate alone: for such a design the descriptor cost is inside them. With one
payload size the count still separates from the rest, but setup and rate do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.fit.data import Collected, Group
from kvbench.fit.stats import (
    GroupSamples,
    LineFit,
    bootstrap_medians,
    fit_design,
    iid_median_var,
    interval_refusal,
    settled,
    size_summary,
)
from kvbench.units import MIN_TIME_MS, round_sig

FORMULA = ("handoff_ms = setup_ms + descriptors * us_per_desc / 1000 "
           "+ bytes / (effective_gb_s * 1e9) * 1000")
FORMULA_MERGED = ("handoff_ms = setup_ms + descriptors * us_per_desc / 1000 + descriptors_merged "
                  "* us_per_merged_desc / 1000 + bytes / (effective_gb_s * 1e9) * 1000")
MAX_R2 = 0.99  # the count explained by bytes beyond this: no separate per-descriptor cost
DRAW_DIGITS = 6


@dataclass
class Plane:
    """The fitted coefficients (setup_ms, ms_per_gb, us_per_desc, us_per_merged_desc: those the
    design holds) with their joint draws, and what the design could tell apart."""

    columns: list[str]
    coef: np.ndarray
    draws: np.ndarray | None
    separable: dict

    def get(self, name: str) -> float | None:
        return float(self.coef[self.columns.index(name)]) if name in self.columns else None

    def draws_of(self, name: str) -> np.ndarray | None:
        if self.draws is None or name not in self.columns:
            return None
        return self.draws[:, self.columns.index(name)]

    def predict(self, nbytes, posted, merged=None) -> np.ndarray:
        t = np.full(np.shape(nbytes), self.get("setup_ms") or 0.0, dtype=float)
        if "ms_per_gb" in self.columns:
            t = t + self.get("ms_per_gb") * np.asarray(nbytes, dtype=float) / 1e9
        if "us_per_desc" in self.columns:
            t = t + self.get("us_per_desc") * np.asarray(posted, dtype=float) / 1000.0
        if "us_per_merged_desc" in self.columns:
            t = t + self.get("us_per_merged_desc") * np.asarray(merged, dtype=float) / 1000.0
        return t


def counts(s: GroupSamples) -> tuple[np.ndarray, np.ndarray | None]:
    """(posted, joined) per point: what the transport was given, and (where it joined adjacent
    entries) what it was left with."""
    d = np.asarray(s.descs)
    return (d, None) if d.ndim == 1 else (d[:, 0], d[:, 1])


def _r2(y: np.ndarray, X: np.ndarray, w: np.ndarray) -> float:
    """Weighted R^2 of y on the columns of X (1: y is one of their combinations)."""
    sw = np.sqrt(w / w.mean())
    coef, *_ = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)
    resid = (y - X @ coef) * sw
    dm = (y - np.average(y, weights=w)) * sw
    return 1.0 - float(resid @ resid) / float(dm @ dm) if float(dm @ dm) > 0 else 1.0


def _verdict(y: np.ndarray, X: np.ndarray, w: np.ndarray, what: str, against: str) -> dict:
    """Does count y vary on its own, beyond what the columns of X explain?"""
    n = len(np.unique(y))
    out = {"separable": True, "reason": None, "distinct_counts": n, "r2": None, "vif": None}
    if n < 2:
        out.update(separable=False, reason=f"every point {what} {int(y[0]):,} descriptors: the "
                   "count does not vary, so its cost is inside setup")
        return out
    r2 = _r2(y, X, w)
    out.update(r2=round(r2, 6), vif=None if r2 >= 1 else round(1 / (1 - r2), 3))
    if r2 >= MAX_R2:
        vif = "infinite" if r2 >= 1 else f"{1 / (1 - r2):.3g}"
        out.update(separable=False, reason=(
            f"the count {what} moves with {against} (R^2 {r2:.4f}, variance inflation factor "
            f"{vif}, at most {MAX_R2} separates): measure several cuts at one size (block sizes, "
            "block ids, K/V pages, TP pairs: docs/descriptors.md)"))
    return out


def separability(s: GroupSamples, w: np.ndarray) -> dict:
    """Can these points tell a per-descriptor cost apart: the posted count must vary, and not
    as a linear function of bytes (weighted R^2 of the count on [1, bytes] and its variance
    inflation factor 1 / (1 - R^2)); the joined count (where the transport joined some
    entries) likewise beyond bytes and the posted count."""
    posted, joined = counts(s)
    b = s.sizes.astype(float)
    n_bytes = len(np.unique(b))
    base = [np.ones_like(b)] + ([b / 1e9] if n_bytes > 1 else [])
    v = _verdict(posted.astype(float), np.stack(base, axis=1), w, "posted", "the bytes")
    out = {"separable": v["separable"], "reason": v["reason"], "points": int(len(b)),
           "distinct_descriptor_counts": v["distinct_counts"], "distinct_sizes": n_bytes,
           "r2_descriptors_on_bytes": v["r2"], "vif": v["vif"], "merged": None}
    if joined is not None:
        cols = base + ([posted / 1e3] if v["separable"] else [])
        out["merged"] = _verdict(joined.astype(float), np.stack(cols, axis=1), w,
                                 "left after joining", "the bytes and the posted count")
    return out


def _design(s: GroupSamples, sep: dict) -> tuple[np.ndarray, list[str]]:
    """The columns the points can estimate: [1, GB, kilo-descriptors posted, kilo-descriptors
    left after joining] (a coefficient per 1000 descriptors in ms is one in microseconds per
    descriptor)."""
    posted, joined = counts(s)
    cols, X = ["setup_ms"], [np.ones(len(s.sizes))]
    if sep["distinct_sizes"] > 1:
        cols.append("ms_per_gb")
        X.append(s.x)
    if sep["separable"]:
        cols.append("us_per_desc")
        X.append(posted / 1000.0)
    if sep["merged"] is not None and sep["merged"]["separable"]:
        cols.append("us_per_merged_desc")
        X.append(joined / 1000.0)
    return np.stack(X, axis=1), cols


def fit_plane(s: GroupSamples, n_boot: int, rng: np.random.Generator
              ) -> tuple[Plane, np.ndarray, np.ndarray, str | None, object]:
    """(plane, medians, weights, why there is no interval, lack of fit) for a group's points."""
    med, n, w = size_summary(s)
    sep = separability(s, w)
    X, cols = _design(s, sep)
    why_not = interval_refusal(s)
    mdraws = None if why_not else bootstrap_medians(s, med, n_boot, rng)
    source = "within-size samples, taken as independent" if why_not else "unit bootstrap"
    coef, draws, lof = fit_design(X, med, w, mdraws=mdraws, iid_var=iid_median_var(s, med, n),
                                  scatter_from=source, rng=rng)
    return Plane(cols, coef, draws, sep), med, w, why_not, lof


def as_line(plane: Plane, s: GroupSamples, med: np.ndarray, why_not: str | None, lof) -> LineFit | None:
    """The setup and rate part as a LineFit (its intervals and warnings are the line's)."""
    if "ms_per_gb" not in plane.columns:
        return None
    draws = None
    if plane.draws is not None:
        draws = np.stack([plane.draws_of("setup_ms"), plane.draws_of("ms_per_gb")], axis=1)
    return LineFit(plane.get("setup_ms"), plane.get("ms_per_gb"), s.x, med, draws, why_not, lof)


def _term_json(plane: Plane, name: str) -> dict:
    dr = plane.draws_of(name)
    ci = None if dr is None else [round_sig(float(v)) for v in np.percentile(dr, [2.5, 97.5])]
    return {name: round_sig(plane.get(name)), f"{name}_ci95": ci,
            f"{name}_draws": None if dr is None else [round_sig(float(v), DRAW_DIGITS) for v in dr]}


def descriptor_json(plane: Plane, field: str | None) -> dict:
    """The fit document's additions (all optional keys, so readers of the line ignore them)."""
    out = {"model_formula": FORMULA, "descriptor_field": field, **_term_json(plane, "us_per_desc"),
           "descriptor_term": plane.separable}
    if plane.separable.get("merged") is not None:
        out["model_formula"] = FORMULA_MERGED
        out.update(_term_json(plane, "us_per_merged_desc"))
    return out


def _term_warnings(plane: Plane, name: str, ci) -> list[dict]:
    us = plane.get(name)
    if us < 0:
        return [{"code": f"negative_{name}",
                 "message": f"{name} {us:.4g} is negative: more descriptors did not cost more "
                            "time here; plan uses 0"}]
    if ci is not None and ci[0] <= 0:
        return [{"code": f"{name}_not_distinguishable_from_zero",
                 "message": f"{name} 95% interval [{ci[0]:.4g}, {ci[1]:.4g}] includes 0: no "
                            "such cost is resolved by these cuts (more descriptors, e.g. "
                            "smaller blocks or scattered ids)"}]
    return []


def descriptor_warnings(plane: Plane, doc: dict) -> list[dict]:
    sep = plane.separable
    if not sep["separable"]:
        return [{"code": "descriptor_term_not_separable",
                 "message": f"cannot separate a per-descriptor cost: {sep['reason']}; fitted "
                            "setup and rate alone, with the descriptor cost inside them"}]
    out = _term_warnings(plane, "us_per_desc", doc["us_per_desc_ci95"])
    merged = sep.get("merged")
    if merged is not None and not merged["separable"]:
        out.append({"code": "merged_term_not_separable",
                    "message": "the transport joined adjacent descriptors in some cuts, but "
                               f"cannot separate their cost: {merged['reason']}; one term for both"})
    elif merged is not None:
        out += _term_warnings(plane, "us_per_merged_desc", doc["us_per_merged_desc_ci95"])
    if "ms_per_gb" not in plane.columns:
        out.append({"code": "fewer_than_two_sizes",
                    "message": "one payload size: the per-descriptor cost separates, setup and "
                               "rate do not; measure a second size (--sizes) to plan with it"})
    return out


def point_rows(rows: list[dict], s: GroupSamples, c: Collected, group: Group, plane: Plane,
               med: np.ndarray) -> None:
    """Each point's descriptors, the cuts it was measured under, and its residual."""
    posted, joined = counts(s)
    fitted = plane.predict(s.sizes, posted, joined)
    labels = [cut["label"] for cut in group.cuts]
    for k, row in enumerate(rows):
        members = np.unique(c.member[s.size_of == k])
        row["descriptors"] = int(posted[k])
        if joined is not None:
            row["descriptors_merged"] = int(joined[k])
        row["cuts"] = [labels[int(m)] for m in members]
        row["fitted_ms"] = round_sig(float(fitted[k]))
        res = float(settled(med[k] - fitted[k], med[k], fitted[k]))
        row["residual_ms"] = round_sig(res)
        row["residual_rel"] = round_sig(res / max(abs(med[k]), MIN_TIME_MS), 4)
