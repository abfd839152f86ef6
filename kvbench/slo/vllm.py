"""Convert `vllm bench serve --save-result --save-detailed` JSON into kvbench request records.

What vLLM writes per request (lists in request order, all times in seconds):
    start_times  time.perf_counter() when the client sent the request (arbitrary origin)
    ttfts        first chunk minus start
    itls         gaps between successive streamed chunks (per chunk, not per token)
    latencies    end of the stream minus start
    output_lens  output tokens (0 for a failed request)
    errors       "" for success, else the HTTP reason or the exception text
    input_lens   prompt tokens
It does not record when each request was *scheduled*, so converted records have no
scheduled_send_ms and the send-lag check reports "not evaluated".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.requests import RequestRecord, parse_record, record_to_json
from kvbench.records.schema.read import MiB, loads_many, read_text_bounded
from kvbench.records.schema.slo import VllmResult
from kvbench.records.schema.types import parse, show

MAX_VLLM_BYTES = 256 * MiB  # peak memory is ~9x the file (docs/robustness.md): 256 MiB keeps it < 2.5 GiB

_NEEDED = ("start_times", "ttfts", "itls", "output_lens", "errors")
_REJECT_WORDS = ("too many requests", "429", "service unavailable", "503")
_TIMEOUT_WORDS = ("timeout", "timed out")


def classify_error(text: str) -> str:
    """Map a vLLM error string to a kvbench status (rejected, timeout or error)."""
    low = text.lower()
    if any(w in low for w in _TIMEOUT_WORDS):
        return "timeout"
    if any(w in low for w in _REJECT_WORDS):
        return "rejected"
    return "error"


def load_vllm_result(path: str | Path, index: int | None = None) -> VllmResult:
    """The chosen result of a vLLM result file, its per-request lists checked (kvbench.records.schema)."""
    p = Path(path)
    docs = loads_many(read_text_bounded(p, MAX_VLLM_BYTES, "vLLM result file"), str(p), finite=False)
    if not docs:
        raise UsageError(f"{p}: empty file")
    if index is None:
        if len(docs) > 1:
            raise UsageError(f"{p}: holds {len(docs)} results (written with --append-result); "
                             f"choose one with --index 0..{len(docs) - 1}")
        index = 0
    if not 0 <= index < len(docs):
        raise UsageError(f"{p}: --index {index} out of range 0..{len(docs) - 1}")
    doc = docs[index]
    if not isinstance(doc, dict):
        raise UsageError(f"{p}: expected a JSON object from vllm bench serve")
    missing = [k for k in _NEEDED if k not in doc]
    if missing:
        raise UsageError(f"{p}: no {', '.join(missing)}: run vllm bench serve with --save-result "
                         "--save-detailed (a version that saves start_times)")
    return parse(VllmResult, doc, str(p))


def _offered_rate(doc: VllmResult, given: float | None, p: Path) -> float:
    if doc.ramp_up_strategy:
        raise UsageError(f"{p}: a ramp-up run ({doc.ramp_up_strategy}) has no single offered rate")
    raw = doc.request_rate
    file_rate = float(raw) if isinstance(raw, float) and math.isfinite(raw) and raw > 0 else None
    if given is not None:
        if file_rate is not None and abs(file_rate - given) > 1e-9 * max(1.0, given):
            raise UsageError(f"--offered-rate {given:g} differs from the file's request_rate {file_rate:g}")
        return given
    if file_rate is None:
        raise UsageError(f"{p}: request_rate is {show(raw)}, not a finite offered rate "
                         "(an open-loop SLO analysis needs one); pass --offered-rate RPS")
    return file_rate


def _failed(doc: VllmResult, i: int, common: dict, send_ms: float, err: str) -> RequestRecord:
    lat = doc.latencies[i] if doc.latencies else None
    end = round(send_ms + lat * 1000.0, 6) if lat else None
    return RequestRecord(**common, actual_send_ms=send_ms, status=classify_error(err) if err else "error",
                         output_tokens=0, end_ms=end, error=err)


def _succeeded(doc: VllmResult, i: int, common: dict, send_ms: float, origin: float) -> RequestRecord:
    t = doc.start_times[i] + doc.ttfts[i]
    chunks = [round((t - origin) * 1000.0, 6)]
    for g in doc.itls[i]:
        t += g
        chunks.append(round((t - origin) * 1000.0, 6))
    lat = doc.latencies[i] if doc.latencies else None
    end = max(round(send_ms + lat * 1000.0, 6), chunks[-1]) if lat else None
    out_len = doc.output_lens[i]
    counts = (1,) * len(chunks) if len(chunks) == out_len else None  # vLLM keeps no per-chunk counts
    return RequestRecord(**common, actual_send_ms=send_ms, status="ok", output_tokens=out_len,
                         chunk_times_ms=tuple(chunks), chunk_tokens=counts, end_ms=end)


def iter_converted(path: str | Path, deployment: str, offered_rate_rps: float | None = None,
                   index: int | None = None) -> tuple[Iterator[dict], list[str]]:
    """The records one at a time (memory: the parsed file, not the records), plus notes.

    Each record is checked by the same schema `analyze` reads it with, so convert-vllm never
    writes a file its own analysis refuses.
    """
    p = Path(path)
    doc = load_vllm_result(p, index)
    rate = _offered_rate(doc, offered_rate_rps, p)
    notes = []
    if doc.max_concurrency is not None:
        notes.append(f"max_concurrency={doc.max_concurrency}: vLLM held requests back at the "
                     "client, so sends may lag the schedule it does not record")
    return _rows(doc, p, deployment, rate), notes


def _rows(doc: VllmResult, p: Path, deployment: str, rate: float) -> Iterator[dict]:
    origin = min(doc.start_times)
    for i in range(len(doc.ttfts)):
        send_ms = round((doc.start_times[i] - origin) * 1000.0, 6)
        err = doc.errors[i] or ""
        if not err and doc.output_lens[i] == 0:
            err = "no output tokens and no error message"
        ins = doc.input_lens[i] if doc.input_lens else None
        common = dict(request_id=str(i), deployment=deployment, offered_rate_rps=rate, input_tokens=ins)
        rec = (_failed(doc, i, common, send_ms, err) if err
               else _succeeded(doc, i, common, send_ms, origin))
        doc.itls[i] = []  # converted: its gaps are not needed again (memory falls as rows go out)
        row = record_to_json(rec, {"source": "vllm bench serve", "file": p.name, "index": i})
        parse_record(row, f"{p}: request {i}")
        yield row
