"""The fault auditor on planted faults: each must be flagged, and a clean run must pass.

Records have the shape kvbench.lab.venv.client writes; the clean one is modelled on a real
streamed completion from the lab (a chunk per token with its id, finish_reason on the
last token chunk, a usage chunk, then [DONE]).
"""

import copy

from kvbench.lab.faults import audit


def clean_record(rid="r0", tokens=(5, 7, 7, 9)):
    chunks = [{"t": 0.1 * (i + 1), "token_ids": [tok], "text": "x",
               "finish_reason": "length" if i == len(tokens) - 1 else None, "usage": None}
              for i, tok in enumerate(tokens)]
    chunks.append({"t": 1.0, "token_ids": [], "text": "", "finish_reason": None,
                   "usage": {"prompt_tokens": 40, "completion_tokens": len(tokens)}})
    return {"id": rid, "status": 200, "end": "eof", "done_marker": True, "chunks": chunks}


def error_record(rid="e0"):
    return {"id": rid, "status": 200, "end": "eof", "done_marker": True,
            "chunks": [{"t": 5.2, "error": {"message": "Internal server error", "code": 500}}]}


def test_clean_complete_stream_passes():
    a = audit.audit_request(clean_record(), expected=4, reference=[5, 7, 7, 9], prefill_attempts=1)
    assert a.outcome == "complete" and a.problems == [] and a.first_reference_mismatch is None
    assert a.tokens_received == 4 and a.attempts == 1


def test_clean_error_is_one_terminal_outcome():
    a = audit.audit_request(error_record(), expected=4, prefill_attempts=1)
    assert a.outcome == "error" and a.problems == []


def test_http_error_is_one_terminal_outcome():
    rec = {"id": "h", "status": 502, "end": "http_error", "chunks": [], "error_body": "prefill unreachable"}
    a = audit.audit_request(rec, expected=4)
    assert a.outcome == "error" and a.problems == [] and "prefill" in a.error


def test_planted_duplicated_chunk_is_flagged():
    rec = clean_record()
    rec["chunks"].insert(2, copy.deepcopy(rec["chunks"][1]))  # the same token chunk delivered twice
    a = audit.audit_request(rec, expected=4, reference=[5, 7, 7, 9])
    assert a.duplicate_positions == 1
    assert any("duplicated" in p for p in a.problems)


def test_duplicate_of_a_repeated_token_is_still_caught():
    """Ids alone cannot tell a duplicate of `7` from the model's own second `7`; counts can."""
    rec = clean_record(tokens=(7, 7, 7))
    rec["chunks"].insert(0, copy.deepcopy(rec["chunks"][0]))
    a = audit.audit_request(rec, expected=3)
    assert a.duplicate_positions == 1 and a.problems


def test_planted_missing_chunk_is_flagged():
    rec = clean_record()
    del rec["chunks"][1]
    a = audit.audit_request(rec, expected=4, reference=[5, 7, 7, 9])
    assert a.missing_positions == 1 and a.first_reference_mismatch == 2  # [5, 7, 9] vs [5, 7, 7, 9]


def test_planted_two_terminal_outcomes_are_flagged():
    rec = clean_record()
    rec["chunks"].append({"t": 2.0, "error": {"message": "late failure"}})
    a = audit.audit_request(rec, expected=4)
    assert a.outcome == "multiple" and any("2 terminal outcomes" in p for p in a.problems)


def test_two_finish_reasons_are_two_outcomes():
    rec = clean_record()
    rec["chunks"][0]["finish_reason"] = "stop"
    assert audit.audit_request(rec, expected=4).outcome == "multiple"


def test_tokens_after_an_error_are_flagged():
    rec = error_record()
    rec["chunks"].append({"t": 6.0, "token_ids": [3], "text": "x", "finish_reason": None, "usage": None})
    a = audit.audit_request(rec)
    assert any("after the error" in p for p in a.problems)


def test_stream_without_any_outcome_is_flagged():
    rec = clean_record()
    rec["chunks"] = rec["chunks"][:2]
    for c in rec["chunks"]:
        c["finish_reason"] = None
    rec["end"], rec["done_marker"] = "timeout", False
    a = audit.audit_request(rec, expected=4)
    assert a.outcome == "none" and a.problems


def test_more_than_one_retry_is_flagged():
    assert audit.audit_request(clean_record(), expected=4, prefill_attempts=2).problems == []
    a = audit.audit_request(clean_record(), expected=4, prefill_attempts=2, recomputed=True)
    assert a.attempts == 3 and any("more than one retry" in p for p in a.problems)


def test_reference_divergence_is_reported_not_counted_as_duplicate():
    a = audit.audit_request(clean_record(tokens=(5, 8, 7, 9)), expected=4, reference=[5, 7, 7, 9])
    assert a.first_reference_mismatch == 1 and a.duplicate_positions == a.missing_positions == 0


IDLE = {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0,
        "nixl_num_kv_expired_reqs": 2.0}


def test_clean_instance_after_drain_passes():
    assert audit.audit_instance("prefill", IDLE, dict(IDLE, nixl_num_kv_expired_reqs=3.0), unread=1) == []


def test_planted_leaked_block_is_flagged():
    after = dict(IDLE, kv_cache_usage_perc=0.000244)  # one 128-token block of 4096
    problems = audit.audit_instance("decode", IDLE, after, unread=None)
    assert problems and "leaked KV blocks" in problems[0]


def test_request_still_running_after_drain_is_flagged():
    assert audit.audit_instance("decode", IDLE, dict(IDLE, num_requests_running=1.0), None)


def test_unaccounted_unread_kv_is_flagged():
    problems = audit.audit_instance("prefill", IDLE, IDLE, unread=1)
    assert problems and "never read" in problems[0]


def test_missing_metrics_are_a_problem_unless_the_instance_was_killed():
    assert audit.audit_instance("prefill", IDLE, None, unread=0)
    assert audit.audit_instance("prefill", IDLE, None, unread=0, killed=True) == []


def test_summary_counts_and_verdict():
    reqs = [audit.audit_request(clean_record("a"), 4), audit.audit_request(error_record("b"), 4)]
    s = audit.summarize(reqs, [])
    assert s["passed"] and s["outcomes"] == {"complete": 1, "error": 1}
    dup = clean_record("c")
    dup["chunks"].insert(0, copy.deepcopy(dup["chunks"][0]))
    s = audit.summarize([*reqs, audit.audit_request(dup, 4)], ["decode: leaked KV blocks"])
    assert not s["passed"] and s["duplicate_positions"] == 1 and "c" in s["request_problems"]


def test_attempts_are_counted_from_proxy_events():
    events = [{"id": "a", "step": "prefill_sent"}, {"id": "a", "step": "prefill_retry"},
              {"id": "a", "step": "prefill_sent"}, {"id": "b", "step": "prefill_sent"},
              {"id": "b", "step": "decode_sent"}]
    assert audit.attempts_from_events(events) == {"a": 2, "b": 1}
