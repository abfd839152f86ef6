"""Per-request records: the one input format of the SLO analysis, its loader, the vLLM converter.

A record is what the load generator saw for one request, nothing derived:

    {"schema": "kvbench.slo.request/1", "request_id": "r-17", "deployment": "aggregated",
     "offered_rate_rps": 4.0, "scheduled_send_ms": 4250.0, "actual_send_ms": 4250.4,
     "first_token_ms": 4561.9, "chunk_times_ms": [4561.9, 4601.2, ...],
     "chunk_tokens": [1, 1, ...], "output_tokens": 128, "status": "ok"}

Times are milliseconds on one clock per (deployment, offered rate) run; the origin is free.
Bad input is a UsageError naming FILE:LINE, so nothing is dropped or guessed silently.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvbench.cli import UsageError, read_text

SCHEMA_REQUEST = "kvbench.slo.request/1"
STATUSES = ("ok", "error", "rejected", "timeout")

_REQUIRED = ("schema", "request_id", "deployment", "offered_rate_rps", "actual_send_ms",
             "output_tokens", "status")
_OPTIONAL = ("scheduled_send_ms", "first_token_ms", "chunk_times_ms", "chunk_tokens", "end_ms",
             "input_tokens", "error", "meta", "cache_state")
_KNOWN = set(_REQUIRED) | set(_OPTIONAL)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client recorded it (times in ms on the run's clock)."""

    request_id: str
    deployment: str
    offered_rate_rps: float
    actual_send_ms: float
    status: str
    output_tokens: int
    scheduled_send_ms: float | None = None
    chunk_times_ms: tuple[float, ...] = ()  # arrival of every streamed chunk; [0] is the first token
    chunk_tokens: tuple[int, ...] | None = None  # tokens in each chunk; None when the tool lost them
    end_ms: float | None = None  # when the client saw the final outcome (defaults to the last chunk)
    input_tokens: int | None = None
    error: str | None = None
    cache_state: str | None = None  # the plan's cache state this run was made under
    where: str = ""  # FILE:LINE, for messages

    @property
    def first_token_ms(self) -> float | None:
        return self.chunk_times_ms[0] if self.chunk_times_ms else None

    @property
    def finish_ms(self) -> float:
        """When the request stopped occupying the server, as far as the client can tell."""
        if self.end_ms is not None:
            return self.end_ms
        if self.chunk_times_ms:
            return self.chunk_times_ms[-1]
        return self.actual_send_ms

    @property
    def send_order_ms(self) -> float:
        return self.scheduled_send_ms if self.scheduled_send_ms is not None else self.actual_send_ms


# ---------------------------------------------------------------------------
# field checks: each raises UsageError("WHERE: field: why")


def _number(rec: dict, key: str, where: str, *, minimum: float | None = 0.0,
            positive: bool = False, optional: bool = False) -> float | None:
    value = rec.get(key)
    if value is None:
        if optional:
            return None
        raise UsageError(f"{where}: missing {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{where}: {key} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise UsageError(f"{where}: {key} must be positive, got {value!r}")
    if minimum is not None and value < minimum:
        raise UsageError(f"{where}: negative time {key}={value!r}")
    return float(value)


def _int(rec: dict, key: str, where: str, *, minimum: int = 0, optional: bool = False) -> int | None:
    value = rec.get(key)
    if value is None:
        if optional:
            return None
        raise UsageError(f"{where}: missing {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _times(rec: dict, key: str, where: str) -> tuple[float, ...]:
    values = rec.get(key)
    if values is None:
        return ()
    if not isinstance(values, list):
        raise UsageError(f"{where}: {key} must be a list of times in ms")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UsageError(f"{where}: {key}[{i}] must be a finite number, got {v!r}")
        if v < 0:
            raise UsageError(f"{where}: negative time {key}[{i}]={v!r}")
        if out and v < out[-1]:
            raise UsageError(f"{where}: {key} is not monotonic: [{i}]={v!r} < [{i - 1}]={out[-1]!r}")
        out.append(float(v))
    return tuple(out)


def parse_record(rec: object, where: str) -> RequestRecord:
    """Check one decoded JSON value and turn it into a RequestRecord."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: expected a JSON object")
    unknown = sorted(set(rec) - _KNOWN)
    if unknown:
        raise UsageError(f"{where}: unknown field {unknown[0]!r} (put free-form data under 'meta')")
    if rec.get("schema") != SCHEMA_REQUEST:
        raise UsageError(f"{where}: schema must be {SCHEMA_REQUEST!r}, got {rec.get('schema')!r}")
    for key in _REQUIRED:
        if key not in rec:
            raise UsageError(f"{where}: missing {key}")
    rid = rec["request_id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid) == "":
        raise UsageError(f"{where}: request_id must be a non-empty string or integer")
    dep = rec["deployment"]
    if not isinstance(dep, str) or not dep.strip():
        raise UsageError(f"{where}: deployment must be a non-empty string")
    status = rec["status"]
    if status not in STATUSES:
        raise UsageError(f"{where}: unknown status {status!r} (expected {', '.join(STATUSES)})")
    rate = _number(rec, "offered_rate_rps", where, positive=True)
    send = _number(rec, "actual_send_ms", where)
    sched = _number(rec, "scheduled_send_ms", where, optional=True)
    first = _number(rec, "first_token_ms", where, optional=True)
    end = _number(rec, "end_ms", where, optional=True)
    out_tokens = _int(rec, "output_tokens", where)
    in_tokens = _int(rec, "input_tokens", where, optional=True)
    chunks = _times(rec, "chunk_times_ms", where)
    if first is not None:
        if not chunks:
            chunks = (first,)
        elif chunks[0] != first:
            raise UsageError(f"{where}: first_token_ms={first!r} differs from chunk_times_ms[0]={chunks[0]!r}")
    if chunks and chunks[0] < send:
        raise UsageError(f"{where}: first token at {chunks[0]!r} ms is before the send at {send!r} ms")
    if end is not None and (end < send or (chunks and end < chunks[-1])):
        raise UsageError(f"{where}: end_ms={end!r} is before the send or the last chunk")
    counts = rec.get("chunk_tokens")
    if counts is not None:
        if (not isinstance(counts, list) or len(counts) != len(chunks)
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)):
            raise UsageError(f"{where}: chunk_tokens must list a positive token count for each of "
                             f"the {len(chunks)} chunk_times_ms")
        if status == "ok" and sum(counts) != out_tokens:
            raise UsageError(f"{where}: chunk_tokens add up to {sum(counts)}, output_tokens is {out_tokens}")
        counts = tuple(counts)
    if status == "ok":
        if out_tokens < 1 or not chunks:
            raise UsageError(f"{where}: status ok needs output_tokens >= 1 and the time of the first token")
    err = rec.get("error")
    if err is not None and not isinstance(err, str):
        raise UsageError(f"{where}: error must be a string")
    if "meta" in rec and not isinstance(rec["meta"], dict):
        raise UsageError(f"{where}: meta must be an object")
    state = rec.get("cache_state")
    if state is not None and (not isinstance(state, str) or not state.strip()):
        raise UsageError(f"{where}: cache_state must be a non-empty string")
    return RequestRecord(
        request_id=str(rid), deployment=dep, offered_rate_rps=rate, actual_send_ms=send,
        status=status, output_tokens=out_tokens, scheduled_send_ms=sched, chunk_times_ms=chunks,
        chunk_tokens=counts, end_ms=end, input_tokens=in_tokens, error=err, cache_state=state,
        where=where)


def load_records(paths: Iterable[str | Path]) -> list[RequestRecord]:
    """Read JSONL files of request records; any bad line stops the run with FILE:LINE."""
    out: list[RequestRecord] = []
    seen: dict[tuple, str] = {}
    for path in paths:
        p = Path(path)
        text = read_text(p)
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where}: not valid JSON ({exc.msg})") from None
            rec = parse_record(raw, where)
            key = (rec.cache_state, rec.deployment, rec.offered_rate_rps, rec.request_id)
            if key in seen:
                raise UsageError(f"{where}: duplicate request_id {rec.request_id!r} for "
                                 f"{rec.deployment} at {rec.offered_rate_rps:g} rps"
                                 f"{_state_note(rec.cache_state)} (first at {seen[key]})")
            seen[key] = where
            out.append(rec)
    if not out:
        raise UsageError("no request records in " + ", ".join(str(p) for p in paths))
    return out


def record_to_json(rec: RequestRecord, meta: dict | None = None) -> dict:
    """The JSONL form of a record (what convert-vllm and synth write)."""
    out: dict = {"schema": SCHEMA_REQUEST, "request_id": rec.request_id,
                 "deployment": rec.deployment, "offered_rate_rps": rec.offered_rate_rps,
                 "scheduled_send_ms": rec.scheduled_send_ms, "actual_send_ms": rec.actual_send_ms,
                 "first_token_ms": rec.first_token_ms, "chunk_times_ms": list(rec.chunk_times_ms),
                 "chunk_tokens": list(rec.chunk_tokens) if rec.chunk_tokens is not None else None,
                 "output_tokens": rec.output_tokens, "status": rec.status}
    if rec.end_ms is not None:
        out["end_ms"] = rec.end_ms
    if rec.input_tokens is not None:
        out["input_tokens"] = rec.input_tokens
    if rec.error:
        out["error"] = rec.error
    if rec.cache_state is not None:
        out["cache_state"] = rec.cache_state
    if meta:
        out["meta"] = meta
    return out


def _state_note(state: str | None) -> str:
    return "" if state is None else f", cache state {state}"


def dumps_jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
