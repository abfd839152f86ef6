"""Convert GuideLLM 0.8 `benchmarks.json` (`guidellm run --output kind=json`) into kvbench records.

What GuideLLM keeps per request (benchmarks[i].requests.successful|errored|incomplete, each a
GenerativeRequestStats; sources cited in docs/slo.md section 3), times in epoch seconds
(time.time()):
    info.timings.targeted_start         when the rate profile meant to send it (the schedule;
                                        a value that is no Unix time near the send, as 0.8.1
                                        has written, is an unknown schedule, with a note)
    info.timings.request_start          when the backend sent it
    info.timings.first_token_iteration  the first streamed token
    info.timings.last_token_iteration   the last streamed token
    info.timings.token_iterations       how many streamed chunks carried tokens
    info.timings.request_end            the end of the response
    output_tokens                       the server's usage count (else one per chunk)
    info.error                          the error text of an errored request
It keeps no time for the chunks between the first and the last ("we don't have
per-iteration timings", request_stats.py), so the records carry those two only
(chunk_gaps_recorded false): TTFT, TPOT and E2E are exact, chunk gaps unknown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.requests import RequestIds, RequestRecord, parse_record, record_to_json
from kvbench.records.schema.clients import GuidellmBenchmark, GuidellmReport, GuidellmRequest
from kvbench.records.schema.read import MiB, load_json
from kvbench.records.schema.types import parse
from kvbench.slo.vllm import classify_error

MAX_GUIDELLM_BYTES = 1024 * MiB  # every request's prompt and output text is in the file
_OPEN_LOOP = ("poisson", "constant", "async")


def load_report(path: str | Path) -> GuidellmReport:
    p = Path(path)
    if p.is_dir():
        p = p / "benchmarks.json"
    doc = load_json(p, MAX_GUIDELLM_BYTES, "GuideLLM report", missing="no such file")
    if not isinstance(doc, dict):
        raise UsageError(f"{p}: expected a JSON object (guidellm run --output kind=json)")
    return parse(GuidellmReport, doc, str(p))


def pick(report: GuidellmReport, index: int | None, p: Path) -> tuple[int, GuidellmBenchmark]:
    n = len(report.benchmarks)
    if index is None:
        if n > 1:
            names = ", ".join(f"{i}: {b.config.strategy.type_}"
                              + (f"@{b.config.strategy.rate:g}" if b.config.strategy.rate else "")
                              for i, b in enumerate(report.benchmarks))
            raise UsageError(f"{p}: holds {n} benchmarks ({names}); choose one with --index")
        index = 0
    if not 0 <= index < n:
        raise UsageError(f"--index {index} out of range 0..{n - 1}")
    return index, report.benchmarks[index]


def offered_rate(b: GuidellmBenchmark, given: float | None, notes: list[str]) -> float:
    st = b.config.strategy
    if st.type_ not in _OPEN_LOOP:
        notes.append(f"GuideLLM strategy {st.type_!r} is not open-loop at a fixed rate")
    if given is not None:
        if st.rate is not None and abs(st.rate - given) > 1e-9 * max(1.0, given):
            raise UsageError(f"--offered-rate {given:g} differs from the benchmark's rate {st.rate:g}")
        return given
    if st.rate is None:
        raise UsageError(f"GuideLLM strategy {st.type_!r} has no request rate: pass --offered-rate RPS")
    return st.rate


def _all_kept(b: GuidellmBenchmark, p: Path, notes: list[str]) -> None:
    """GuideLLM may keep a sample of each status group (sample_size); kvbench needs every request.

    Why the check is one-sided: the file's groups are every request the run resolved
    (accumulator.py get_sampled), while metrics.request_totals counts only those overlapping its
    measurement window with a known end (metrics.py, get_within_range), so the file can hold
    more than the totals; fewer, or a sample as large as its sample_size, means requests may
    have been left out."""
    got, want, size = b.requests, b.metrics.request_totals, b.config.sample_size
    for name in ("successful", "errored", "incomplete"):
        kept, made = len(getattr(got, name)), getattr(want, name)
        if kept < made or (size is not None and 0 < size <= kept):  # a full reservoir may have dropped some
            raise UsageError(f"{p}: {name}: {kept} requests kept of {made} made (sample_size "
                             f"{size}): rerun without a sample size so that every request is in "
                             "the file")
        if kept > made:
            notes.append(f"GuideLLM's totals count {made} {name} requests (its measurement window) "
                         f"and its file holds {kept}: kvbench converts all {kept}")


@dataclass(frozen=True)
class Shortfall:
    """Requests GuideLLM's scheduler created that its file holds no record of.

    Why: GuideLLM 0.8.1 can end a benchmark (its max_requests constraint met) while a request
    is still processing; that request is in none of the file's groups (successful, errored,
    incomplete), so a run of 12 prompts converts to 11 records. kvbench cannot make a record
    it was not given, so it names the gap from the scheduler's own counts instead of leaving
    a reader to notice that the count is short."""

    created: int
    in_file: int
    processing: int
    queued: int  # queued or pending: created, not yet sent
    cancelled: int

    @property
    def missing(self) -> int:
        return self.created - self.in_file

    @property
    def unplaced(self) -> int:
        """Missing requests the scheduler's counts do not place anywhere."""
        return max(0, self.missing - self.processing - self.queued - self.cancelled)

    def line(self) -> str:
        where = [f"{n} {what}" for n, what in ((self.processing, "still processing"),
                                              (self.queued, "queued or pending"),
                                              (self.cancelled, "cancelled"),
                                              (self.unplaced, "not placed by its counts")) if n]
        return (f"GuideLLM created {self.created} requests and its file holds {self.in_file}: "
                f"{self.missing} missing ({', '.join(where)} when it ended the benchmark); "
                "kvbench has no record of them, so this run's counts and latencies rest on "
                f"{self.in_file} of {self.created}")

    def as_dict(self) -> dict:
        return {**asdict(self), "missing": self.missing, "line": self.line()}


def shortfall(b: GuidellmBenchmark) -> Shortfall | None:
    """The benchmark's Shortfall from its scheduler_state, or None when every created request
    is in the file (or the file has no scheduler state to tell)."""
    st = b.scheduler_state
    in_file = len(b.requests.successful) + len(b.requests.errored) + len(b.requests.incomplete)
    if st is None or st.created_requests is None or st.created_requests <= in_file:
        return None
    return Shortfall(st.created_requests, in_file, st.processing_requests or 0,
                     (st.queued_requests or 0) + (st.pending_requests or 0),
                     st.cancelled_requests or 0)


def client_shortfall(path: str | Path, index: int | None = None) -> dict | None:
    """shortfall() of a benchmarks.json as a dict (kvbench lab sweep's run.json), None if none."""
    p = Path(path)
    found = shortfall(pick(load_report(p), index, p)[1])
    return None if found is None else found.as_dict()


def _record(r: GuidellmRequest, group: str, common: dict, origin: float, where: str) -> RequestRecord:
    t = r.info.timings

    def ms(x: float) -> float:
        return round((x - origin) * 1000.0, 6)

    target = _target(t)
    sent = next((x for x in (t.request_start, t.resolve_start, target) if x is not None), None)
    if sent is None:
        raise UsageError(f"{where}.info.timings: no send time (request_start, resolve_start, "
                         "targeted_start)")
    send = ms(sent)
    sched = None if target is None else ms(target)
    end_s = t.request_end if t.request_end is not None else t.resolve_end
    end = None if end_s is None else max(ms(end_s), send)
    base = dict(**common, request_id=r.request_id, actual_send_ms=send, scheduled_send_ms=sched, end_ms=end)
    out = r.output_tokens or 0
    if group == "errored":
        text = r.info.error or "errored (no message)"
        return RequestRecord(**base, status=classify_error(text), output_tokens=out, error=text)
    if group == "incomplete":
        return RequestRecord(**base, status="timeout", output_tokens=out,
                             error="incomplete: still running when GuideLLM ended the benchmark (cancelled)")
    if t.first_token_iteration is None or out < 1:
        return RequestRecord(**base, status="error", output_tokens=0,
                             error="successful in GuideLLM, but no first token or no output tokens")
    first, last = ms(t.first_token_iteration), ms(t.last_token_iteration or t.first_token_iteration)
    chunks = (first,) if t.token_iterations <= 1 or last == first else (first, last)
    whole = t.token_iterations == len(chunks)  # every chunk's time is known
    counts = (out,) if len(chunks) == 1 and whole else None
    return RequestRecord(**{**base, "end_ms": None if end is None else max(end, chunks[-1])}, status="ok",
                         output_tokens=out, chunk_times_ms=chunks, chunk_tokens=counts,
                         chunk_gaps_recorded=whole or len(chunks) == 1)


def convert_guidellm(path: str | Path, deployment: str, offered_rate_rps: float | None = None,
                     index: int | None = None) -> tuple[list[dict], list[str]]:
    """Records (as JSON objects) for every request of one benchmark of a GuideLLM report."""
    p = Path(path)
    index, b = pick(load_report(p), index, p)
    notes: list[str] = []
    _all_kept(b, p, notes)
    gap = shortfall(b)
    if gap is not None:
        notes.append(gap.line())
    rate = offered_rate(b, offered_rate_rps, notes)
    groups = [(f"{g}[{k}]", g, r) for g in ("successful", "errored", "incomplete")
              for k, r in enumerate(getattr(b.requests, g))]
    if not groups:
        raise UsageError(f"{p}: benchmark {index} holds no requests")
    _targets_kept(groups, notes)
    times = [x for _, _, r in groups for x in (_target(r.info.timings), r.info.timings.request_start,
                                            r.info.timings.resolve_start) if x is not None]
    origin = min(times) if times else 0.0
    rows, ids = [], RequestIds()
    for place, g, r in sorted(groups, key=lambda gr: _send_key(gr[2])):
        common = dict(deployment=deployment, offered_rate_rps=rate, input_tokens=r.prompt_tokens)
        where = f"{p}: benchmarks[{index}].requests.{place}"
        rec = _record(r, g, common, origin, where)
        row = record_to_json(rec, {"source": "guidellm run", "file": p.name, "benchmark": index, "group": g})
        parse_record(row, where)
        ids.check(rec, where)
        rows.append(row)
    if any(not r.get("chunk_gaps_recorded", True) for r in rows):
        notes.append("GuideLLM keeps no chunk times between the first and last token: chunk gaps "
                     "(ITL per chunk, max ITL) are unknown; a declared max ITL limit fails closed")
    return rows, notes


def _send_key(r: GuidellmRequest) -> float:
    t = r.info.timings
    return next((x for x in (_target(t), t.request_start, t.resolve_start) if x is not None), 0.0)


MAX_TARGET_GAP_S = 3600.0  # a target an hour from the request's own send is no schedule of it


def _target(t) -> float | None:
    """targeted_start where it is what GuideLLM documents, the Unix time its schedule meant the
    request to start: not negative, and within MAX_TARGET_GAP_S of the request's own send time.
    GuideLLM 0.8.1 has written -0.07 s beside Unix-time request_start values (a real lab run):
    such a request's schedule is unknown (None), never an origin 56 years back."""
    x = t.targeted_start
    sent = t.request_start if t.request_start is not None else t.resolve_start
    if x is None or x < 0 or sent is not None and abs(x - sent) > MAX_TARGET_GAP_S:
        return None
    return x


def _targets_kept(groups: list, notes: list[str]) -> None:
    """A note for the targeted_start values _target leaves out (their schedule is unknown)."""
    timings = [r.info.timings for _, _, r in groups]
    bad = [t.targeted_start for t in timings if t.targeted_start is not None and _target(t) is None]
    if bad:
        notes.append(f"GuideLLM wrote {len(bad)} targeted_start value(s) that are not Unix times "
                     f"near their request's send (e.g. {bad[0]:g} s): those requests' schedule is "
                     "unknown (scheduled_send_ms null); their send time is request_start. GuideLLM "
                     "0.8.1's Poisson workers can read its shared offset before it is set and "
                     "schedule from -1.0 s: such a run sent its requests at once, not at the "
                     "offered rate (see the send rate in `slo analyze`); measure it again")
