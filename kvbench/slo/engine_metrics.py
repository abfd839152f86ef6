"""What a scrape file (`kvbench slo scrape`) says about queues and KV transfers, per role.

- **Queue trend** per role: the waiting-queue gauge's mean over the first and the last third
  of the successful scrapes (in time order), judged by the client-side gate's rule: growing
  when last > first x 1.5 and by more than 1 request. Fewer than 9 scrapes are not judged.
- **KV transfers** from the engine's histograms: between consecutive successful scrapes the
  increase of `_count`, `_sum` and every `_bucket` is what happened in that interval (a
  decrease means the engine restarted: that interval is skipped and counted). Per window
  (`--metrics-window-s`) and in total: transfers, bytes, mean bytes, mean time, and the
  P50/P90/P99 transfer time by linear interpolation inside the bucket that holds the rank
  (PromQL's `histogram_quantile` rule; its resolution is the bucket width). A quantile is
  given only when the count supports it (q needs n >= ceil(1/(1-q))).
- **Observed handoff rate** = bytes / transfer time summed over all transfers (GB/s, 1e9),
  and with `--fit`, kvbench's fitted `setup_ms + bytes/(GB/s x 1e9) x 1000` for the mean
  transfer's bytes beside the observed mean time (the model is affine, so the model of the
  mean is the mean of the model), and their ratio.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.schema.read import iter_jsonl
from kvbench.records.schema.slo import SCHEMA_METRICS, SCRAPE_LINES, ScrapeHeader
from kvbench.records.schema.types import parse, show
from kvbench.records.stats import percentile_supported
from kvbench.slo.engines import ENGINES, NOT_EXPORTED, QUANTITIES, Metric, detect_engine
from kvbench.slo.gates import TREND_MIN_IN_FLIGHT, TREND_RATIO_MAX

MIN_SCRAPES_FOR_TREND = 9  # three per third
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class ScrapeFile:
    path: str
    header: dict
    lines: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))  # role -> lines
    end: dict | None = None


def load_scrape(path: str | Path) -> ScrapeFile:
    """A scrape file, streamed line by line; every line checked (kvbench.records.schema.slo)."""
    p = Path(path)
    out: ScrapeFile | None = None
    for where, rec in iter_jsonl(p, "scrape file", missing="no such file"):
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if out is None:
            if kind != "header" or rec.get("schema") != SCHEMA_METRICS:
                raise UsageError(f"{where}: not a kvbench slo scrape file (expected a {SCHEMA_METRICS} header)")
            out = ScrapeFile(str(p), parse(ScrapeHeader, rec, where).model_dump(by_alias=True))
            continue
        if kind not in SCRAPE_LINES:
            raise UsageError(f"{where}: unknown line kind {show(kind)}")
        line = parse(SCRAPE_LINES[kind], rec, where).model_dump(by_alias=True)
        if kind == "end":
            out.end = line
        else:
            out.lines[line["role"]].append(line)
    if out is None:
        raise UsageError(f"{p}: empty scrape file")
    return out


# ---------------------------------------------------------------------------
# reading one quantity out of the samples


def _rows(samples: dict, names: Sequence[str]) -> list | None:
    for n in names:
        if n in samples:
            return samples[n]
    return None


def scalar(samples: dict, m: Metric, agg: str) -> float | None:
    """A gauge or counter's value, label sets combined by sum (or max); None when absent."""
    names = (m.name, m.name + "_total") if m.kind == "counter" else (m.name,)
    rows = _rows(samples, names)
    if not rows:
        return None
    values = [float(v) for _, v in rows]
    return (max(values) if agg == "max" else sum(values)) * m.scale


def histogram(samples: dict, m: Metric) -> tuple[dict[float, float], float, float] | None:
    """(cumulative count per upper bound, sum, count), label sets summed; None when absent."""
    buckets: dict[float, float] = defaultdict(float)
    for labels, v in samples.get(m.name + "_bucket", []):
        buckets[float(labels.get("le", "nan"))] += float(v)
    total = samples.get(m.name + "_count")
    if not buckets or total is None:
        return None
    return (dict(buckets), sum(float(v) for _, v in samples.get(m.name + "_sum", [])) * m.scale,
            sum(float(v) for _, v in total))


def histogram_quantile(q: float, buckets: dict[float, float], scale: float = 1.0) -> float | None:
    """PromQL's rule: linear inside the bucket holding rank q x count; +Inf -> its lower bound."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return prev_bound * scale
            if buckets[b] == prev_count:
                return b * scale
            return (prev_bound + (b - prev_bound) * (rank - prev_count) / (buckets[b] - prev_count)) * scale
        prev_bound, prev_count = b, buckets[b]
    return None


# ---------------------------------------------------------------------------
# per role


def _thirds_trend(points: list[tuple[float, float]]) -> dict:
    n = len(points)
    out = {"n": n, "mean_first_third": None, "mean_last_third": None, "growing": None, "reason": ""}
    if n < MIN_SCRAPES_FOR_TREND:
        out["reason"] = f"{n} scrapes: too few to judge a trend (need {MIN_SCRAPES_FOR_TREND})"
        return out
    k = n // 3
    a = sum(v for _, v in points[:k]) / k
    b = sum(v for _, v in points[-k:]) / k
    growing = b > a * TREND_RATIO_MAX and b - a > TREND_MIN_IN_FLIGHT
    out.update(mean_first_third=a, mean_last_third=b, growing=growing,
               reason=f"mean {a:.2f} -> {b:.2f} from the first to the last third "
                      f"({'growing' if growing else 'not growing'}: rule last > {TREND_RATIO_MAX} x first "
                      f"and by > {TREND_MIN_IN_FLIGHT:g})")
    return out


def _gaps(lines: list[dict]) -> list[dict]:
    """Runs of consecutive failed scrapes, with their first error."""
    runs: list[dict] = []
    prev_gap = False
    for ln in lines:
        if ln["kind"] == "gap":
            if prev_gap:
                runs[-1].update(to_s=ln["t_s"], count=runs[-1]["count"] + 1)
            else:
                runs.append({"from_s": ln["t_s"], "to_s": ln["t_s"], "count": 1, "error": ln.get("error")})
        prev_gap = ln["kind"] == "gap"
    return runs


def _counter_increase(points: list[tuple[float, float]]) -> tuple[float | None, int]:
    """Total increase of a counter across scrapes, and how many resets were skipped."""
    if len(points) < 2:
        return None, 0
    inc, resets = 0.0, 0
    for (_, a), (_, b) in zip(points, points[1:], strict=False):
        if b < a:
            resets += 1
        else:
            inc += b - a
    return inc, resets


def _table(engine: str | None, mapping: dict[str, Metric] | None) -> dict[str, Metric]:
    if mapping is not None:
        return mapping
    return ENGINES.get(engine or "", {})


def _series(ok: list[dict], table: dict[str, Metric], q: str) -> list[tuple[float, float]]:
    if q not in table:
        return []
    pts = [(ln["t_s"], scalar(ln["samples"], table[q], QUANTITIES[q][2])) for ln in ok]
    return [(t, v) for t, v in pts if v is not None]


def analyze_role(role: str, lines: list[dict], engine: str | None, mapping: dict[str, Metric] | None,
                 window_s: float, link=None) -> dict:
    ok = [ln for ln in lines if ln["kind"] == "sample"]
    names = {n for ln in ok for n in ln["samples"]}
    engine = engine or detect_engine(names)
    table = _table(engine, mapping)
    out: dict = {"role": role, "url": lines[0]["url"] if lines else None, "engine": engine,
                 "scrapes": len(ok), "gaps": _gaps(lines),
                 "span_s": [ok[0]["t_s"], ok[-1]["t_s"]] if ok else None, "metrics": {}}
    for q in ("waiting", "running", "kv_usage", "rejected", "xfer_failures", "kv_expired"):
        m = table.get(q)
        out["metrics"][q] = m.name if m else None
        if m is None and (engine, q) in NOT_EXPORTED:
            out.setdefault("notes", []).append(NOT_EXPORTED[(engine, q)])
    out["queue"] = _thirds_trend(_series(ok, table, "waiting"))
    out["running"] = _thirds_trend(_series(ok, table, "running"))
    usage = [v for _, v in _series(ok, table, "kv_usage")]
    out["kv_usage"] = {"max": max(usage), "last": usage[-1]} if usage else None
    for q in ("rejected", "xfer_failures", "kv_expired"):
        inc, resets = _counter_increase(_series(ok, table, q))
        out[q] = {"increase": inc, "resets_skipped": resets} if inc is not None else None
    out["kv_transfer"] = kv_transfer(ok, table, window_s, link)
    return out


def analyze_scrape(sf: ScrapeFile, mapping: dict[str, Metric] | None, window_s: float,
                   link=None) -> dict:
    h = sf.header
    engine = h.get("engine") if h.get("engine") not in (None, "auto") else None
    return {
        "file": sf.path,
        "labels": {k: h.get(k) for k in ("deployment", "offered_rate_rps", "cache_state")},
        "interval_s": h.get("interval_s"), "duration_s": h.get("duration_s"),
        "interrupted": bool(sf.end and sf.end.get("interrupted")), "complete": sf.end is not None,
        "roles": [analyze_role(r, lines, engine, mapping, window_s, link) for r, lines in sf.lines.items()],
    }


# ---------------------------------------------------------------------------
# KV transfers from histograms


def _hist_points(ok: list[dict], m: Metric | None) -> list[tuple[float, tuple]]:
    if m is None:
        return []
    pts = [(ln["t_s"], histogram(ln["samples"], m)) for ln in ok]
    return [(t, h) for t, h in pts if h is not None]


def _delta(a: tuple, b: tuple) -> tuple | None:
    """b - a for (buckets, sum, count); None when the histogram went down (a restart)."""
    if b[2] < a[2] or b[1] < a[1] - 1e-12:
        return None
    buckets = {le: b[0].get(le, 0.0) - a[0].get(le, 0.0) for le in b[0]}
    return buckets, b[1] - a[1], b[2] - a[2]


def _add(acc: tuple | None, d: tuple) -> tuple:
    if acc is None:
        return d
    return ({le: acc[0].get(le, 0.0) + v for le, v in d[0].items()}, acc[1] + d[1], acc[2] + d[2])


def _summary(t0: float, t1: float, time_d: tuple | None, bytes_d: tuple | None) -> dict:
    n = time_d[2] if time_d else (bytes_d[2] if bytes_d else 0.0)
    row: dict = {"from_s": t0, "to_s": t1, "transfers": n,
                 "bytes": bytes_d[1] if bytes_d else None,
                 "mean_bytes": bytes_d[1] / bytes_d[2] if bytes_d and bytes_d[2] else None,
                 "mean_ms": time_d[1] / time_d[2] * 1000 if time_d and time_d[2] else None}
    for q in QUANTILES:
        key = f"p{round(q * 100)}_ms"
        ok = time_d is not None and time_d[2] > 0 and percentile_supported(q, time_d[2])
        v = histogram_quantile(q, time_d[0]) if ok else None
        row[key] = v * 1000 if v is not None else None
    row["observed_gb_s"] = (bytes_d[1] / time_d[1] / 1e9 if bytes_d and time_d and time_d[1] > 0
                            and bytes_d[2] == time_d[2] else None)
    return row


def kv_transfer(ok: list[dict], table: dict[str, Metric], window_s: float, link=None) -> dict | None:
    times, sizes = _hist_points(ok, table.get("xfer_time")), _hist_points(ok, table.get("xfer_bytes"))
    if not times and not sizes:
        last = _series(ok, table, "xfer_time_last")
        if not last:
            return None
        vals = sorted(v * 1000 for _, v in last)
        return {"source": "sampled_gauge", "metric": table["xfer_time_last"].name,
                "note": "the engine exports only the latest transfer's time: these are scrape "
                        "samples of it, not every transfer; no count, no distribution",
                "samples": len(vals), "median_ms": vals[len(vals) // 2], "max_ms": vals[-1]}
    by_t = {t: h for t, h in sizes}
    windows, total_t, total_b, resets = [], None, None, 0
    cur_t = cur_b = None
    w_start = (times or sizes)[0][0]
    pts = times or sizes
    for (ta, ha), (tb, hb) in zip(pts, pts[1:], strict=False):
        dt = _delta(ha, hb)
        db = _delta(by_t[ta], by_t[tb]) if times and ta in by_t and tb in by_t else None
        if not times:
            dt, db = None, _delta(ha, hb)
        if dt is None and db is None:
            resets += 1
            continue
        if dt is not None:
            cur_t, total_t = _add(cur_t, dt), _add(total_t, dt)
        if db is not None:
            cur_b, total_b = _add(cur_b, db), _add(total_b, db)
        if tb - w_start >= window_s - 1e-9:
            windows.append(_summary(w_start, tb, cur_t, cur_b))
            w_start, cur_t, cur_b = tb, None, None
    if cur_t is not None or cur_b is not None:
        windows.append(_summary(w_start, pts[-1][0], cur_t, cur_b))
    total = _summary(pts[0][0], pts[-1][0], total_t, total_b)
    if total_t is not None:
        total["time_buckets_ms"] = bucket_counts(total_t[0])
    out = {"source": "histogram", "time_metric": table["xfer_time"].name if "xfer_time" in table else None,
           "bytes_metric": table["xfer_bytes"].name if "xfer_bytes" in table else None,
           "window_s": window_s, "resets_skipped": resets, "total": total, "windows": windows}
    if link is not None:
        out["model"] = model_beside(total, link)
    return out


def bucket_counts(cumulative: dict[float, float]) -> list[list]:
    """[[upper bound in ms ("+Inf" for the last), transfers in that bucket], ...] from cumulative
    counts per upper bound in s: the distribution as the engine's buckets resolve it."""
    out, below = [], 0.0
    for le in sorted(cumulative):
        out.append(["+Inf" if math.isinf(le) else le * 1000, cumulative[le] - below])
        below = cumulative[le]
    return out


def model_beside(total: dict, link) -> dict | None:
    """kvbench's fitted handoff for the engine's mean transfer, beside what the engine saw.

    The prediction is the link's cost at the mean bytes (its two-regime fit where it has one,
    a negative setup used as 0); the band is the 95% band of that prediction from the fit's
    joint bootstrap draws of (setup, slope) (`FittedLink.band`), so the ratio has a band too.
    """
    b, t = total.get("mean_bytes"), total.get("mean_ms")
    if not b:
        return None
    pc = link.for_payload(round(b))
    cost, regime, notes = pc.cost, pc.regime, pc.notes
    predicted = cost.handoff_floor(round(b))[1]
    band = link.band(round(b))
    ratio_band = ([t / band[1], t / band[0]] if band and t is not None and band[0] > 0 else None)
    return {"link": link.label, "setup_ms": cost.setup_ms, "effective_gb_s": cost.effective_gb_s,
            "regime": regime, "mean_bytes": b, "predicted_mean_ms": predicted,
            "predicted_band_ms": band, "no_band": None if band else (link.no_band or "no bootstrap draws in the fit"),
            "observed_mean_ms": t,
            "observed_over_predicted": t / predicted if t is not None and predicted > 0 else None,
            "observed_over_band": ratio_band, "notes": notes,
            "note": "prediction = setup_ms + mean bytes / (GB/s x 1e9) x 1000; band: 95% of the fit's "
                    "joint bootstrap draws at those bytes (the model's uncertainty, not the spread of "
                    "single transfers); the engine's time is its own transfer timer (e.g. vLLM NIXL: "
                    "post to completion)"}
