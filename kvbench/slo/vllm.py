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

import json
import math
from pathlib import Path

from kvbench.cli import UsageError, read_text
from kvbench.slo.records import RequestRecord, record_to_json

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


def _documents(text: str, path: Path) -> list:
    """One JSON document, or several back to back (what --append-result writes)."""
    dec, docs, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return docs
        try:
            doc, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        docs.append(doc)


def load_vllm_result(path: str | Path, index: int | None = None) -> dict:
    p = Path(path)
    text = read_text(p)
    docs = _documents(text, p)
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
    return doc


def _offered_rate(doc: dict, given: float | None, p: Path) -> float:
    if doc.get("ramp_up_strategy"):
        raise UsageError(f"{p}: a ramp-up run ({doc['ramp_up_strategy']}) has no single offered rate")
    raw = doc.get("request_rate")
    file_rate = None
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw) and raw > 0:
        file_rate = float(raw)
    if given is not None:
        if file_rate is not None and abs(file_rate - given) > 1e-9 * max(1.0, given):
            raise UsageError(f"--offered-rate {given:g} differs from the file's request_rate {file_rate:g}")
        return given
    if file_rate is None:
        raise UsageError(f"{p}: request_rate is {raw!r}, not a finite offered rate "
                         "(an open-loop SLO analysis needs one); pass --offered-rate RPS")
    return file_rate


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _per_request(doc: dict, key: str, p: Path, n: int) -> list:
    values = doc[key]
    if not isinstance(values, list) or len(values) != n:
        raise UsageError(f"{p}: {key} must be a list of {n} entries, one per request")
    return values


def convert_vllm(path: str | Path, deployment: str, offered_rate_rps: float | None = None,
                 index: int | None = None) -> tuple[list[dict], list[str]]:
    """Records (as JSON objects) for every request in a vLLM result, plus notes for the user."""
    p = Path(path)
    doc = load_vllm_result(p, index)
    missing = [k for k in _NEEDED if k not in doc]
    if missing:
        raise UsageError(f"{p}: no {', '.join(missing)}: run vllm bench serve with --save-result "
                         "--save-detailed (a version that saves start_times)")
    n = len(doc["ttfts"]) if isinstance(doc["ttfts"], list) else -1
    if n <= 0:
        raise UsageError(f"{p}: ttfts must be a non-empty list")
    starts = _per_request(doc, "start_times", p, n)
    ttfts = _per_request(doc, "ttfts", p, n)
    itls = _per_request(doc, "itls", p, n)
    outs = _per_request(doc, "output_lens", p, n)
    errors = _per_request(doc, "errors", p, n)
    lats = _per_request(doc, "latencies", p, n) if "latencies" in doc else [None] * n
    ins = _per_request(doc, "input_lens", p, n) if "input_lens" in doc else [None] * n
    rate = _offered_rate(doc, offered_rate_rps, p)
    for i, s in enumerate(starts):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise UsageError(f"{p}: start_times[{i}] is not a number: {s!r}")
    origin = min(starts)
    notes = []
    if doc.get("max_concurrency") is not None:
        notes.append(f"max_concurrency={doc['max_concurrency']}: vLLM held requests back at the "
                     "client, so sends may lag the schedule it does not record")
    rows = []
    for i in range(n):
        where = f"{p}: request {i}"
        send_ms = round((starts[i] - origin) * 1000.0, 6)
        err = errors[i] if isinstance(errors[i], str) else ("" if errors[i] is None else str(errors[i]))
        out_len = outs[i]
        if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 0:
            raise UsageError(f"{where}: output_lens entry {out_len!r} is not a token count")
        gaps = itls[i] if isinstance(itls[i], list) else None
        if gaps is None:
            raise UsageError(f"{where}: itls entry must be a list")
        ttft = ttfts[i]
        failed = bool(err) or out_len == 0
        if not err and out_len == 0:
            err = "no output tokens and no error message"
        meta = {"source": "vllm bench serve", "file": p.name, "index": i}
        if failed:
            status = classify_error(err) if err else "error"
            lat = lats[i]
            end = (round(send_ms + lat * 1000.0, 6)
                   if isinstance(lat, (int, float)) and not isinstance(lat, bool) and lat > 0 else None)
            rec = RequestRecord(request_id=str(i), deployment=deployment, offered_rate_rps=rate,
                                actual_send_ms=send_ms, status=status, output_tokens=0, end_ms=end,
                                input_tokens=_count(ins[i]), error=err)
            rows.append(record_to_json(rec, meta))
            continue
        for v in [ttft, *gaps]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UsageError(f"{where}: ttft/itl value {v!r} is not a non-negative number of seconds")
        t = starts[i] + ttft
        chunks = [round((t - origin) * 1000.0, 6)]
        for g in gaps:
            t += g
            chunks.append(round((t - origin) * 1000.0, 6))
        lat = lats[i]
        end = None
        if isinstance(lat, (int, float)) and not isinstance(lat, bool) and lat > 0:
            end = max(round(send_ms + lat * 1000.0, 6), chunks[-1])
        counts = [1] * len(chunks) if len(chunks) == out_len else None  # vLLM keeps no per-chunk counts
        rec = RequestRecord(request_id=str(i), deployment=deployment, offered_rate_rps=rate,
                            actual_send_ms=send_ms, status="ok", output_tokens=out_len,
                            chunk_times_ms=tuple(chunks), chunk_tokens=tuple(counts) if counts else None,
                            end_ms=end, input_tokens=_count(ins[i]))
        rows.append(record_to_json(rec, meta))
    return rows, notes
