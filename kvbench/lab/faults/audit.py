"""The per-request audit of a fault run: what the client saw, what the engines kept.

Pure functions over recorded data (client chunk records, proxy events, metric
snapshots), so the auditor itself is tested on planted faults without any engine.

Per request:
- exactly one terminal outcome: a complete stream (one chunk with a finish_reason, no
  error after it, the [DONE] marker) or one clean error (an HTTP error status, or one
  error event and no token after it). None, or more than one, is flagged;
- token positions: the token ids received, in order, counted against what the server
  said it produced (usage.completion_tokens) and what was asked (max_tokens with
  ignore_eos): more is a duplicated position, fewer a missing one. Where a reference
  run of the same prompt exists, the first position that differs is reported too;
- attempts: prefill requests the proxy sent for it, plus one if decode recomputed the
  prompt (kv_load_failure_policy=recompute): at most 2 (one retry). Recompute runs the
  prefill twice: this is at-most-one-retry, not exactly-once compute.
Per instance, after drain: KV usage back to its idle value, no running or waiting
request, and on prefill every request whose KV was never read accounted for by the
expired-lease counter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MAX_ATTEMPTS = 2
USAGE_TOLERANCE = 1e-9


@dataclass
class RequestAudit:
    id: str
    outcome: str  # complete | error | none | multiple
    problems: list[str] = field(default_factory=list)
    tokens_received: int = 0
    tokens_reported: int | None = None
    duplicate_positions: int = 0
    missing_positions: int = 0
    first_reference_mismatch: int | None = None
    attempts: int | None = None
    error: str | None = None


def terminal_events(rec: dict) -> list[str]:
    """Every terminal signal in the order seen: 'http_error', 'error', 'finish'."""
    if rec.get("end") == "http_error" or (rec.get("status") not in (None, 200)):
        return ["http_error"]
    out = []
    for chunk in rec.get("chunks", []):
        if "error" in chunk:
            out.append("error")
        elif chunk.get("finish_reason"):
            out.append("finish")
    return out


def _outcome(rec: dict, audit: RequestAudit) -> None:
    terms = terminal_events(rec)
    if len(terms) > 1:
        audit.outcome = "multiple"
        audit.problems.append(f"{len(terms)} terminal outcomes ({', '.join(terms)})")
    elif not terms:
        audit.outcome = "none"
        audit.problems.append(f"no terminal outcome (stream ended: {rec.get('end')})")
    elif terms[0] == "finish":
        audit.outcome = "complete"
        if not rec.get("done_marker"):
            audit.problems.append("finished without the [DONE] marker")
    else:
        audit.outcome = "error"
        audit.error = str(rec.get("error_body") or _first_error(rec))[:200]
    if audit.outcome == "error" and any(c.get("token_ids") for c in _after_error(rec)):
        audit.problems.append("tokens after the error")


def _first_error(rec: dict):
    return next((c["error"] for c in rec.get("chunks", []) if "error" in c), None)


def _after_error(rec: dict) -> list[dict]:
    chunks = rec.get("chunks", [])
    idx = next((i for i, c in enumerate(chunks) if "error" in c), len(chunks))
    return chunks[idx + 1:]


def _positions(rec: dict, expected: int | None, reference: list[int] | None,
               audit: RequestAudit) -> None:
    ids = [t for c in rec.get("chunks", []) for t in (c.get("token_ids") or [])]
    audit.tokens_received = len(ids)
    usage = next((c["usage"] for c in rec.get("chunks", []) if c.get("usage")), None)
    audit.tokens_reported = usage.get("completion_tokens") if usage else None
    if audit.outcome != "complete":
        return
    want = audit.tokens_reported if audit.tokens_reported is not None else expected
    if expected is not None and audit.tokens_reported is not None and audit.tokens_reported != expected:
        audit.problems.append(f"server reported {audit.tokens_reported} tokens, {expected} were asked")
    if want is not None and len(ids) > want:
        audit.duplicate_positions = len(ids) - want
        audit.problems.append(f"{audit.duplicate_positions} duplicated token position(s)")
    elif want is not None and len(ids) < want:
        audit.missing_positions = want - len(ids)
        audit.problems.append(f"{audit.missing_positions} missing token position(s)")
    if reference is not None:
        audit.first_reference_mismatch = next(
            (i for i, (a, b) in enumerate(zip(ids, reference, strict=False)) if a != b),
            None if len(ids) == len(reference) else min(len(ids), len(reference)))


def attempts_from_events(events: list[dict]) -> dict[str, int]:
    """Prefill requests the proxy sent per request id."""
    out: dict[str, int] = {}
    for ev in events:
        if ev.get("step") == "prefill_sent":
            out[ev["id"]] = out.get(ev["id"], 0) + 1
    return out


def audit_request(rec: dict, expected: int | None = None, reference: list[int] | None = None,
                  prefill_attempts: int | None = None, recomputed: bool = False) -> RequestAudit:
    audit = RequestAudit(rec["id"], "none")
    _outcome(rec, audit)
    _positions(rec, expected, reference, audit)
    if prefill_attempts is not None:
        audit.attempts = prefill_attempts + (1 if recomputed else 0)
        if audit.attempts > MAX_ATTEMPTS:
            audit.problems.append(f"{audit.attempts} attempts (more than one retry)")
    return audit


def audit_instance(role: str, idle: dict | None, after: dict | None, unread: int | None,
                   killed: bool = False) -> list[str]:
    """Leak checks for one instance after drain; returns the problems (empty: clean)."""
    if killed:
        return []  # its KV died with it; nothing left to leak
    if idle is None or after is None:
        return [f"{role}: no metrics (idle {'ok' if idle else 'missing'}, "
                f"after drain {'ok' if after else 'missing'})"]
    problems = []
    extra = after.get("kv_cache_usage_perc", 0.0) - idle.get("kv_cache_usage_perc", 0.0)
    if extra > USAGE_TOLERANCE:
        problems.append(f"{role}: leaked KV blocks (usage {100 * after['kv_cache_usage_perc']:.4f}% "
                        f"after drain vs {100 * idle.get('kv_cache_usage_perc', 0.0):.4f}% idle)")
    for key in ("num_requests_running", "num_requests_waiting"):
        if after.get(key, 0.0) > 0:
            problems.append(f"{role}: {after[key]:g} request(s) still {key.split('_')[-1]} after drain")
    if unread is not None and "nixl_num_kv_expired_reqs" in after:
        expired = after["nixl_num_kv_expired_reqs"] - idle.get("nixl_num_kv_expired_reqs", 0.0)
        if expired != unread:
            problems.append(f"{role}: {expired:g} expired KV lease(s) but {unread} request(s) "
                            "whose KV was never read")
    return problems


def summarize(requests: list[RequestAudit], instance_problems: list[str]) -> dict:
    counts: dict[str, int] = {}
    for a in requests:
        counts[a.outcome] = counts.get(a.outcome, 0) + 1
    return {
        "requests": len(requests), "outcomes": counts,
        "duplicate_positions": sum(a.duplicate_positions for a in requests),
        "missing_positions": sum(a.missing_positions for a in requests),
        "max_attempts": max((a.attempts or 0 for a in requests), default=0),
        "reference_mismatches": sum(a.first_reference_mismatch is not None for a in requests),
        "request_problems": {a.id: a.problems for a in requests if a.problems},
        "instance_problems": instance_problems,
        "passed": not any(a.problems for a in requests) and not instance_problems,
        "per_request": [asdict(a) for a in requests],
    }
