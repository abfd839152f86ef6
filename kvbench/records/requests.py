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

import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.schema.read import decode_line, iter_lines
from kvbench.records.schema.slo import SCHEMA_REQUEST, STATUSES, RequestIn
from kvbench.records.schema.types import parse, parse_line_fast
from kvbench.records.write import as_contract, dumps_json

__all__ = ["SCHEMA_REQUEST", "STATUSES", "RequestRecord", "RequestIds", "parse_record", "iter_records",
           "load_records", "record_to_json", "dumps_jsonl"]

_UNKNOWN_HINT = " (put free-form data under 'meta')"


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
    chunk_gaps_recorded: bool = True  # False: chunk_times_ms is (first, last) only (GuideLLM keeps no more)
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


def parse_record(rec: object, where: str) -> RequestRecord:
    """Check one decoded JSON value (kvbench.records.schema.slo.RequestIn) and make a RequestRecord."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: expected a JSON object")
    return _record(parse(RequestIn, rec, where, unknown_hint=_UNKNOWN_HINT), where)


def parse_record_line(raw: bytes, where: str) -> RequestRecord:
    """One line of a records file: the fast path when it is safe, else the careful one."""
    r = parse_line_fast(RequestIn, raw)
    return _record(r, where) if r is not None else parse_record(decode_line(raw, where), where)


def _record(r: RequestIn, where: str) -> RequestRecord:
    return RequestRecord(
        request_id=str(r.request_id), deployment=r.deployment, offered_rate_rps=float(r.offered_rate_rps),
        actual_send_ms=float(r.actual_send_ms), status=r.status, output_tokens=r.output_tokens,
        scheduled_send_ms=_f(r.scheduled_send_ms), chunk_times_ms=tuple(map(float, r.chunks)),
        chunk_tokens=tuple(r.chunk_tokens) if r.chunk_tokens is not None else None,
        end_ms=_f(r.end_ms), input_tokens=r.input_tokens, error=r.error, cache_state=r.cache_state,
        chunk_gaps_recorded=r.chunk_gaps_recorded, where=where)


def _f(x: float | None) -> float | None:
    return None if x is None else float(x)


class RequestIds:
    """The rule analyze and every converter share: a request_id given twice for the same
    (cache state, deployment, rate) is refused, in one line naming where it is and where it
    first appeared, so convert never writes a file analyze refuses. Only a 16-byte digest of
    each id is kept (memory: ~100 B a request, however long the ids); `first_at(rec)` names
    where a digest seen before first appeared (analyze reads its files again; a converter
    passes none and the place is kept with the digest), which also rules out a collision."""

    def __init__(self, first_at: Callable[[RequestRecord], str] | None = None):
        self._seen: dict[tuple, dict[bytes, str | None]] = defaultdict(dict)
        self._first_at = first_at

    def check(self, rec: RequestRecord, where: str) -> None:
        ids = self._seen[(rec.cache_state, rec.deployment, rec.offered_rate_rps)]
        digest = hashlib.blake2b(rec.request_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest in ids:
            first = ids[digest] or self._first_at(rec)
            if first != where:
                raise UsageError(f"{where}: duplicate request_id {rec.request_id!r} for "
                                 f"{rec.deployment} at {rec.offered_rate_rps:g} rps"
                                 f"{_state_note(rec.cache_state)} (first at {first})")
        ids[digest] = None if self._first_at else where


def iter_records(paths: Iterable[str | Path]) -> Iterator[RequestRecord]:
    """Records of JSONL files one at a time (memory: one line); any bad line stops with FILE:LINE.
    A request_id given twice is refused (RequestIds)."""
    paths = [Path(p) for p in paths]
    ids = RequestIds(lambda rec: _first_at(paths, rec))
    n = 0
    for p in paths:
        for where, raw in iter_lines(p, "records file", missing="no such file"):
            rec = parse_record_line(raw, where)
            ids.check(rec, where)
            n += 1
            yield rec
    if not n:
        raise UsageError("no request records in " + ", ".join(str(p) for p in paths))


def _first_at(paths: list[Path], dup: RequestRecord) -> str:
    """Where a request first appeared (error path only: reads the files again)."""
    for p in paths:
        for where, raw in iter_lines(p, "records file"):
            r = parse_record_line(raw, where)
            if (r.request_id, r.deployment, r.offered_rate_rps, r.cache_state) == \
                    (dup.request_id, dup.deployment, dup.offered_rate_rps, dup.cache_state):
                return where
    return "?"


def load_records(paths: Iterable[str | Path]) -> list[RequestRecord]:
    """Read JSONL files of request records; any bad line stops the run with FILE:LINE."""
    return list(iter_records(paths))


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
    if not rec.chunk_gaps_recorded:
        out["chunk_gaps_recorded"] = False
    if meta:
        out["meta"] = meta
    as_contract(RequestIn, out, f"request record {rec.request_id!r}")  # what its readers accept
    return out


def _state_note(state: str | None) -> str:
    return "" if state is None else f", cache state {state}"


def dumps_jsonl(rows: Iterable[dict]) -> str:
    return "".join(dumps_json(r, indent=None) + "\n" for r in rows)
