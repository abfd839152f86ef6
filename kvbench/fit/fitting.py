"""Fit measured handoff samples into the transfer model.

    time_ms = setup_ms + bytes / (effective_gb_s x 1e9) x 1000

`python -m kvbench.fit RESULTS.jsonl [...]` groups p2p records by the frozen spec of what was
measured, skips groups that are not a link (naming them), fits a line through each group's
per-size medians, and writes a versioned JSON file that `kvbench plan` reads, with joint
bootstrap draws of (setup_ms, ms_per_gb) for prediction bands.

The statistics live in kvbench/fit/stats.py (the line, unit bootstrap, lack of fit) and
kvbench/fit/regimes.py (one or two regimes, by BIC); grouping, link rules and units of
resampling in kvbench/fit/data.py. docs/fit-and-plan.md has the method and every field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.errors import UsageError
from kvbench.fit.data import (
    Collected,
    Group,
    collect,
    group_not_link,
    group_records,
    link_mismatch,
    merge_cuts,
)
from kvbench.fit.descriptors import (
    as_line,
    descriptor_json,
    descriptor_warnings,
    fit_plane,
    point_rows,
)
from kvbench.fit.regimes import TwoRegimes, find_two_regimes
from kvbench.fit.stats import (
    GroupSamples,
    LineFit,
    bootstrap_medians,
    fit_line,
    iid_median_var,
    interval_refusal,
    size_summary,
)
from kvbench.records.schema.fit import SCHEMA_FIT, SCHEMA_FIT_V1, FitDocument  # noqa: F401 (SCHEMA_FIT_V1: re-exported)
from kvbench.records.schema.read import path_kind
from kvbench.records.schema.types import MAX_GBPS, MIN_GBPS
from kvbench.records.select import matches, min_samples_for, parse_where  # noqa: F401 (parse_where: re-exported)
from kvbench.records.stats import percentile_if_supported
from kvbench.records.write import (
    contract_dump,
    dumps_json,
    utc_stamp,
)
from kvbench.units import GB, MIN_TIME_MS, fmt_bytes, round_sig

POOR_FIT_REL = 0.10  # a size's median more than 10% (and 3 SE) off the line
POOR_FIT_SE = 3.0
LACK_OF_FIT_P = 0.01
LACK_OF_FIT_MIN_REL = 0.005  # ... and a scatter beyond sampling of at least 0.5% of a median
DRAW_DIGITS = 6


def _warn(code: str, message: str) -> dict:
    return {"code": code, "message": message}




def draw_rows(draws: np.ndarray) -> list[list[float | None]]:
    """Each draw's (setup_ms, ms_per_gb) as round_sig writes them (DRAW_DIGITS significant
    digits), formatted in one pass over one string: the same numbers, a few times faster than a
    call of round_sig per value (a fit of thousands of groups, a matrix of thousands of pairs)."""
    if not np.isfinite(draws).all():
        return [[round_sig(a, DRAW_DIGITS), round_sig(b, DRAW_DIGITS)] for a, b in draws.tolist()]
    flat = draws.ravel().tolist()
    values = list(map(float, ((f"%.{DRAW_DIGITS}g " * len(flat)) % tuple(flat)).split()))
    return [values[k:k + 2] for k in range(0, len(values), 2)]


def _pair(p) -> list | None:
    return None if p is None else [round_sig(p[0]), round_sig(p[1])]


def _fmt(v, spec: str = ".5g") -> str:
    return "n/a" if v is None else format(v, spec)


# ---------------------------------------------------------------------------
# per-size rows and line records


def _quantile_or_none(v: np.ndarray, q: float) -> float | None:
    """The q-quantile only where n supports it, rounded as the document's numbers are."""
    value = percentile_if_supported(v, q)
    return None if value is None else round_sig(value)


def size_rows(s: GroupSamples, meta: dict) -> list[dict]:
    rows = []
    for k, nbytes in enumerate(s.sizes):
        v = s.of_size(k)
        m = meta[int(nbytes)]
        p50 = float(np.percentile(v, 50))
        rows.append({
            "bytes": int(nbytes),
            "prompt_tokens": sorted(m["prompt_tokens"]) or None,
            "models": sorted(m["models"]) or None,
            "n": int(len(v)),
            "p50_ms": round_sig(p50),
            "p95_ms": _quantile_or_none(v, 0.95),
            "p99_ms": _quantile_or_none(v, 0.99),
            "mean_ms": round_sig(float(v.mean())),
            "end_to_end_gb_s": round_sig(int(nbytes) / GB / (p50 / 1000.0)) if p50 >= MIN_TIME_MS else None,
        })
    return rows


def _lof_json(lof) -> dict | None:
    if lof is None:
        return None
    return {"q": round_sig(lof.q, 5), "df": lof.df, "p_value": round_sig(lof.p_value, 4),
            "size_scatter_rel": round_sig(lof.size_scatter_rel, 4), "scatter_from": lof.scatter_from}


def line_json(line: LineFit, sizes: np.ndarray, raw_draws: bool = False) -> dict:
    """The line's fields as the fit document writes them; `raw_draws`: the draws' values
    left as the (B, 2) array, for a caller that stores them itself (kvbench matrix)."""
    draws = None
    if line.draws is not None:
        draws = {"columns": ["setup_ms", "ms_per_gb"],
                 "values": line.draws if raw_draws else draw_rows(line.draws)}
    return {
        "setup_ms": round_sig(line.setup_ms),
        "setup_ms_ci95": _pair(line.setup_ci()),
        "effective_gb_s": round_sig(line.effective_gb_s),
        "effective_gb_s_ci95": _pair(line.rate_ci()),
        "ms_per_gb": round_sig(line.ms_per_gb),
        "no_interval": line.no_interval,
        "lack_of_fit": _lof_json(line.lof),
        "bytes_min": int(sizes[0]),
        "bytes_max": int(sizes[-1]),
        "n_sizes": len(sizes),
        "draws": draws,
    }


def _add_residuals(rows: list[dict], line: LineFit) -> None:
    for row, res, rel in zip(rows, line.residual_ms(), line.residual_rel(), strict=True):
        row["fitted_ms"] = round_sig(float(line.predict(row["bytes"])))
        row["residual_ms"] = round_sig(float(res))
        row["residual_rel"] = round_sig(float(rel), 4)


# ---------------------------------------------------------------------------
# the per-group fit


@dataclass
class GroupFit:
    """Everything fitted for one group; `record` is what goes into the JSON file."""

    record: dict
    samples: GroupSamples
    line: LineFit | None = None
    regimes: TwoRegimes | None = None
    plane: object = None  # kvbench.fit.descriptors.Plane: a link's cuts fitted together


def _resampling(s: GroupSamples, why_not: str | None, n_draws: int) -> dict:
    kinds = [s.stratum_kind[int(st)] for st in s.stratum]
    out = {"n_rounds": kinds.count("rounds"), "n_blocks": kinds.count("blocks"),
           "unit": " and ".join(sorted({"round" if k == "rounds" else "(record, size) block"
                                        for k in kinds})),
           "n_draws": 0 if why_not else n_draws, "none_because": why_not}
    if s.merged:  # many runs: adjacent units resampled together (kvbench.fit.data.MAX_UNITS)
        out["units_merged"] = s.merged
    return out


MAX_SIZES = 3000  # distinct sizes per group: memory grows as 64 B x sizes^2 (docs/robustness.md)


def _empty_group_error(group: Group, c: Collected) -> UsageError:
    why = [f"{c.n_wrong} with wrong received elements"] if c.n_wrong else []
    why += [f"{c.n_empty} without samples"] if c.n_empty else []
    return UsageError(f"group [{group.label}] is empty: no usable samples in "
                      f"{group.n_records} record(s) ({', '.join(why) or 'none'})")


def _base_record(group: Group, c: Collected, warnings: list[dict],
                 rows: list[dict] | None = None) -> dict:
    """The record's fields before the line; `rows`: size_rows(s, c.meta) when the caller has
    them already (kvbench.fit.batch takes many groups' percentiles in one call)."""
    s = c.samples
    models = sorted({m for d in c.meta.values() for m in d["models"]})
    return {
        "group": dict(group.fields), "label": group.label, "spec": group.spec,
        "spec_id": group.spec_id, "fit_as_link": True,
        "setup_ms": None, "setup_ms_ci95": None, "effective_gb_s": None,
        "effective_gb_s_ci95": None, "ms_per_gb": None, "no_interval": None,
        "lack_of_fit": None, "draws": None, "resampling": None,
        "n_samples": int(len(s.ms)), "n_sizes": int(len(s.sizes)),
        "n_records": group.n_records, "orders": c.orders,
        "bytes_min": int(s.sizes[0]), "bytes_max": int(s.sizes[-1]),
        "models": models or None, "sizes": size_rows(s, c.meta) if rows is None else rows,
        "two_regimes": None,
        "warnings": warnings, "sources": c.sources,
        **_store_pool(group, warnings),
    }


def _store_pool(group: Group, warnings: list[dict]) -> dict:
    """A store group's mounted pool, for plan's capacity in requests: the one size every
    record names; runs with different pools give none (and say so), never a blend."""
    if not group.store_pools:
        return {}
    if len(group.store_pools) > 1:
        warnings.append(_warn("store_pool_varies", "the records name different store pools ("
                              + ", ".join(f"{p:,} B" for p in sorted(group.store_pools))
                              + "): no capacity in requests is planned from this group"))
        return {"store_pool_bytes": None}
    return {"store_pool_bytes": next(iter(group.store_pools))}


def _exclusion_warnings(c: Collected) -> list[dict]:
    out = []
    if c.n_wrong:
        out.append(_warn("excluded_wrong", f"excluded {c.n_wrong} record(s) whose received "
                         "bytes were wrong: those runs measured nothing"))
    if c.n_empty:
        out.append(_warn("excluded_empty", f"excluded {c.n_empty} record(s) without samples"))
    return out


def fit_group(group: Group, n_boot: int, seed: int, line_rate: float | None,
              raw_draws: bool = False) -> GroupFit:
    c = collect(group)
    if c.samples is None:
        raise _empty_group_error(group, c)
    s = c.samples
    if len(s.sizes) > MAX_SIZES:
        raise UsageError(f"group [{group.label}]: {len(s.sizes):,} distinct payload sizes; kvbench fit "
                         f"takes at most {MAX_SIZES:,} per group (its lack-of-fit test holds a few "
                         "sizes x sizes matrices: ~600 MiB at the limit); split the records or "
                         "measure fewer sizes")
    warnings = _exclusion_warnings(c)
    out = _base_record(group, c, warnings)
    gf = GroupFit(out, s)
    if len(s.sizes) < 2:
        warnings.append(_warn("fewer_than_two_sizes",
                              f"only one payload size ({int(s.sizes[0]):,} B): setup and rate "
                              "cannot be separated; measure at least two sizes (e.g. --bytes "
                              "with a list) and fit again"))
        return gf
    rng = np.random.default_rng(seed)
    med, n, w = size_summary(s)
    if float(np.max(np.abs(med))) < MIN_TIME_MS:
        warnings.append(_warn("no_rate", f"every size's median time is below {MIN_TIME_MS:g} ms "
                              "(zero or denormal samples): no rate can be fitted (is the timer "
                              "wrong?)"))
        return gf
    iid_var = iid_median_var(s, med, n)
    why_not = interval_refusal(s)
    mdraws = None if why_not else bootstrap_medians(s, med, n_boot, rng)
    source = "within-size samples, taken as independent" if why_not else "unit bootstrap"
    line = fit_line(s.x, med, w, mdraws=mdraws, iid_var=iid_var, no_interval=why_not,
                    scatter_from=source, rng=rng)
    gf.line = line
    out.update({k: v for k, v in line_json(line, s.sizes, raw_draws).items() if k in out})
    out["resampling"] = _resampling(s, why_not, 0 if mdraws is None else len(mdraws))
    _add_residuals(out["sizes"], line)
    se = np.sqrt(np.diag(np.cov(mdraws.T))) if mdraws is not None else np.sqrt(iid_var)
    warnings += line_warnings(line, line_rate) + lof_warnings(line, out["sizes"])
    gf.regimes = find_two_regimes(s.sizes, line, w, se, mdraws=mdraws, iid_var=iid_var,
                                  scatter_from=source, rng=rng)
    if gf.regimes is not None:
        out["two_regimes"] = regimes_json(gf.regimes, s.sizes)
        warnings += regime_warnings(gf.regimes, line_rate)
    else:
        warnings += poor_fit_warnings(out["sizes"], se)
    return gf


def fit_cut_group(group: Group, n_boot: int, seed: int, line_rate: float | None):
    """A link's cuts fitted together (kvbench.fit.descriptors); a GroupFit like the line's."""
    c = collect(group)
    if c.samples is None:
        raise _empty_group_error(group, c)
    s = c.samples
    warnings = _exclusion_warnings(c)
    out = _base_record(group, c, warnings)
    out.update(cuts=group.cuts)
    plane, med, _w, why_not, lof = fit_plane(s, n_boot, np.random.default_rng(seed))
    line = as_line(plane, s, med, why_not, lof)
    if line is not None:
        out.update({k: v for k, v in line_json(line, s.sizes).items() if k in out})
    else:  # one size: the intercept is setup plus that size's bytes, no setup on its own
        out["time_without_descriptors_ms"] = round_sig(plane.get("setup_ms"))
    out["no_interval"], out["lack_of_fit"] = why_not, _lof_json(lof)
    out["resampling"] = _resampling(s, why_not, 0 if plane.draws is None else len(plane.draws))
    extra = descriptor_json(plane, c.descriptor_field)
    out.update(extra)
    point_rows(out["sizes"], s, c, group, plane, med)
    if line is not None:
        warnings += line_warnings(line, line_rate)
    elif why_not:
        warnings.append({"code": "no_interval", "message": f"no interval: {why_not}"})
    if lof is None:
        warnings.append({"code": "lack_of_fit_untestable", "message": f"{len(med)} points for "
                         f"{len(plane.columns)} coefficients: a bad fit cannot be seen; measure "
                         "more sizes or cuts"})
    elif line is not None:
        warnings += lof_warnings(line, out["sizes"])
    warnings += descriptor_warnings(plane, extra)
    if "blocks" in s.stratum_kind and plane.draws is not None:
        warnings.append(_warn("cuts_in_blocks_order", "measured in blocks order: a drift within "
                              "a run moves every cut of one size alike, which resampling blocks "
                              "does not see (setup and rate intervals covered the truth in 80-89% "
                              "of simulated runs: docs/descriptors.md); measure in rounds"))
    return GroupFit(out, s, line, plane=plane)


def regimes_json(tr: TwoRegimes, sizes: np.ndarray) -> dict:
    j = tr.split
    return {
        "break_bytes": tr.break_bytes,
        "break_between_bytes": [int(sizes[j - 1]), int(sizes[j])],
        "break_ci95_bytes": None if tr.break_ci is None else list(tr.break_ci),
        "break_gap_share": round_sig(tr.split_share, 3),
        "bic_one_line": round_sig(tr.bic_one, 5),
        "bic_two_lines": round_sig(tr.bic_two, 5),
        "small": line_json(tr.small, sizes[:j]),
        "large": line_json(tr.large, sizes[j:]),
    }


# ---------------------------------------------------------------------------
# warnings


def _rate_above(rate: float | None, line_rate: float | None, what: str) -> list[dict]:
    if line_rate is None or rate is None or rate <= line_rate:
        return []
    return [_warn("rate_above_line_rate",
                  f"{what}fitted {rate:.4g} GB/s exceeds the declared line rate {line_rate:g} "
                  "GB/s: a measurement bug (timing launch instead of completion, bytes counted "
                  "twice, a different path), not a result")]


def line_warnings(line: LineFit, line_rate: float | None) -> list[dict]:
    out = []
    if line.no_interval:
        out.append(_warn("no_interval", f"no interval: {line.no_interval}"))
    if line.ms_per_gb <= 0:
        out.append(_warn("no_rate", "time does not grow with bytes: no effective rate can be "
                         "fitted (are the sizes far too small, or the timer wrong?)"))
    elif line.slope_unresolved:
        out.append(_warn("no_rate", "time grows with bytes in the fit but not in most bootstrap "
                         "resamples (their median slope is not positive): these sizes do not "
                         "resolve a rate (measure larger payloads, or more rounds)"))
    elif line.effective_gb_s is None:
        out.append(_warn("no_rate", f"the fitted rate {1000.0 / line.ms_per_gb:.3g} GB/s is outside "
                         f"{MIN_GBPS:g}..{MAX_GBPS:g} GB/s: no rate can be fitted (constant times, or "
                         "sizes far too small for the timer)"))
    sci = line.setup_ci()
    if line.setup_ms < 0:
        out.append(_warn("negative_intercept",
                         f"setup_ms {line.setup_ms:.4g} is negative: not a physical setup cost "
                         "(a token-bucket burst, a two-regime link or too few small sizes); "
                         "plan uses 0"))
    elif sci is not None and sci[0] <= 0:
        out.append(_warn("intercept_not_distinguishable_from_zero",
                         f"setup_ms 95% interval [{sci[0]:.4g}, {sci[1]:.4g}] includes 0: setup "
                         "is not resolved by these sizes (add smaller payloads)"))
    rate, rci = line.effective_gb_s, line.rate_ci()
    out += _rate_above(rate, line_rate, "")
    if rate is not None and rci is not None and (
            rci[0] is None or rci[1] is None or rci[1] - rci[0] > 0.5 * rate):
        hi = "unbounded" if rci[1] is None else f"{rci[1]:.4g}"
        out.append(_warn("wide_interval",
                         f"the rate's 95% interval [{_fmt(rci[0], '.4g')}, {hi}] GB/s is wider "
                         "than half the estimate: too few rounds or sizes, a noisy host, or "
                         "sizes too close together"))
    return out


def lof_warnings(line: LineFit, rows: list[dict]) -> list[dict]:
    lof = line.lof
    if lof is None:
        return [_warn("lack_of_fit_untestable", "two sizes: a line always passes through two "
                      "medians, so a bad fit cannot be seen; measure at least four sizes")]
    if lof.p_value >= LACK_OF_FIT_P or lof.size_scatter_rel < LACK_OF_FIT_MIN_REL:
        return []
    worst = max(rows, key=lambda r: abs(r["residual_rel"] or 0))
    return [_warn("lack_of_fit",
                  f"the per-size medians miss the line by more than their sampling allows "
                  f"(Q {lof.q:.3g} on {lof.df} df, p {lof.p_value:.2g}; sampling from "
                  f"{lof.scatter_from}): about {100 * lof.size_scatter_rel:.2g}% per size "
                  f"beyond it, worst {worst['bytes']:,} B at {100 * worst['residual_rel']:+.1f}%"
                  "; the interval includes this scatter")]


def poor_fit_warnings(rows: list[dict], se: np.ndarray) -> list[dict]:
    bad = [r for r, e in zip(rows, se, strict=True)
           if abs(r["residual_rel"]) > POOR_FIT_REL and abs(r["residual_ms"]) > POOR_FIT_SE * e]
    if not bad:
        return []
    worst = max(bad, key=lambda r: abs(r["residual_rel"]))
    return [_warn("poor_fit",
                  f"{len(bad)} of {len(rows)} sizes have a median off the line by more than "
                  f"{100 * POOR_FIT_REL:g}% (worst {worst['bytes']:,} B: "
                  f"{100 * worst['residual_rel']:+.1f}%): the line does not describe this link "
                  "well; see the residuals")]


def regime_warnings(tr: TwoRegimes, line_rate: float | None) -> list[dict]:
    fl, fh = tr.small, tr.large
    sr, lr = fl.effective_gb_s, fh.effective_gb_s
    ci = "" if tr.break_ci is None else (f" (95% interval {fmt_bytes(tr.break_ci[0])} .. "
                                         f"{fmt_bytes(tr.break_ci[1])})")
    out = [_warn("two_regimes",
                 f"BIC prefers two lines (BIC {tr.bic_two:.3g} vs {tr.bic_one:.3g}), break near "
                 f"{fmt_bytes(tr.break_bytes)}{ci}: below it setup {fl.setup_ms:.4g} ms at "
                 f"{_fmt(sr, '.4g')} GB/s, above it setup {fh.setup_ms:.4g} ms at "
                 f"{_fmt(lr, '.4g')} GB/s; plan uses the regime its payload falls in")]
    out += _rate_above(sr, line_rate, "small-message regime: ")
    out += _rate_above(lr, line_rate, "large-message regime: ")
    return out


# ---------------------------------------------------------------------------
# files and the CLI


def _check_where(groups: list[Group], where: dict[str, str]) -> list[Group]:
    keys = sorted({k for g in groups for k in g.fields})
    unknown = [k for k in where if k not in keys]
    if unknown:
        raise UsageError(f"--where: unknown key {unknown[0]!r}; group keys are {', '.join(keys)}")
    chosen = [g for g in groups if matches(g.fields, where)]
    if not chosen:
        labels = "; ".join(g.label for g in groups)
        raise UsageError(f"no group matches --where {' '.join(f'{k}={v}' for k, v in where.items())}"
                         f" (groups: {labels})")
    return chosen


def fit_records(records: list[dict], *, where: dict[str, str] | None = None,
                n_boot: int = 1000, seed: int = 0,
                line_rate: float | None = None,
                expect_link: str | None = None) -> tuple[list[GroupFit], list[dict]]:
    """Fit every link group of record dicts; return the fits and the groups skipped."""
    return fit_groups(group_records(records, keep_paths=bool(expect_link)), where=where,
                      n_boot=n_boot, seed=seed, line_rate=line_rate, expect_link=expect_link)


def fit_groups(groups: list[Group], *, where: dict[str, str] | None = None,
               n_boot: int = 1000, seed: int = 0, line_rate: float | None = None,
               expect_link: str | None = None) -> tuple[list[GroupFit], list[dict]]:
    """Fit every link group (kvbench.fit.data); return the fits and the groups skipped."""
    chosen = merge_cuts(_check_where(groups, where or {}))
    fits, skipped = [], []
    for g in chosen:
        why = group_not_link(g)
        if why:
            skipped.append({"label": g.label, "group": dict(g.fields), "spec_id": g.spec_id,
                            "reason": why, "n_records": g.n_records})
            continue
        fits.append(fit_group(g, n_boot, seed, line_rate) if g.cuts is None else
                    fit_cut_group(g, n_boot, seed, line_rate))
        mismatch = link_mismatch(g, expect_link) if expect_link else None
        if mismatch:  # the path the transport reported is not the declared link
            fits[-1].record["warnings"].append(_warn("link_mismatch", mismatch))
    if not fits:
        raise UsageError("nothing to fit: no group is a link (" + "; ".join(
            f"[{s['label']}]: {s['reason']}" for s in skipped) + ")")
    return fits, skipped


def skipped_note(skipped: list[dict]) -> str:
    return (f"skipped {len(skipped)} group(s) that are not a link: "
            + "; ".join(f"[{s['label']}] ({s['reason']})" for s in skipped))


def default_out(first_input: Path) -> Path:
    stem = first_input.name
    for suffix in (".jsonl", ".json"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    base = first_input.with_name(f"{stem}.fit")
    path, n = base.with_name(base.name + ".json"), 0
    while path_kind(path, "write", follow=False) != "missing":
        n += 1
        path = base.with_name(f"{base.name}-{n}.json")
    return path


METHOD = {
    "estimator": "weighted least squares through the per-size medians (weights n / scale^2, "
                 "scale = MAD, at least 1% of the median)",
    "interval": "95% percentile of joint draws: rounds (or per-size (record, size) blocks) "
                "resampled with all their samples, plus a per-size scatter drawn from the "
                "generalized pivot Q(tau^2) = chi^2_(K-2)",
    "lack_of_fit": "Q = e' (M S M')^+ e of the median residuals against the medians' sampling "
                   "covariance S; chi-square with K-2 df",
    "regimes": "two lines when BIC (K medians, 3 vs 6 parameters) prefers them and a single "
               "line misses some median by > 5% and 3 SE; break interval from the draws",
    "samples": "raw per-iteration samples_ms of records without wrong elements; cold "
               "(first-transfer) times are not samples",
}


def fit_document(fits: list[GroupFit], skipped: list[dict], inputs: list[str], n_boot: int,
                 seed: int, line_rate: float | None) -> dict:
    """The `kvbench.fit/2` document, built as its contract (FitDocument, the class plan,
    report and results.load read it back into) and dumped from it."""
    return contract_dump(FitDocument, {
        "schema": SCHEMA_FIT,
        "created": utc_stamp(),
        "model_formula": "time_ms = setup_ms + bytes / (effective_gb_s * 1e9) * 1000",
        "method": {**METHOD, "resamples": n_boot, "seed": seed},
        "line_rate_gb_s": line_rate,
        "inputs": inputs,
        "groups": [f.record for f in fits],
        "skipped": skipped,
    }, "the fit document being written")


def dumps(doc: dict) -> str:
    """Indented JSON, except that each draws array stays on one line (1000 pairs per line)."""
    compact: list[str] = []

    def mark(v):
        if isinstance(v, dict):
            return {k: (_marker(compact, x) if k == "draws" and x else mark(x))
                    for k, x in v.items()}
        return [mark(x) for x in v] if isinstance(v, list) else v

    text = dumps_json(mark(doc), indent=2)  # NaN or an infinity is refused, never written
    # one pass over the text (a replace per array was quadratic: 116 s for 2,000 groups)
    return _MARKER.sub(lambda m: compact[int(m.group(1))], text) if compact else text


_MARKER = re.compile(r'"@draws(\d+)@"')


def _marker(store: list[str], value) -> str:
    store.append(dumps_json(value, indent=None))
    return f"@draws{len(store) - 1}@"


def _ci(p, spec: str = ".5g") -> str:
    if p is None:
        return ""
    lo, hi = p
    return f"95% CI [{_fmt(lo, spec)}, {'unbounded' if hi is None else format(hi, spec)}]"


def _pct(row: dict, key: str, q: float) -> str:
    v = row[key]
    return f"n<{min_samples_for(q)}" if v is None else f"{v:.4f}"


def _group_lines(g: dict) -> list[str]:
    rs = g["resampling"] or {}
    units = (f"{rs.get('n_rounds', 0)} rounds" if rs.get("n_rounds") else
             f"{rs.get('n_blocks', 0)} blocks")
    what = "point(s) (bytes, descriptors)" if "descriptor_term" in g else "size(s)"
    lines = [f"    {g['n_sizes']} {what} {fmt_bytes(g['bytes_min'])} .. "
             f"{fmt_bytes(g['bytes_max'])}, {g['n_samples']} samples in {units}"
             + (f", spec {g['spec_id']}" if g.get("spec_id") else ""),
             f"    setup_ms         {_fmt(g['setup_ms'], '>10.4g')}  {_ci(g['setup_ms_ci95'], '.4g')}",
             f"    effective GB/s   {_fmt(g['effective_gb_s'], '>10.5g')}  "
             f"{_ci(g['effective_gb_s_ci95'])}"]
    if "descriptor_term" in g:
        lines += _descriptor_lines(g)
    if g.get("time_without_descriptors_ms") is not None:
        lines.append(f"    no descriptors   {g['time_without_descriptors_ms']:>10.4g}  ms at this "
                     "one size (setup and bytes together)")
    if rs.get("n_draws"):  # (no interval: the no_interval warning says why)
        lines.append(f"    interval: {rs['n_draws']} draws resampling {rs['unit']}s, plus "
                     "size-level scatter")
    lof = g.get("lack_of_fit")
    if lof:
        lines.append(f"    lack of fit: Q {lof['q']:.3g} on {lof['df']} df, p {lof['p_value']:.3g}; "
                     f"size-level scatter beyond sampling {100 * lof['size_scatter_rel']:.2g}% "
                     "of a median")
    tr = g.get("two_regimes")
    for name in ("small", "large") if tr else ():
        t = tr[name]
        lines.append(f"    {name:<5} regime ({fmt_bytes(t['bytes_min'])} .. "
                     f"{fmt_bytes(t['bytes_max'])}): setup {_fmt(t['setup_ms'], '.4g')} ms, "
                     f"{_fmt(t['effective_gb_s'], '.5g')} GB/s {_ci(t['effective_gb_s_ci95'])}")
    return lines


def _descriptor_lines(g: dict) -> list[str]:
    """The per-descriptor term: its estimate and interval, or why there is none."""
    term, us = g["descriptor_term"], g.get("us_per_desc")
    cuts = f"{len(g.get('cuts') or [])} cuts fitted together, counts: {g['descriptor_field']}"
    if not term["separable"]:
        return [f"    us/descriptor    cannot separate: {term['reason']}", f"    ({cuts})"]
    out = [f"    us/descriptor    {_fmt(us, '>10.4g')}  {_ci(g.get('us_per_desc_ci95'), '.4g')}"]
    merged = term.get("merged")
    if merged is not None and merged["separable"]:
        out.append(f"    us/merged desc   {_fmt(g.get('us_per_merged_desc'), '>10.4g')}  "
                   f"{_ci(g.get('us_per_merged_desc_ci95'), '.4g')}  (per descriptor left "
                   "after the transport joined adjacent ones)")
    elif merged is not None:
        out.append(f"    us/merged desc   cannot separate: {merged['reason']}")
    return out + [f"    ({cuts}; R^2 of the count on bytes "
                  f"{_fmt(term['r2_descriptors_on_bytes'], '.3g')})"]


def _size_lines(g: dict) -> list[str]:
    desc = "descriptor_term" in g
    merged = any("descriptors_merged" in row for row in g["sizes"])
    lines = [f"    {'bytes':>14} " + (f"{'descr':>8} " if desc else "")
             + (f"{'merged':>8} " if merged else "") + f"{'n':>5} {'p50 ms':>10} "
             f"{'p95 ms':>10} {'p99 ms':>10} {'fitted ms':>10} {'resid %':>8} {'p50 GB/s':>10}"
             + ("  cuts" if desc else "")]
    for row in g["sizes"]:
        rel = row.get("residual_rel")
        lines.append(f"    {row['bytes']:>14,} " + (f"{row['descriptors']:>8,} " if desc else "")
                     + (f"{row['descriptors_merged']:>8,} " if merged else "")
                     + f"{row['n']:>5} {_fmt(row['p50_ms'], '>10.4f')} "
                     f"{_pct(row, 'p95_ms', 0.95):>10} {_pct(row, 'p99_ms', 0.99):>10} "
                     f"{_fmt(row.get('fitted_ms'), '>10.4f')} "
                     f"{'n/a' if rel is None else format(100 * rel, '>8.2f')} "
                     f"{_fmt(row['end_to_end_gb_s'], '>10.4g')}"
                     + (f"  {'; '.join(row['cuts'])}" if desc else ""))
    return lines


def format_table(doc: dict) -> str:
    lines = [f"kvbench fit: {len(doc['groups'])} group(s); time_ms = setup_ms + bytes / "
             "(GB/s x 1e9) x 1000 through the per-size medians; percentiles need n >= "
             f"{min_samples_for(0.95)} (p95), {min_samples_for(0.99)} (p99)"]
    if any("descriptor_term" in g for g in doc["groups"]):
        lines.append("  a link's cuts fitted together: time_ms = setup_ms + descriptors x "
                     "us_per_desc / 1000 [+ descriptors_merged x us_per_merged_desc / 1000] + bytes / "
                     "(GB/s x 1e9) x 1000 through each point's median")
    for i, g in enumerate(doc["groups"], 1):
        lines += ["", f"[{i}] {g['label']}"] + _group_lines(g) + _size_lines(g)
        lines += [f"    warning ({w['code']}): {w['message']}" for w in g["warnings"]]
    return "\n".join(lines)


MAX_BOOTSTRAP = 100_000  # resamples: far past where a 95% interval stops moving
