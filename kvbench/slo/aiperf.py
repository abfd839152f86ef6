"""Convert AIPerf 0.13 `profile_export.jsonl` (per-request records) into kvbench request records.

What AIPerf writes per request (one JSON object a line, `--export-level records` or `raw`;
sources cited in docs/slo.md section 3):
    metadata.request_start_ns   time.time_ns() when the request was sent (wall clock)
    metadata.credit_issued_ns   time.time_ns() when the rate limiter released it (the schedule)
    metadata.request_end_ns     time.time_ns() at the end of the response, or of the error
    metadata.benchmark_phase    "warmup" or "profiling" (AIPerf's statistics use profiling only)
    metrics.time_to_first_token {value, unit "ms"}: first content chunk - start (perf clock)
    metrics.inter_chunk_latency {value: [gaps], unit "ms"}: between successive content chunks
    metrics.usage_completion_tokens  the server's count; output_sequence_length: AIPerf's own
                                     re-tokenisation of the text (may differ)
    error {code, type, message}; metadata.was_cancelled for a request AIPerf itself cancelled
"""

from __future__ import annotations

from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.requests import RequestIds, RequestRecord, parse_record, record_to_json
from kvbench.records.schema.clients import AiperfLine, AiperfList, AiperfScalar, AiperfSummary
from kvbench.records.schema.read import MiB, iter_jsonl, load_json
from kvbench.records.schema.types import parse
from kvbench.slo.vllm import classify_error

RECORDS_FILE = "profile_export.jsonl"
SUMMARY_FILE = "profile_export_aiperf.json"
_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}
_TOKEN_UNITS = ("tokens",)


def records_path(path: str | Path) -> Path:
    """The records file: PATH itself, or PATH/profile_export.jsonl for an artifact folder."""
    p = Path(path)
    if p.is_dir():
        p = p / RECORDS_FILE
        if not p.exists():
            raise UsageError(f"{path}: no {RECORDS_FILE} in this folder: run aiperf profile with "
                             "--export-level records (the default) or raw")
    return p


def _to_ms(unit: str, where: str, key: str) -> float:
    """Milliseconds per unit of a time metric (AIPerf writes ms; any time unit is honoured)."""
    factor = _TO_MS.get(unit)
    if factor is None:
        raise UsageError(f"{where}: metrics.{key}.unit: expected a time unit (ns, us, ms, s), got {unit!r}")
    return factor


def _metric(line: AiperfLine, key: str, model, where: str):
    raw = line.metrics.get(key)
    return None if raw is None else parse(model, raw, where, prefix=f"metrics.{key}")


def _tokens(line: AiperfLine, key: str, where: str) -> int | None:
    m = _metric(line, key, AiperfScalar, where)
    if m is None:
        return None
    if m.unit not in _TOKEN_UNITS or m.value != int(m.value) or m.value > 1e9:
        raise UsageError(f"{where}: metrics.{key}: expected a whole number of tokens, got "
                         f"{m.value!r} {m.unit}")
    return int(m.value)


def offered_rate(jsonl: Path, given: float | None) -> float:
    """--offered-rate, else the profiling phase's request rate from profile_export_aiperf.json."""
    summary = jsonl.with_name(SUMMARY_FILE)
    file_rate = None
    if summary.exists():
        doc = parse(AiperfSummary, load_json(summary, 64 * MiB, "AIPerf summary"), str(summary))
        phases = [ph for ph in (doc.input_config.phases if doc.input_config else []) if ph.kind != "warmup"]
        file_rate = phases[0].rate if len(phases) == 1 else None
    if given is not None:
        if file_rate is not None and abs(file_rate - given) > 1e-9 * max(1.0, given):
            raise UsageError(f"--offered-rate {given:g} differs from the request rate {file_rate:g} "
                             f"in {summary}")
        return given
    if file_rate is None:
        raise UsageError(f"{jsonl}: no single request rate found (in {summary.name} beside it); "
                         "an open-loop SLO analysis needs one: pass --offered-rate RPS")
    return file_rate


def _status(line: AiperfLine) -> tuple[str, str]:
    err = line.error
    text = " ".join(str(x) for x in (err.code, err.type, err.message) if x not in (None, ""))
    if line.metadata.was_cancelled or err.code == 499:
        return "error", f"cancelled by the client (AIPerf): {text}"
    typ = (err.type or "").lower()
    status = "timeout" if "timeout" in typ else classify_error(text or "error")
    return status, text or "error (no details)"


def _record(line: AiperfLine, where: str, common: dict, origin_ns: int) -> RequestRecord:
    md = line.metadata
    send = round((md.request_start_ns - origin_ns) / 1e6, 6)
    sched = None if md.credit_issued_ns is None else round((md.credit_issued_ns - origin_ns) / 1e6, 6)
    end = round((md.request_end_ns - origin_ns) / 1e6, 6)
    out = _tokens(line, "usage_completion_tokens", where)
    if out is None:
        out = _tokens(line, "output_sequence_length", where)
    if line.error is not None:
        status, err = _status(line)
        return RequestRecord(**common, actual_send_ms=send, scheduled_send_ms=sched, status=status,
                             output_tokens=out or 0, end_ms=max(end, send), error=err)
    ttft = _metric(line, "time_to_first_token", AiperfScalar, where)
    if ttft is None or not out:
        return RequestRecord(**common, actual_send_ms=send, scheduled_send_ms=sched, status="error",
                             output_tokens=0, end_ms=max(end, send),
                             error="no first token and no error (AIPerf recorded no time_to_first_token)")
    gaps = _metric(line, "inter_chunk_latency", AiperfList, where)
    t = send + ttft.value * _to_ms(ttft.unit, where, "time_to_first_token")
    chunks = [t]
    if gaps is not None:
        factor = _to_ms(gaps.unit, where, "inter_chunk_latency")
        for g in gaps.value:
            t += g * factor
            chunks.append(t)
    chunks = [round(c, 6) for c in chunks]
    counts = (1,) * len(chunks) if len(chunks) == out else None  # one token per chunk, as vLLM streams
    return RequestRecord(**common, actual_send_ms=send, scheduled_send_ms=sched, status="ok",
                         output_tokens=out, chunk_times_ms=tuple(chunks), chunk_tokens=counts,
                         end_ms=max(end, chunks[-1]))


def request_id(md) -> str:
    """AIPerf's x_request_id (a fresh UUID per request), else its session and turn: the turns
    of one multi-turn session are different requests."""
    return md.x_request_id or f"session {md.session_num} turn {md.turn_index or 0}"


def _lines(p: Path) -> list[tuple[str, AiperfLine]]:
    out = []
    for where, raw in iter_jsonl(p, "AIPerf records file", missing="no such file"):
        if not isinstance(raw, dict):
            raise UsageError(f"{where}: expected a JSON object (one AIPerf record)")
        out.append((where, parse(AiperfLine, raw, where)))
    if not out:
        raise UsageError(f"{p}: no records")
    return out


def convert_aiperf(path: str | Path, deployment: str, offered_rate_rps: float | None = None,
                   index: int | None = None) -> tuple[list[dict], list[str]]:
    """Records (as JSON objects) for every profiling request of an AIPerf run, plus notes."""
    if index is not None:
        raise UsageError("--index selects a result of a vLLM --append-result file; AIPerf has one run per folder")
    p = records_path(path)
    lines = _lines(p)
    rate = offered_rate(p, offered_rate_rps)
    measured = [(w, ln) for w, ln in lines if ln.metadata.benchmark_phase != "warmup"]
    notes = []
    if len(measured) < len(lines):
        notes.append(f"{len(lines) - len(measured)} AIPerf warm-up requests left out (AIPerf's own "
                     "statistics leave them out too)")
    if not measured:
        raise UsageError(f"{p}: only warm-up records, no profiling phase")
    origin = min(min(ln.metadata.request_start_ns, ln.metadata.credit_issued_ns or ln.metadata.request_start_ns)
                 for _, ln in measured)  # the first release or send: every time >= 0
    rows, ids = [], RequestIds()
    for where, ln in measured:
        rid = request_id(ln.metadata)
        isl = _tokens(ln, "usage_prompt_tokens", where)
        common = dict(request_id=rid, deployment=deployment, offered_rate_rps=rate,
                      input_tokens=isl if isl is not None else _tokens(ln, "input_sequence_length", where))
        rec = _record(ln, where, common, origin)
        row = record_to_json(rec, {"source": "aiperf profile", "file": p.name, "line": where.rsplit(":", 1)[1]})
        parse_record(row, where)
        ids.check(rec, where)
        rows.append(row)
    return rows, notes
