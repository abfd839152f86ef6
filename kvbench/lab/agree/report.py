"""The agreement of `kvbench lab agree`: engine means vs kvbench's predictions, as JSON and Markdown.

Per rate the engine's mean (each run's exact mean from its histogram's _sum/_count; the mean
over runs) is divided by kvbench's (each p2p job's NIXL telemetry mean; the mean over jobs),
with a 95% interval built for a positive ratio (kvbench.lab.agree.stats: log scale, the run
as the unit, none from fewer than 3 runs a side, the reason printed instead). Predictions:

    engine-shaped  NIXL telemetry means of `kvbench p2p --nixl-engine-profile lab` (postDuration,
                   xferDuration), the engine as deployed (poll every 1 ms, idle engine)
    drawn poll     the same, completion polled at decode's measured step times at that rate
    paced          drawn poll plus a transfer every 1000/R ms (--nixl-gap-ms): the engine as it
                   runs at rate R, progress thread idle between requests
    replica        decode as it runs at rate R under the lab's client (kvbench.lab.agree.p2p.
                   replica_flags): Poisson gaps, decode's work per request inside them, its
                   threads waiting as vLLM's worker waits (--nixl-waits engine), looks on the
                   cadence of the engine's trace; the targets are judged on it when present
                   (else on paced, else on engine-shaped)
    plain          the sweep's plain p2p fit (link shape), setup + bytes/rate at the engine's
                   mean bytes, with the fit's band; it predicts a transfer time, so only xfer
Targets (judged on a quiet machine only): post within 10 %, xfer within 15 % at the lowest
rate. The xfer remainder (kvbench.lab.agree.remainder): where xfer - post goes on each side,
from the engine's per-transfer trace and kvbench's per-handoff telemetry. Feature costs: the
main effect of each engine feature in the 2^k factorial (per repeat: mean over the cells with
it on minus mean over those with it off; paired t interval over repeats), two-feature
interactions the same way (cells where the pair agree minus cells where they differ, halved:
the usual +-1 coding), and beside them the plain one-step differences (engine minus a variant).
"""

from __future__ import annotations

import itertools
import statistics

from kvbench.lab.agree.p2p import FEATURES, UNPINNED, VARIANTS, factorial_cells
from kvbench.lab.agree.remainder import remainder
from kvbench.lab.agree.stats import DIFF_METHOD, RATIO_METHOD, diff_interval, ratio_interval

TARGETS = {"post": 0.10, "xfer": 0.15}


def _plain_ms(doc: dict, nbytes: float | None) -> tuple[float | None, str | None, list | None]:
    """The plain fit's handoff time at the engine's mean bytes, its label and 95% band."""
    if not doc.get("plain_fit") or not nbytes:
        return None, None, None
    from kvbench.plan.floors import links_from_fit

    try:
        link = links_from_fit(doc["plain_fit"], {})[0]
    except Exception as exc:  # noqa: BLE001 - said in the document instead
        return None, f"plain fit unreadable: {exc}", None
    cost = link.for_payload(round(nbytes))[0]
    return cost.handoff_floor(round(nbytes))[1], link.label, link.band(round(nbytes))


def _runs_of(doc: dict, name: str, q: str) -> list[float]:
    """kvbench's run means (one per p2p job) of one configuration."""
    return [x for x in ((rep["configs"].get(name) or {}).get(f"{q}_mean_ms")
                        for rep in doc["p2p"]["repeats"]) if x is not None]


def rate_row(doc: dict, rate: str) -> dict:
    runs = [r for r in doc["engine"].get(rate, []) if r["metrics"].get("xfer", {}).get("count")]
    row: dict = {"rate_rps": float(rate), "engine_runs": len(runs)}
    e = {q: [r["metrics"][q]["mean"] for r in runs] for q in ("post", "xfer")}
    nbytes = [r["metrics"].get("bytes", {}).get("mean") for r in runs]
    row["engine_mean_ms"] = {q: statistics.fmean(v) if v else None for q, v in e.items()}
    row["engine_mean_bytes"] = statistics.fmean([b for b in nbytes if b]) if any(nbytes) else None
    row["engine_descs_mean"] = _mean([r["metrics"].get("descs", {}).get("mean") for r in runs])
    for label, name in (("engine_shaped", "engine"), ("drawn_poll", f"poll-drawn@{rate}"),
                        ("paced", f"paced@{rate}"), ("replica", f"replica@{rate}")):
        preds = {q: _runs_of(doc, name, q) for q in ("post", "xfer")}
        row[label] = {"config": name,
                      "predicted_mean_ms": {q: _mean(v) for q, v in preds.items()},
                      "ratio": {q: ratio_interval(e[q], preds[q]) for q in ("post", "xfer")}}
    plain, label, band = _plain_ms(doc, row["engine_mean_bytes"])
    row["plain"] = {"link": label, "predicted_mean_ms": plain, "band95_ms": band,
                    "ratio": {"xfer": ratio_interval(e["xfer"], plain, band)}}
    row["buckets"] = {q: _pooled(runs, q) for q in ("post", "xfer")}
    row["judged_on"] = judged_on(row)
    row["remainder"] = remainder(doc, rate, row[row["judged_on"]]["config"])
    return row


JUDGED_ORDER = ("replica", "paced", "engine_shaped")  # the most faithful replica first


def judged_on(row: dict) -> str:
    """The prediction a rate's targets are judged on: the most faithful one the run has
    (replica, chosen before its first lab result; else paced; else engine-shaped)."""
    return next((k for k in JUDGED_ORDER if row[k]["predicted_mean_ms"]["post"] is not None),
                "engine_shaped")


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
        out[q] = diff_interval(per_rep)
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
    return {**iv, "mean": iv["mean"] / 2,
            "ci95": [x / 2 for x in iv["ci95"]] if iv["ci95"] else None}


def _what(name: str, one_step: dict[str, str]) -> str:
    """What a configuration changes, for the one-step table."""
    if name == "engine":
        return "vLLM 0.32.0 as the lab deploys it"
    if name.startswith("paced@"):
        return "paced at the rate (a transfer every 1000/R ms), polled at decode's steps"
    if name.startswith("poll-drawn@"):
        return "poll at decode's measured step times"
    if name.startswith("replica@"):
        return ("Poisson gaps at the rate with decode's work per request inside them, vLLM's "
                "worker waits (yield-spin 1 s after the last work, then sleep), traced look cadence")
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


def _target(iv: dict, judged: str, tol: float) -> dict:
    """Met on the point estimate; `confident` when the whole interval lies within the band."""
    ci = iv["ci95"]
    return {"prediction": judged, "ratio": iv["mean"], "ci95": ci, "within": tol,
            "met": iv["mean"] is not None and abs(iv["mean"] - 1) <= tol,
            "confident": ci is not None and 1 - tol <= ci[0] and ci[1] <= 1 + tol}


def analyse(doc: dict) -> dict:
    rows = [rate_row(doc, f"{r:g}") for r in doc["rates_rps"]]
    lowest = rows[0] if rows else None
    target = None
    if lowest:
        judged = lowest["judged_on"]
        target = {q: _target(lowest[judged]["ratio"][q], judged, tol) for q, tol in TARGETS.items()}
        rem = lowest["remainder"].get("xfer_ratio_with_engine_post")
        target["xfer"]["remainder_only_ratio"] = rem  # xfer - post reproduced when near 1
        target["xfer"]["remainder_reproduced"] = rem is not None and abs(rem - 1) <= TARGETS["xfer"]
    return {"rates": rows, "factor_costs": factor_costs(doc), "feature_effects": feature_effects(doc),
            "target_at_lowest_rate": target,
            "targets_note": "judged only on a quiet machine; see loadavg in engine and p2p runs"}


# ---------------------------------------------------------------------------
# Markdown


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(r: dict) -> str:
    """A ratio with its interval, or with "no interval" (the reason is listed below the table)."""
    if r["mean"] is None:
        return "-"
    ci = r["ci95"]
    return f"{r['mean']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else " (no interval)")


def _ratio_table(a: dict) -> list[str]:
    lines = ["## Engine mean vs prediction (ms; ratio = engine / prediction)", "",
             f"Intervals: {RATIO_METHOD}. n = engine runs / p2p jobs (the plain fit is one "
             "prediction with its own 95% band).", "",
             "Predictions: replica (decode as it runs at the rate: Poisson gaps with its work "
             "per request inside them, threads waiting as vLLM's worker waits, looks on the "
             "engine's traced cadence), engine-shaped (back to back, 1 ms polling), paced (a "
             "transfer every 1000/R ms, sleeping waits, polled at decode's measured step "
             "times), drawn poll (those step times, back to back), plain link fit.", "",
             "| rps | n | quantity | engine | replica | ratio | engine-shaped | ratio | paced | "
             "ratio | drawn poll | ratio | plain fit | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    why: list[str] = []
    for r in a["rates"]:
        rp, es, pc, dp, pl = r["replica"], r["engine_shaped"], r["paced"], r["drawn_poll"], r["plain"]
        for q in ("post", "xfer"):
            ivs = [rp["ratio"][q], es["ratio"][q], pc["ratio"][q], dp["ratio"][q]] + (
                [pl["ratio"]["xfer"]] if q == "xfer" else [])
            why += [iv["why"] for iv in ivs if iv["mean"] is not None and iv["why"]]
            plain = (f"{_f(pl['predicted_mean_ms'])} | {_ratio(pl['ratio']['xfer'])}"
                     if q == "xfer" else "- | -")
            n = f"{es['ratio'][q]['n']}/{es['ratio'][q]['n_den']}"
            lines.append(
                f"| {r['rate_rps']:g} | {n} | {q} | {_f(r['engine_mean_ms'][q])} | "
                f"{_f(rp['predicted_mean_ms'][q])} | {_ratio(rp['ratio'][q])} | "
                f"{_f(es['predicted_mean_ms'][q])} | {_ratio(es['ratio'][q])} | "
                f"{_f(pc['predicted_mean_ms'][q])} | {_ratio(pc['ratio'][q])} | "
                f"{_f(dp['predicted_mean_ms'][q])} | {_ratio(dp['ratio'][q])} | {plain} |")
    if why:
        lines += ["", "No interval where marked: " + "; ".join(dict.fromkeys(why)) + "."]
    return lines


def markdown(doc: dict) -> str:
    a = doc["agreement"]
    p = doc["p2p"]
    lines = [f"# kvbench lab agree ({doc['finished']})", "",
             f"`{' '.join(doc['command'])}` on {doc['host']} ({doc['cpu_count']} CPUs); load "
             f"average at the end {', '.join(f'{x:.2f}' for x in doc['loadavg_end'])}.",
             f"p2p: {p['tokens']} tokens per transfer ({p['tokens_why']}), block size "
             f"{p['block_size']}, cores {p['cores']}, UCX {p['ucx_env']}.", ""]
    lines += _ratio_table(a)
    t = a["target_at_lowest_rate"]
    if t:
        lines += ["", "Target at the lowest rate (quiet machine only; judged on the "
                  f"{next(iter(t.values()))['prediction'].replace('_', '-')} prediction): " + "; ".join(
            f"{q} ratio {_f(v['ratio'], '.2f')} (within ±{v['within']:.0%}: "
            f"{'met' if v['met'] else 'not met'}; the interval "
            f"{'lies inside' if v['confident'] else 'does not lie inside'} the band)"
            for q, v in t.items())]
        rem = t["xfer"].get("remainder_only_ratio")
        if rem is not None:
            lines.append("")
            lines.append(f"The xfer remainder beyond the post (engine xfer / (engine post + "
                         f"kvbench's xfer - post) = {rem:.2f}) is "
                         + ("reproduced within ±15 %: the xfer ratio's distance from 1 is the "
                            "post's." if t["xfer"]["remainder_reproduced"] else
                            "not reproduced within ±15 %: see where xfer goes beyond post."))
    lines += _remainder_markdown(a)
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


def _remainder_markdown(a: dict) -> list[str]:
    """Where xfer goes beyond post, per rate, engine against kvbench (agree_remainder)."""
    rows = [(r["rate_rps"], r["remainder"]) for r in a["rates"] if r["remainder"]["engine"]]
    if not rows:
        return []
    lines = ["", "## Where xfer goes beyond post (per transfer: NIXL telemetry; engine: "
             "kvbench.lab.venv.nixltrace in vLLM's decode worker)", "",
             "xfer - post = in-flight share x wait: a READ still in flight at the look in its "
             "posting step is seen a step later. Fast posts (<= 0.5 ms) that returned before "
             "the READ was done are the READs that can be late.", "",
             "| rps | side | transfers | post | xfer | xfer - post | in flight at the look | "
             "late READs' wait | fast posts | fast posts not done |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, rem in rows:
        for side, d in (("engine", rem["engine"]), (rem["config"], rem["kvbench"])):
            if not d:
                continue
            lines.append(
                f"| {rate:g} | {side} | {d['n']} | {_f(d['post_mean_ms'])} | "
                f"{_f(d['xfer_mean_ms'])} | {_f(d['remainder_ms'])} | "
                f"{d['in_flight_share']:.1%} ({d['in_flight_n']}) | {_f(d['late_wait_mean_ms'], '.2f')} | "
                f"{d['fast_post_share']:.0%} | {_pct(d['fast_posts_not_done_share'])} |")
    lines.append("")
    for rate, rem in rows:
        lines += _remainder_lines(rate, rem)
    cold = rows[0][1]["cold"]
    if cold:
        lines += ["", f"The deployment's first transfer (warm-up, before any measured run): "
                  f"xfer {cold['first_xfer_ms']:.1f} ms (post {cold['first_post_ms']:.2f} ms), "
                  "then " + ", ".join(f"{x:.2f}" for x in cold["then_xfer_ms"]) + " ms; kept "
                  "out of the runs as kvbench keeps its cold handoff out of its means."]
    return lines


def _remainder_lines(rate: float, rem: dict) -> list[str]:
    """Which term the xfer ratio's distance from 1 comes from, and the engine's posts by
    what its worker did before them."""
    out = []
    if rem["kvbench"]:
        out.append(f"- {rate:g} rps: engine xfer / (engine post + {rem['config']}'s xfer - post) "
                   f"= {rem['xfer_ratio_with_engine_post']:.2f}; engine xfer / ({rem['config']}'s "
                   f"post + engine's xfer - post) = {rem['xfer_ratio_with_engine_in_flight_term']:.2f}.")
    for side, key in (("Engine", "engine_posts_by_worker_state"),
                      (rem["config"], "kvbench_posts_by_worker_state")):
        ws = rem.get(key)
        if not ws:
            continue
        a, b, c = ws["within_busy_loop"], ws["after_idle"], ws.get("decoding") or {"n": 0}
        busy = (f" (of them {c['n']} right after decode's work, mean {_f(c['post_mean_ms'])} ms, "
                f"{_pct(c['fast_share'])} fast)" if c["n"] else "")
        out.append(f"  {side} posts within 1 s of decode's last work (vLLM's worker yield-spins "
                   f"then): {a['n']}, mean {_f(a['post_mean_ms'])} ms, {_pct(a['fast_share'])} "
                   f"fast{busy}; after longer idle (it slept): {b['n']}, mean "
                   f"{_f(b['post_mean_ms'])} ms, {_pct(b['fast_share'])} fast.")
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _effects_markdown(fx: dict) -> list[str]:
    if not fx.get("main"):
        return []
    n = fx["main"][0]["post"]["n"]
    lines = ["", f"## What each engine feature costs: main effects of the 2^{len(FEATURES)} "
             f"factorial (ms; {n} repeat(s); {DIFF_METHOD})", "",
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
    return f"{iv['mean']:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else " (no interval)")
