"""From request records to gates: attainment, error rate, queue stability, capacity, verdict.

One group is one deployment at one offered rate. Every record of a group is counted in
exactly one place: warm-up excluded, or measured with its status (ok, error, rejected,
timeout). Attainment is always shown two ways, of successful requests and of all requests
offered after warm-up, and the gate uses the denominator the user declared.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvbench.cli import UsageError
from kvbench.slo.metrics import PERCENTILE_METHOD, RequestMetrics, request_metrics, summarize
from kvbench.slo.records import STATUSES, RequestRecord

NUMERATORS = {
    "requests_meeting_all_limits":
        "successful requests meeting every declared limit (TTFT, TPOT, max ITL per request, deadline)",
    "requests_meeting_ttft_and_tpot": "successful requests meeting the TTFT and TPOT limits",
}
DENOMINATORS = {
    "all_offered_after_warmup": "every request offered after warm-up: ok, error, rejected and timeout",
    "successful": "requests that completed with status ok after warm-up",
}
# the tutorial's wording (pd-benchmark-plan.yaml) of the same two choices
NUMERATOR_SYNONYMS = {
    "successful_requests_meeting_all_three_latency_conditions": "requests_meeting_all_limits",
}
DENOMINATOR_SYNONYMS = {
    "all_offered_requests_after_warmup_including_rejections_and_timeouts": "all_offered_after_warmup",
}

# Queue stability: a stable queue completes what is offered and does not drift upward.
ACHIEVED_MIN_FRACTION = 0.95  # achieved_rps >= 0.95 x offered_rps
TREND_RATIO_MAX = 1.5  # last-third / first-third above this is an upward trend ...
TREND_MIN_TTFT_MS = 20.0  # ... when TTFT also grew by more than this (noise floor)
TREND_MIN_IN_FLIGHT = 1.0  # ... or in-flight grew by more than one request
MIN_REQUESTS_FOR_TREND = 20  # below this one straggler moves the achieved ratio past 5%
DEFAULT_SEND_LAG_P99_MAX_MS = 100.0


@dataclass(frozen=True)
class Criteria:
    """What the user declared: per-request limits, attainment rule, gates, warm-up and window."""

    denominator: str
    slo_attainment_min: float | None  # fraction 0..1
    numerator: str = "requests_meeting_all_limits"
    ttft_max_ms: float | None = None
    tpot_max_ms: float | None = None
    max_itl_per_request_ms: float | None = None
    request_deadline_ms: float | None = None
    output_tokens_minimum_for_tpot: int = 2
    error_rate_max: float | None = None  # fraction 0..1
    require_no_sustained_queue_growth: bool = True
    warmup_requests: int = 0
    duration_s: float | None = None
    send_lag_p99_max_ms: float = DEFAULT_SEND_LAG_P99_MAX_MS

    def __post_init__(self):
        if self.denominator not in DENOMINATORS:
            raise UsageError(f"denominator {self.denominator!r} is not one of {', '.join(DENOMINATORS)}")
        if self.numerator not in NUMERATORS:
            raise UsageError(f"numerator {self.numerator!r} is not one of {', '.join(NUMERATORS)}")
        if self.ttft_max_ms is None and self.tpot_max_ms is None:
            raise UsageError("declare at least one latency limit (TTFT or TPOT)")
        for name in ("slo_attainment_min", "error_rate_max"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 1:
                raise UsageError(f"{name} is a fraction in 0..1 (0.95 means 95%), got {v}")
        if self.output_tokens_minimum_for_tpot < 2:
            raise UsageError("output_tokens_minimum_for_tpot must be at least 2")
        if self.warmup_requests < 0:
            raise UsageError("warmup_requests must not be negative")

    def limits(self) -> dict[str, float]:
        """The per-request limits in force for the declared numerator."""
        names = (("ttft", self.ttft_max_ms), ("tpot", self.tpot_max_ms))
        if self.numerator == "requests_meeting_all_limits":
            names += (("max_itl", self.max_itl_per_request_ms), ("deadline", self.request_deadline_ms))
        return {k: v for k, v in names if v is not None}


@dataclass
class Gate:
    name: str
    passed: bool | None  # None: not declared or not evaluable, does not block
    value: float | None
    limit: float | None
    detail: str


@dataclass
class GroupReport:
    deployment: str
    offered_rate_rps: float
    counts: dict
    client: dict
    window: dict
    throughput: dict
    latency_ms: dict
    attainment: dict
    error_rate_pct: float | None
    queue: dict
    gates: list[Gate] = field(default_factory=list)
    cache_state: str | None = None

    @property
    def passed(self) -> bool:
        return all(g.passed is not False for g in self.gates)

    @property
    def failed_gates(self) -> list[str]:
        return [g.name for g in self.gates if g.passed is False]

    def to_json(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        out["failed_gates"] = self.failed_gates
        return out


def _pct(num: int, den: int) -> float | None:
    return 100.0 * num / den if den else None


def request_failures(m: RequestMetrics, c: Criteria) -> list[str]:
    """Which declared limits a successful request misses (empty: it meets them all)."""
    fails = []
    lim = c.limits()
    if "ttft" in lim and m.ttft_ms > lim["ttft"]:
        fails.append("ttft")
    if ("tpot" in lim and m.record.output_tokens >= c.output_tokens_minimum_for_tpot
            and m.tpot_ms is not None and m.tpot_ms > lim["tpot"]):
        fails.append("tpot")
    if "max_itl" in lim and m.max_itl_ms is not None and m.max_itl_ms > lim["max_itl"]:
        fails.append("max_itl")
    if "deadline" in lim and m.e2e_ms > lim["deadline"]:
        fails.append("deadline")
    return fails


def _in_flight_at_sends(all_recs: Sequence[RequestRecord], at: Sequence[float]) -> np.ndarray:
    """Requests sent before t and not finished by t, for each t (the request itself excluded)."""
    sends = np.sort(np.array([r.actual_send_ms for r in all_recs]))
    ends = np.sort(np.array([r.finish_ms for r in all_recs]))
    zero = Counter(r.actual_send_ms for r in all_recs if r.finish_ms == r.actual_send_ms)
    t = np.asarray(at, dtype=float)
    started = np.searchsorted(sends, t, side="left")
    finished = np.searchsorted(ends, t, side="right") - np.array([zero.get(x, 0) for x in t])
    return np.maximum(started - finished, 0)


def _thirds(values: Sequence) -> tuple[list, list]:
    k = len(values) // 3
    return list(values[:k]), list(values[len(values) - k:])


def _keeping_up(measured: Sequence[RequestMetrics]) -> dict:
    """Completions per second against sends per second over the same stretch of the run.

    Sends are counted over [first send, last send]; completions (any terminal status) over
    the same window shifted by the median latency, so a stable queue reads ~1.0 whatever its
    latency, one slow straggler moves it by one request, and a growing backlog reads < 1.
    """
    sends = sorted(m.record.actual_send_ms for m in measured)
    if len(sends) < MIN_REQUESTS_FOR_TREND or sends[-1] <= sends[0]:
        return {"offered_actual_rps": None, "achieved_rps": None, "achieved_over_offered": None,
                "latency_shift_ms": None}
    span_s = (sends[-1] - sends[0]) / 1000.0
    shift = float(np.median([m.record.finish_ms - m.record.actual_send_ms for m in measured]))
    lo, hi = sends[0] + shift, sends[-1] + shift
    done = sum(1 for m in measured if lo <= m.record.finish_ms <= hi)
    offered, achieved = (len(sends) - 1) / span_s, (done - 1) / span_s if done else 0.0
    return {"offered_actual_rps": offered, "achieved_rps": achieved,
            "achieved_over_offered": achieved / offered, "latency_shift_ms": shift}


def _queue(group: Sequence[RequestRecord], measured: Sequence[RequestMetrics],
           c: Criteria) -> tuple[dict, Gate]:
    n = len(measured)
    out: dict = {**_keeping_up(measured),
                 "ttft_median_first_third_ms": None, "ttft_median_last_third_ms": None,
                 "in_flight_mean_first_third": None, "in_flight_mean_last_third": None,
                 "growing": None, "reasons": []}
    if n >= MIN_REQUESTS_FOR_TREND:
        first, last = _thirds(measured)
        f_ttft = [m.ttft_ms for m in first if m.ttft_ms is not None]
        l_ttft = [m.ttft_ms for m in last if m.ttft_ms is not None]
        if f_ttft and l_ttft:
            a, b = float(np.median(f_ttft)), float(np.median(l_ttft))
            out["ttft_median_first_third_ms"], out["ttft_median_last_third_ms"] = a, b
            if b > a * TREND_RATIO_MAX and b - a > TREND_MIN_TTFT_MS:
                out["reasons"].append(f"TTFT median rose {a:.1f} -> {b:.1f} ms from the first to the last third")
        flight = _in_flight_at_sends(group, [m.record.actual_send_ms for m in measured])
        fa, fb = _thirds(flight)
        a, b = float(np.mean(fa)), float(np.mean(fb))
        out["in_flight_mean_first_third"], out["in_flight_mean_last_third"] = a, b
        if b > a * TREND_RATIO_MAX and b - a > TREND_MIN_IN_FLIGHT:
            out["reasons"].append(f"in-flight requests rose {a:.1f} -> {b:.1f} from the first to the last third")
    else:
        out["reasons"].append(f"too few requests after warm-up ({n}) to judge a trend")
    ratio = out["achieved_over_offered"]
    if ratio is None and n >= MIN_REQUESTS_FOR_TREND:
        out["reasons"].append("all sends at one instant: no achieved rate to measure")
    elif ratio is not None and ratio < ACHIEVED_MIN_FRACTION:
        out["reasons"].append(f"achieved {out['achieved_rps']:.3f} rps = {ratio:.3f} x the "
                              f"{out['offered_actual_rps']:.3f} rps sent (< {ACHIEVED_MIN_FRACTION})")
    judged = n >= MIN_REQUESTS_FOR_TREND and ratio is not None
    growing = any("rose" in r or "achieved" in r for r in out["reasons"])
    out["growing"] = True if growing else (False if judged else None)
    if not c.require_no_sustained_queue_growth:
        gate = Gate("queue_stability", None, ratio, ACHIEVED_MIN_FRACTION,
                    "not required by the declared acceptance")
    else:  # fail closed: stability that cannot be shown is not claimed
        gate = Gate("queue_stability", out["growing"] is False, ratio,
                    ACHIEVED_MIN_FRACTION, "; ".join(out["reasons"]) or "stable")
    return out, gate


def analyze_group(group: Sequence[RequestRecord], c: Criteria) -> GroupReport:
    """Every number for one deployment at one offered rate."""
    dep, rate = group[0].deployment, group[0].offered_rate_rps
    ordered = sorted(group, key=lambda r: r.send_order_ms)  # stable: file order breaks ties
    warm, rest = ordered[:c.warmup_requests], ordered[c.warmup_requests:]
    measured = [request_metrics(r) for r in rest]
    status = Counter(m.record.status for m in measured)
    ok = [m for m in measured if m.record.status == "ok"]
    fails = {id(m): request_failures(m, c) for m in ok}
    good = [m for m in ok if not fails[id(m)]]
    limit_counts = Counter(f for m in ok for f in fails[id(m)])
    n, n_ok, n_good = len(measured), len(ok), len(good)

    # window: declared duration from the first measured send, else everything observed
    t0 = min((m.record.actual_send_ms for m in measured), default=None)
    if t0 is None:
        t1 = None
    elif c.duration_s is not None:
        t1 = t0 + c.duration_s * 1000.0
    else:
        t1 = max(m.record.finish_ms for m in measured)
    window_s = (t1 - t0) / 1000.0 if t0 is not None and t1 > t0 else None
    in_win = [m for m in measured if t1 is not None and m.record.finish_ms <= t1]

    def per_s(count: float) -> float | None:
        return count / window_s if window_s else None

    ok_in = [m for m in in_win if m.record.status == "ok"]
    throughput = {
        "throughput_rps": per_s(len(ok_in)),
        "output_tokens_per_s": per_s(sum(m.record.output_tokens for m in ok_in)),
        "goodput_rps": per_s(sum(1 for m in ok_in if not fails[id(m)])),
    }
    window = {"window_s": window_s, "source": "declared" if c.duration_s is not None else "observed",
              "finished_after_window": sum(1 for m in measured if t1 is not None and m.record.finish_ms > t1),
              "sent_after_window": sum(1 for m in measured if t1 is not None and m.record.actual_send_ms > t1)}

    sends = sorted(m.record.actual_send_ms for m in measured)
    lags = [m.send_lag_ms for m in measured]
    lag_known = bool(measured) and all(v is not None for v in lags)
    lag = summarize([float(v) for v in lags]) if lag_known else None
    client = {
        "send_rate_rps": (len(sends) - 1) / ((sends[-1] - sends[0]) / 1000.0)
        if len(sends) >= 2 and sends[-1] > sends[0] else None,
        "scheduled_send_known": lag_known,
        "send_lag_ms": lag,
    }
    counts = {"records": len(group), "warmup_excluded": len(warm), "offered_after_warmup": n,
              **{s: status.get(s, 0) for s in STATUSES},
              "meeting_limits": n_good,
              "missed_limit": {k: limit_counts.get(k, 0) for k in c.limits()},
              "tpot_not_applicable": sum(1 for m in ok if m.record.output_tokens < c.output_tokens_minimum_for_tpot)}
    tpot_samples = [m.tpot_ms for m in ok
                    if m.tpot_ms is not None and m.record.output_tokens >= c.output_tokens_minimum_for_tpot]
    latency = {
        "ttft": summarize([m.ttft_ms for m in ok]),
        "tpot": summarize(tpot_samples),
        "itl_per_chunk": summarize([g for m in ok for g in m.itls_ms]),
        "max_itl_per_request": summarize([m.max_itl_ms for m in ok if m.max_itl_ms is not None]),
        "e2e": summarize([m.e2e_ms for m in ok]),
    }
    of_ok, of_all = _pct(n_good, n_ok), _pct(n_good, n)
    declared = of_all if c.denominator == "all_offered_after_warmup" else of_ok
    attainment = {"numerator": c.numerator, "numerator_count": n_good,
                  "successful_count": n_ok, "offered_after_warmup_count": n,
                  "of_successful_pct": of_ok, "of_all_offered_pct": of_all,
                  "declared_denominator": c.denominator, "declared_pct": declared,
                  "min_pct": None if c.slo_attainment_min is None else 100.0 * c.slo_attainment_min}
    error_rate = _pct(n - n_ok, n)

    gates = []
    if c.slo_attainment_min is None:
        gates.append(Gate("attainment", None, declared, None, "no minimum declared"))
    else:
        den = n_ok if c.denominator == "successful" else n
        passed = bool(den) and n_good >= c.slo_attainment_min * den - 1e-9
        gates.append(Gate("attainment", passed, declared, 100.0 * c.slo_attainment_min,
                          f"{n_good} of {den} {c.denominator} = {declared:.1f}% vs minimum "
                          f"{100 * c.slo_attainment_min:g}%" if den else "no requests in the denominator"))
    if c.error_rate_max is None:
        gates.append(Gate("error_rate", None, error_rate, None, "no maximum declared"))
    else:
        passed = error_rate is not None and n - n_ok <= c.error_rate_max * n + 1e-9
        gates.append(Gate("error_rate", passed, error_rate, 100.0 * c.error_rate_max,
                          f"{n - n_ok} of {n} not ok (error {status.get('error', 0)}, rejected "
                          f"{status.get('rejected', 0)}, timeout {status.get('timeout', 0)}) = "
                          f"{error_rate:.1f}% vs maximum {100 * c.error_rate_max:g}%"
                          if n else "no requests after warm-up"))
    queue, qgate = _queue(ordered, measured, c)
    gates.append(qgate)
    if lag is None:
        sent = client["send_rate_rps"]
        gates.append(Gate("client_send_lag", None, None, c.send_lag_p99_max_ms,
                          "not evaluated: records carry no scheduled_send_ms (client sent "
                          f"{'-' if sent is None else f'{sent:.3f}'} rps for {rate:g} offered)"))
    else:
        p99 = lag["p99_ms"]
        gates.append(Gate("client_send_lag", p99 <= c.send_lag_p99_max_ms, p99, c.send_lag_p99_max_ms,
                          f"P99 send lag {p99:.2f} ms vs maximum {c.send_lag_p99_max_ms:g} ms "
                          "(a client behind its schedule did not offer the rate it claims)"))
    return GroupReport(dep, rate, counts, client, window, throughput, latency, attainment,
                       error_rate, queue, gates, group[0].cache_state)


def group_records(records: Sequence[RequestRecord]) -> dict[tuple[str, str, float], list[RequestRecord]]:
    """One group per (cache state, deployment, offered rate); no state sorts as ''."""
    groups: dict[tuple[str, str, float], list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[(r.cache_state or "", r.deployment, r.offered_rate_rps)].append(r)
    return dict(sorted(groups.items()))


@dataclass
class Capacity:
    """SLO-compliant capacity of one deployment over its tested rates."""

    deployment: str
    tested_rates_rps: list[float]
    capacity_rps: float | None  # highest rate with every lower tested rate also passing
    first_failing_rate_rps: float | None
    first_failing_gates: list[str]
    highest_passing_rate_rps: float | None  # ignores failures below it; see the note in text
    passed_above_first_failure_rps: list[float]
    status: str  # "bounded", "not_reached" (every rate passed), "below_lowest" (the lowest failed)
    text: str = ""
    cache_state: str | None = None


def capacity_for(deployment: str, reports: Sequence[GroupReport], cache_state: str | None = None) -> Capacity:
    name = deployment if cache_state is None else f"{deployment} [{cache_state}]"
    reports = sorted(reports, key=lambda g: g.offered_rate_rps)
    cap, first = None, None
    for g in reports:
        if first is None and g.passed:
            cap = g.offered_rate_rps
        elif first is None:
            first = g
    above = [g.offered_rate_rps for g in reports
             if first is not None and g.offered_rate_rps > first.offered_rate_rps and g.passed]
    rates = [g.offered_rate_rps for g in reports]
    if first is None:
        status = "not_reached"
        text = f"{name}: passes every tested rate up to {cap:g} rps (capacity not reached; test higher rates)"
    elif cap is None:
        status = "below_lowest"
        text = (f"{name}: fails already at the lowest tested rate {first.offered_rate_rps:g} rps "
                f"({', '.join(first.failed_gates)})")
    else:
        status = "bounded"
        text = (f"{name}: SLO-compliant capacity {cap:g} rps; first failing rate "
                f"{first.offered_rate_rps:g} rps ({', '.join(first.failed_gates)})")
    if above:
        text += (f"; note: {', '.join(f'{r:g}' for r in above)} rps passed above the first failure, "
                 "so the sweep is not monotonic (re-test before trusting it)")
    highest = max((g.offered_rate_rps for g in reports if g.passed), default=None)
    return Capacity(deployment, rates, cap, first.offered_rate_rps if first else None,
                    first.failed_gates if first else [], highest, above, status, text, cache_state)


def verdict(caps: Sequence[Capacity], budget_note: str) -> dict:
    """Which deployment serves more SLO-compliant traffic, said only as far as the sweep shows."""
    if len(caps) < 2:
        return {"winner": None, "text": "one deployment: nothing to compare"}

    def proven(c: Capacity) -> float:
        return c.capacity_rps or 0.0

    ranked = sorted(caps, key=proven, reverse=True)
    best, others = ranked[0], ranked[1:]
    # best wins over o only if best's proven capacity reaches a rate where o failed
    beats = all(o.first_failing_rate_rps is not None and proven(best) >= o.first_failing_rate_rps
                for o in others)
    names = {c.deployment for c in caps}
    pd = names == {"aggregated", "disaggregated"}
    if beats:
        second = others[0]
        ratio = (f" ({proven(best) / proven(second):.2f}x)" if proven(second) > 0 else "")
        text = (f"{best.deployment} wins: SLO-compliant capacity {proven(best):g} rps vs "
                f"{second.deployment} {proven(second):g} rps{ratio}, {budget_note}")
        if pd:
            text += ("; disaggregation pays for this workload" if best.deployment == "disaggregated"
                     else "; disaggregation does not pay for this workload: keep aggregated")
        return {"winner": best.deployment, "text": text}
    open_ended = [c.deployment for c in caps if c.status == "not_reached"]
    if open_ended:
        return {"winner": None, "text": (f"inconclusive: {', '.join(open_ended)} passed every tested "
                                        f"rate ({budget_note}); extend the sweep to higher rates")}
    text = (f"tie at the tested rates: {', '.join(f'{c.deployment} {proven(c):g} rps' for c in ranked)}, "
            f"{budget_note}")
    if pd:
        text += "; no capacity gain from disaggregation: keep the simpler aggregated deployment"
    return {"winner": None, "text": text}


def analyze(records: Sequence[RequestRecord], c: Criteria, budget_note: str) -> dict:
    """The whole report: groups, capacity per deployment (and cache state), verdict, method."""
    reports = [analyze_group(g, c) for g in group_records(records).values()]
    by_state: dict[str | None, dict[str, list[GroupReport]]] = defaultdict(lambda: defaultdict(list))
    for g in reports:
        by_state[g.cache_state][g.deployment].append(g)
    caps, verdicts = [], []
    for state, by_dep in by_state.items():
        state_caps = [capacity_for(d, gs, state) for d, gs in by_dep.items()]
        caps += state_caps
        verdicts.append({"cache_state": state, **verdict(state_caps, budget_note)})
    counted = sum(g.counts["warmup_excluded"] + g.counts["offered_after_warmup"] for g in reports)
    assert counted == len(records), "every record must be counted exactly once"
    return {
        "records_total": len(records),
        "groups": [g.to_json() for g in reports],
        "capacity": [asdict(cap) for cap in caps],
        "verdict": _overall(verdicts),
        "verdicts": verdicts,
        "method": method_notes(c),
    }


def _overall(verdicts: list[dict]) -> dict:
    """One verdict; with several cache states, a winner only when every state agrees."""
    if len(verdicts) == 1:
        return verdicts[0]
    winners = {v["winner"] for v in verdicts}
    return {"cache_state": None, "winner": winners.pop() if len(winners) == 1 else None,
            "text": "; ".join(f"[{v['cache_state']}] {v['text']}" for v in verdicts)}


def method_notes(c: Criteria) -> dict:
    return {
        "percentiles": PERCENTILE_METHOD,
        "ttft": "first chunk minus actual send, successful requests",
        "tpot": (f"(last chunk - first chunk) / (output_tokens - 1), successful requests with "
                 f">= {c.output_tokens_minimum_for_tpot} output tokens (vLLM TPOT = AIPerf inter_token_latency)"),
        "itl_per_chunk": "gap between successive chunks, pooled over all chunk gaps (vLLM ITL = AIPerf inter_chunk_latency)",
        "max_itl_per_request": "largest chunk gap of each successful request",
        "attainment": (f"numerator {c.numerator}: {NUMERATORS[c.numerator]}; shown of successful and of "
                       f"all offered after warm-up; gate uses {c.denominator}"),
        "error_rate": "(error + rejected + timeout) / offered after warm-up",
        "window": "declared duration from the first measured send" if c.duration_s is not None
                  else "first measured send to the last measured finish",
        "goodput": "requests meeting the limits that finished inside the window / window_s",
        "queue_stability": (f"achieved >= {ACHIEVED_MIN_FRACTION} x offered, both over the span of measured sends "
                            "(completions counted in that span shifted by the median latency), "
                            f"and neither median TTFT nor mean in-flight requests rises by more than "
                            f"{TREND_RATIO_MAX}x (and {TREND_MIN_TTFT_MS:g} ms / {TREND_MIN_IN_FLIGHT:g} request) "
                            "from the first to the last third of requests in send order"),
        "capacity": ("highest tested rate with it and every lower tested rate passing every gate "
                     "(a pass above a failure is reported, not trusted)"),
        "units": "times in ms, rates in requests/s, *_pct in percent (0-100), plan fractions 0-1",
    }

