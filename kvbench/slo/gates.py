"""From request records to gates: attainment, error rate, queue stability, capacity, verdict.

One group is one deployment at one offered rate. Every record of a group is counted in
exactly one place: warm-up excluded, or measured with its status (ok, error, rejected,
timeout). Attainment is always shown two ways, of successful requests and of all requests
offered after warm-up, and the gate uses the denominator the user declared.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvbench.errors import UsageError
from kvbench.records.request_metrics import PERCENTILE_METHOD, RequestMetrics, summarize
from kvbench.records.requests import STATUSES, RequestRecord
from kvbench.slo.runs import OK, Run, to_runs

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
    if "max_itl" in lim and ((m.max_itl_ms is not None and m.max_itl_ms > lim["max_itl"])
                             or not m.record.chunk_gaps_recorded):  # unknown: not met (fail closed)
        fails.append("max_itl")
    if "deadline" in lim and m.e2e_ms > lim["deadline"]:
        fails.append("deadline")
    return fails


def _limit_misses(a: dict, ok: np.ndarray, c: Criteria) -> dict[str, np.ndarray]:
    """Per declared limit, which requests miss it (request_failures, for whole columns at once)."""
    lim = c.limits()
    out = {}
    if "ttft" in lim:
        out["ttft"] = ok & (a["ttft"] > lim["ttft"])
    if "tpot" in lim:
        out["tpot"] = ok & (a["tokens"] >= c.output_tokens_minimum_for_tpot) & (a["tpot"] > lim["tpot"])
    if "max_itl" in lim:
        out["max_itl"] = ok & ((a["max_itl"] > lim["max_itl"]) | (a["gaps_unknown"] != 0))  # fail closed
    if "deadline" in lim:
        out["deadline"] = ok & (a["e2e"] > lim["deadline"])
    return out  # NaN compares False: an undefined value never misses a limit (unrecorded gaps excepted)


def _in_flight_at_sends(send: np.ndarray, finish: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Requests sent before t and not finished by t, for each t (the request itself excluded)."""
    sends, ends = np.sort(send), np.sort(finish)
    zero = np.sort(send[finish == send])  # requests over at the instant they were sent
    started = np.searchsorted(sends, at, side="left")
    finished = np.searchsorted(ends, at, side="right") - (
        np.searchsorted(zero, at, side="right") - np.searchsorted(zero, at, side="left"))
    return np.maximum(started - finished, 0)


def _thirds(values: Sequence) -> tuple:
    k = len(values) // 3
    return values[:k], values[len(values) - k:]


def _keeping_up(send: np.ndarray, finish: np.ndarray) -> dict:
    """Completions per second against sends per second over the same stretch of the run.

    Sends are counted over [first send, last send]; completions (any terminal status) over
    the same window shifted by the median latency, so a stable queue reads ~1.0 whatever its
    latency, one slow straggler moves it by one request, and a growing backlog reads < 1.
    """
    sends = np.sort(send)
    if len(sends) < MIN_REQUESTS_FOR_TREND or sends[-1] <= sends[0]:
        return {"offered_actual_rps": None, "achieved_rps": None, "achieved_over_offered": None,
                "latency_shift_ms": None}
    span_s = float(sends[-1] - sends[0]) / 1000.0
    shift = float(np.median(finish - send))
    lo, hi = sends[0] + shift, sends[-1] + shift
    done = int(np.count_nonzero((finish >= lo) & (finish <= hi)))
    offered, achieved = (len(sends) - 1) / span_s, (done - 1) / span_s if done else 0.0
    return {"offered_actual_rps": offered, "achieved_rps": achieved,
            "achieved_over_offered": achieved / offered, "latency_shift_ms": shift}


def _trends(a: dict, meas: np.ndarray, out: dict) -> None:
    """TTFT medians and mean in-flight requests, first vs last third of the measured sends."""
    first, last = _thirds(meas)
    f_ttft, l_ttft = a["ttft"][first], a["ttft"][last]
    f_ttft, l_ttft = f_ttft[~np.isnan(f_ttft)], l_ttft[~np.isnan(l_ttft)]
    if len(f_ttft) and len(l_ttft):
        x, y = float(np.median(f_ttft)), float(np.median(l_ttft))
        out["ttft_median_first_third_ms"], out["ttft_median_last_third_ms"] = x, y
        if y > x * TREND_RATIO_MAX and y - x > TREND_MIN_TTFT_MS:
            out["reasons"].append(f"TTFT median rose {x:.1f} -> {y:.1f} ms from the first to the last third")
    flight = _in_flight_at_sends(a["send"], a["finish"], a["send"][meas])
    fa, fb = _thirds(flight)
    x, y = float(np.mean(fa)), float(np.mean(fb))
    out["in_flight_mean_first_third"], out["in_flight_mean_last_third"] = x, y
    if y > x * TREND_RATIO_MAX and y - x > TREND_MIN_IN_FLIGHT:
        out["reasons"].append(f"in-flight requests rose {x:.1f} -> {y:.1f} from the first to the last third")


def _queue(a: dict, meas: np.ndarray, c: Criteria) -> tuple[dict, Gate]:
    n = len(meas)
    out: dict = {**_keeping_up(a["send"][meas], a["finish"][meas]),
                 "ttft_median_first_third_ms": None, "ttft_median_last_third_ms": None,
                 "in_flight_mean_first_third": None, "in_flight_mean_last_third": None,
                 "growing": None, "reasons": []}
    if n >= MIN_REQUESTS_FOR_TREND:
        _trends(a, meas, out)
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


def _window(a: dict, meas: np.ndarray, c: Criteria) -> tuple[dict, np.ndarray]:
    """The measurement window (declared duration from the first measured send, else observed)
    and which requests finished inside it."""
    inside = np.zeros(len(a["send"]), dtype=bool)
    if not len(meas):
        return {"window_s": None, "source": "declared" if c.duration_s is not None else "observed",
                "finished_after_window": 0, "sent_after_window": 0}, inside
    t0 = float(a["send"][meas].min())
    t1 = t0 + c.duration_s * 1000.0 if c.duration_s is not None else float(a["finish"][meas].max())
    inside[meas] = a["finish"][meas] <= t1
    return {"window_s": (t1 - t0) / 1000.0 if t1 > t0 else None,
            "source": "declared" if c.duration_s is not None else "observed",
            "finished_after_window": int(np.count_nonzero(a["finish"][meas] > t1)),
            "sent_after_window": int(np.count_nonzero(a["send"][meas] > t1))}, inside


def _client(a: dict, meas: np.ndarray) -> tuple[dict, dict | None]:
    sends = np.sort(a["send"][meas])
    lags = a["send"][meas] - a["sched"][meas]
    lag = summarize(lags) if len(meas) and not np.isnan(lags).any() else None
    rate = (float((len(sends) - 1) / ((sends[-1] - sends[0]) / 1000.0))
            if len(sends) >= 2 and sends[-1] > sends[0] else None)
    return {"send_rate_rps": rate, "scheduled_send_known": lag is not None, "send_lag_ms": lag}, lag


def _latency(a: dict, ok: np.ndarray, c: Criteria) -> dict:
    gaps = a["gaps"][np.repeat(ok, a["n_gaps"])] if len(a["gaps"]) else a["gaps"]
    tpot_ok = ok & (a["tokens"] >= c.output_tokens_minimum_for_tpot) & ~np.isnan(a["tpot"])
    return {"ttft": summarize(a["ttft"][ok]), "tpot": summarize(a["tpot"][tpot_ok]),
            "itl_per_chunk": summarize(gaps),
            "max_itl_per_request": summarize(a["max_itl"][ok & ~np.isnan(a["max_itl"])]),
            "e2e": summarize(a["e2e"][ok])}


def _gates(n: int, n_ok: int, n_good: int, status: Counter, c: Criteria) -> tuple[list[Gate], dict, float | None]:
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
    return gates, attainment, error_rate


def _lag_gate(lag: dict | None, client: dict, rate: float, c: Criteria) -> Gate:
    if lag is None:
        sent = client["send_rate_rps"]
        return Gate("client_send_lag", None, None, c.send_lag_p99_max_ms,
                    "not evaluated: records carry no scheduled_send_ms (client sent "
                    f"{'-' if sent is None else f'{sent:.3f}'} rps for {rate:g} offered)")
    p99 = lag["p99_ms"]
    return Gate("client_send_lag", p99 <= c.send_lag_p99_max_ms, p99, c.send_lag_p99_max_ms,
                f"P99 send lag {p99:.2f} ms vs maximum {c.send_lag_p99_max_ms:g} ms "
                "(a client behind its schedule did not offer the rate it claims)")


def analyze_group(group: Run | Sequence[RequestRecord], c: Criteria) -> GroupReport:
    """Every number for one deployment at one offered rate."""
    run = group if isinstance(group, Run) else to_runs(group)[0][0]
    a = run.arrays()
    send_order = np.where(np.isnan(a["sched"]), a["send"], a["sched"])
    meas = np.argsort(send_order, kind="stable")[c.warmup_requests:]  # file order breaks ties
    measured = np.zeros(len(run), dtype=bool)
    measured[meas] = True
    ok = measured & (a["status"] == OK)
    misses = _limit_misses(a, ok, c)
    good = ok & ~np.logical_or.reduce([*misses.values(), np.zeros(len(run), dtype=bool)])
    n, n_ok, n_good = len(meas), int(ok.sum()), int(good.sum())
    status = Counter({s: int(np.count_nonzero(measured & (a["status"] == i))) for i, s in enumerate(STATUSES)})
    window, inside = _window(a, meas, c)

    def per_s(count: float) -> float | None:
        return count / window["window_s"] if window["window_s"] else None

    ok_in = inside & ok
    throughput = {"throughput_rps": per_s(int(ok_in.sum())),
                  "output_tokens_per_s": per_s(int(a["tokens"][ok_in].sum())),
                  "goodput_rps": per_s(int((ok_in & good).sum()))}
    client, lag = _client(a, meas)
    counts = {"records": len(run), "warmup_excluded": len(run) - n, "offered_after_warmup": n,
              **{s: status.get(s, 0) for s in STATUSES}, "meeting_limits": n_good,
              "missed_limit": {k: int(v.sum()) for k, v in misses.items()},
              "tpot_not_applicable": int((ok & (a["tokens"] < c.output_tokens_minimum_for_tpot)).sum()),
              "chunk_gaps_unrecorded": int((ok & (a["gaps_unknown"] != 0)).sum())}
    gates, attainment, error_rate = _gates(n, n_ok, n_good, status, c)
    queue, qgate = _queue(a, meas, c)
    gates += [qgate, _lag_gate(lag, client, run.offered_rate_rps, c)]
    return GroupReport(run.deployment, run.offered_rate_rps, counts, client, window, throughput,
                       _latency(a, ok, c), attainment, error_rate, queue, gates, run.cache_state)


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


def analyze(records: Iterable[RequestRecord], c: Criteria, budget_note: str) -> dict:
    """The whole report: groups, capacity per deployment (and cache state), verdict, method.

    records may be a stream (kvbench.slo.records.iter_records): each is folded into its
    run's columns as it arrives, so memory follows the runs' numbers, not the file's text.
    """
    runs, n_records = to_runs(records)
    reports = [analyze_group(run, c) for run in runs]
    by_state: dict[str | None, dict[str, list[GroupReport]]] = defaultdict(lambda: defaultdict(list))
    for g in reports:
        by_state[g.cache_state][g.deployment].append(g)
    caps, verdicts = [], []
    for state, by_dep in by_state.items():
        state_caps = [capacity_for(d, gs, state) for d, gs in by_dep.items()]
        caps += state_caps
        verdicts.append({"cache_state": state, **verdict(state_caps, budget_note)})
    counted = sum(g.counts["warmup_excluded"] + g.counts["offered_after_warmup"] for g in reports)
    assert counted == n_records, "every record must be counted exactly once"
    return {
        "records_total": n_records,
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
        "max_itl_per_request": "largest chunk gap of each successful request (a request whose client "
                               "kept no chunk gaps, e.g. GuideLLM, misses a declared max ITL limit: "
                               "fail closed)",
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

