"""The agreement of `kvbench lab agree`: engine means vs kvbench's predictions, as JSON and Markdown.

Per rate and repeat k the engine's exact mean (from its histogram's _sum/_count over the
run) is divided by the prediction of p2p repeat k; the ratio's mean over repeats gets a
Student-t 95% interval (none from one repeat). Predictions:

    engine-shaped  NIXL telemetry means of `kvbench p2p --nixl-shape engine` (postDuration,
                   xferDuration), the engine as deployed (poll every 1 ms, idle engine)
    drawn poll     the same, completion polled at decode's measured step times at that rate
    paced          drawn poll plus a transfer every 1000/R ms (--nixl-gap-ms): the engine as it
                   runs at rate R, progress thread idle between requests; the targets are
                   judged on it when present (else on engine-shaped)
    plain          the sweep's plain p2p fit (link shape), setup + bytes/rate at the engine's
                   mean bytes; it predicts a transfer time, so only the xfer ratio
Targets (issue 19, judged on a quiet machine only): post within 10 %, xfer within 15 % at
the lowest rate. Feature costs: the main effect of each engine feature in the 2^k factorial
(per repeat: mean over the cells with it on minus mean over those with it off; 95% t interval
over repeats), two-feature interactions the same way (cells where the pair agree minus cells
where they differ, halved: the usual +-1 coding), and beside them the plain one-step
differences (engine minus a variant).
"""

from __future__ import annotations

import itertools
import math
import statistics

from kvbench.lab.agree_p2p import FEATURES, UNPINNED, VARIANTS, factorial_cells

# two-sided 95% Student t quantiles by degrees of freedom (1..10), then the normal's
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}
TARGETS = {"post": 0.10, "xfer": 0.15}


def interval(xs: list[float]) -> dict:
    """Mean of per-repeat ratios and its 95% t interval (None with fewer than 2)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": m, "ci95": None, "n": 1}
    half = _T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": m, "ci95": [m - half, m + half], "n": len(xs)}


def _cfg(doc: dict, k: int, name: str) -> dict | None:
    reps = doc["p2p"]["repeats"]
    return (reps[k % len(reps)]["configs"].get(name) if reps else None)


def _plain_ms(doc: dict, nbytes: float | None) -> tuple[float | None, str | None]:
    if not doc.get("plain_fit") or not nbytes:
        return None, None
    from kvbench.plan.floors import links_from_fit

    try:
        link = links_from_fit(doc["plain_fit"], {})[0]
    except Exception as exc:  # noqa: BLE001 - said in the document instead
        return None, f"plain fit unreadable: {exc}"
    cost = link.for_payload(round(nbytes))[0]
    return cost.handoff_floor(round(nbytes))[1], link.label


def rate_row(doc: dict, rate: str) -> dict:
    runs = [r for r in doc["engine"].get(rate, []) if r["metrics"].get("xfer", {}).get("count")]
    row: dict = {"rate_rps": float(rate), "engine_runs": len(runs)}
    e = {q: [r["metrics"][q]["mean"] for r in runs] for q in ("post", "xfer")}
    nbytes = [r["metrics"].get("bytes", {}).get("mean") for r in runs]
    row["engine_mean_ms"] = {q: statistics.fmean(v) if v else None for q, v in e.items()}
    row["engine_mean_bytes"] = statistics.fmean([b for b in nbytes if b]) if any(nbytes) else None
    row["engine_descs_mean"] = _mean([r["metrics"].get("descs", {}).get("mean") for r in runs])
    for label, name in (("engine_shaped", "engine"), ("drawn_poll", f"poll-drawn@{rate}"),
                        ("paced", f"paced@{rate}")):
        preds = {q: [(_cfg(doc, k, name) or {}).get(f"{q}_mean_ms") for k in range(len(runs))]
                 for q in ("post", "xfer")}
        row[label] = {
            "config": name,
            "predicted_mean_ms": {q: _mean(v) for q, v in preds.items()},
            "ratio": {q: interval([a / b if b else None for a, b in zip(e[q], preds[q], strict=True)])
                      for q in ("post", "xfer")}}
    plain, label = _plain_ms(doc, row["engine_mean_bytes"])
    row["plain"] = {"link": label, "predicted_mean_ms": plain,
                    "ratio": {"xfer": interval([x / plain for x in e["xfer"]] if plain else [])}}
    row["buckets"] = {q: _pooled(runs, q) for q in ("post", "xfer")}
    return row


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _pooled(runs: list[dict], q: str) -> list[list]:
    """Bucket fractions over all repeats (weighted by each run's count)."""
    total = sum(r["metrics"][q]["count"] for r in runs)
    acc: dict = {}
    for r in runs:
        for le, frac in r["metrics"][q]["buckets"]:
            acc[le] = acc.get(le, 0.0) + frac * r["metrics"][q]["count"] / total
    return [[le, v] for le, v in acc.items()] if total else []


def _value(rep: dict, name: str, q: str) -> float | None:
    return (rep["configs"].get(name) or {}).get(f"{q}_mean_ms")


def _contrast(doc: dict, sign) -> dict:
    """Per quantity: a +-1 contrast over the factorial cells, per repeat, with its interval.
    `sign(off)` is +1 or -1 for the cell that turns off the features in `off`."""
    cells = factorial_cells()
    out = {}
    for q in ("post", "xfer"):
        per_rep = []
        for rep in doc["p2p"]["repeats"]:
            ys = {name: _value(rep, name, q) for name in cells}
            if any(v is None for v in ys.values()):
                continue
            plus = [ys[n] for n, off in cells.items() if sign(off) > 0]
            minus = [ys[n] for n, off in cells.items() if sign(off) < 0]
            per_rep.append(statistics.fmean(plus) - statistics.fmean(minus))
        out[q] = interval(per_rep)
    return out


def feature_effects(doc: dict) -> dict:
    """Main effects (what turning each feature on costs, ms) and two-feature interactions of
    the factorial; empty when the run had no factorial."""
    if not all(name in doc["p2p"]["configs"] for name in factorial_cells()):
        return {"main": [], "interactions": []}
    main = [{"feature": f, "what": FEATURES[f][1],
             **_contrast(doc, lambda off, f=f: -1 if f in off else 1)} for f in FEATURES]
    pairs = []
    for a, b in itertools.combinations(FEATURES, 2):
        c = _contrast(doc, lambda off, a=a, b=b: 1 if (a in off) == (b in off) else -1)
        pairs.append({"features": [a, b], **{q: _halved(v) for q, v in c.items()}})
    return {"main": main, "interactions": pairs}


def _halved(iv: dict) -> dict:
    """An interaction in the usual +-1 coding is half the agree-minus-differ contrast."""
    if iv["mean"] is None:
        return iv
    return {"mean": iv["mean"] / 2, "ci95": [x / 2 for x in iv["ci95"]] if iv["ci95"] else None,
            "n": iv["n"]}


def _what(name: str, one_step: dict[str, str]) -> str:
    """What a configuration changes, for the one-step table."""
    if name == "engine":
        return "vLLM 0.32.0 as the lab deploys it"
    if name.startswith("paced@"):
        return "paced at the rate (a transfer every 1000/R ms), polled at decode's steps"
    if name.startswith("poll-drawn@"):
        return "poll at decode's measured step times"
    return one_step[name]


def factor_costs(doc: dict) -> list[dict]:
    """Per configuration one step from the engine (a feature off, a what-if, the drawn poll):
    mean post/xfer over repeats, and engine minus it (what the engine pays for the step)."""
    reps = doc["p2p"]["repeats"]
    one_step = ({f"off:{f}": v[1] for f, v in FEATURES.items()}
                | {k: v[1] for k, v in VARIANTS.items()} | UNPINNED)

    def mean_of(name: str, q: str) -> float | None:
        return _mean([_value(r, name, q) for r in reps])

    base = {q: mean_of("engine", q) for q in ("post", "xfer")}
    out = []
    for name in doc["p2p"]["configs"]:
        if name.startswith("off:") and name not in one_step:
            continue  # a factorial cell two or more steps away: in the effects instead
        row = {"config": name, "what": _what(name, one_step)}
        for q in ("post", "xfer"):
            v = mean_of(name, q)
            row[f"{q}_mean_ms"] = v
            row[f"{q}_feature_cost_ms"] = (base[q] - v if name in one_step and v is not None
                                           and base[q] is not None else None)
        out.append(row)
    return out


def analyse(doc: dict) -> dict:
    rows = [rate_row(doc, f"{r:g}") for r in doc["rates_rps"]]
    lowest = rows[0] if rows else None
    target = None
    if lowest:
        judged = "paced" if lowest["paced"]["ratio"]["post"]["mean"] is not None else "engine_shaped"
        target = {q: {"prediction": judged, "ratio": lowest[judged]["ratio"][q]["mean"],
                      "within": tol,
                      "met": (lowest[judged]["ratio"][q]["mean"] is not None
                              and abs(lowest[judged]["ratio"][q]["mean"] - 1) <= tol)}
                  for q, tol in TARGETS.items()}
    return {"rates": rows, "factor_costs": factor_costs(doc), "feature_effects": feature_effects(doc),
            "target_at_lowest_rate": target,
            "targets_note": "judged only on a quiet machine; see loadavg in engine and p2p runs"}


# ---------------------------------------------------------------------------
# Markdown


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(r: dict) -> str:
    if r["mean"] is None:
        return "-"
    ci = r["ci95"]
    return f"{r['mean']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else " (1 repeat)")


def markdown(doc: dict) -> str:
    a = doc["agreement"]
    p = doc["p2p"]
    lines = [f"# kvbench lab agree ({doc['finished']})", "",
             f"`{' '.join(doc['command'])}` on {doc['host']} ({doc['cpu_count']} CPUs); load "
             f"average at the end {', '.join(f'{x:.2f}' for x in doc['loadavg_end'])}.",
             f"p2p: {p['tokens']} tokens per transfer ({p['tokens_why']}), block size "
             f"{p['block_size']}, cores {p['cores']}, UCX {p['ucx_env']}.", "",
             "## Engine mean vs prediction (ms; ratio = engine / prediction, 95% interval over repeats)",
             "", "Predictions: engine-shaped (back to back, 1 ms polling), paced (a transfer every "
             "1000/R ms, polled at decode's measured step times: the engine as it runs at that "
             "rate), drawn poll (those step times, back to back), plain link fit.", "",
             "| rps | runs | quantity | engine | engine-shaped | ratio | paced | ratio | "
             "drawn poll | ratio | plain fit | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in a["rates"]:
        es, pc, dp, pl = r["engine_shaped"], r["paced"], r["drawn_poll"], r["plain"]
        for q in ("post", "xfer"):
            plain = (f"{_f(pl['predicted_mean_ms'])} | {_ratio(pl['ratio']['xfer'])}"
                     if q == "xfer" else "- | -")
            lines.append(
                f"| {r['rate_rps']:g} | {r['engine_runs']} | {q} | {_f(r['engine_mean_ms'][q])} | "
                f"{_f(es['predicted_mean_ms'][q])} | {_ratio(es['ratio'][q])} | "
                f"{_f(pc['predicted_mean_ms'][q])} | {_ratio(pc['ratio'][q])} | "
                f"{_f(dp['predicted_mean_ms'][q])} | {_ratio(dp['ratio'][q])} | {plain} |")
    t = a["target_at_lowest_rate"]
    if t:
        lines += ["", "Target at the lowest rate (quiet machine only; judged on the "
                  f"{next(iter(t.values()))['prediction'].replace('_', '-')} prediction): " + "; ".join(
            f"{q} ratio {_f(v['ratio'], '.2f')} (within ±{v['within']:.0%}: "
            f"{'met' if v['met'] else 'not met'})" for q, v in t.items())]
    lines += ["", "## One step from the engine (kvbench p2p, NIXL telemetry means, ms)", "",
              "| configuration | what it changes | post | xfer | feature cost post | feature cost xfer |",
              "|---|---|---|---|---|---|"]
    for c in a["factor_costs"]:
        lines.append(f"| {c['config']} | {c['what']} | {_f(c['post_mean_ms'])} | "
                     f"{_f(c['xfer_mean_ms'])} | {_f(c['post_feature_cost_ms'])} | "
                     f"{_f(c['xfer_feature_cost_ms'])} |")
    lines += _effects_markdown(a.get("feature_effects") or {})
    lines += ["", "Engine bucket fractions (share of the run's transfers at or below each bound, ms):", ""]
    for r in a["rates"]:
        for q in ("post", "xfer"):
            cells = ", ".join(f"≤{le}: {v:.2f}" for le, v in r["buckets"][q] if v > 0)
            lines.append(f"- {r['rate_rps']:g} rps {q}: {cells or '-'}")
    return "\n".join(lines) + "\n"


def _effects_markdown(fx: dict) -> list[str]:
    if not fx.get("main"):
        return []
    n = fx["main"][0]["post"]["n"]
    lines = ["", f"## What each engine feature costs: main effects of the 2^{len(FEATURES)} "
             f"factorial (ms, 95% interval over {n} repeat(s))", "",
             "Turning the feature on, averaged over every setting of the others.", "",
             "| feature | what | post | xfer |", "|---|---|---|---|"]
    for e in fx["main"]:
        lines.append(f"| {e['feature']} | {e['what']} | {_effect(e['post'])} | {_effect(e['xfer'])} |")
    lines += ["", "Two-feature interactions (+-1 coding; an interval that excludes 0 means the "
              "pair's costs do not simply add):", "", "| features | post | xfer |", "|---|---|---|"]
    for e in fx["interactions"]:
        lines.append(f"| {' x '.join(e['features'])} | {_effect(e['post'])} | {_effect(e['xfer'])} |")
    return lines


def _effect(iv: dict) -> str:
    if iv["mean"] is None:
        return "-"
    ci = iv["ci95"]
    return f"{iv['mean']:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else " (1 repeat)")
