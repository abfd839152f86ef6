"""`kvbench slo convert --from aiperf` on a real AIPerf 0.13.0 run (tests/data/clients/README.md).

Every expectation comes from AIPerf's own files: its per-request metrics in
profile_export.jsonl and its summary statistics in profile_export_aiperf.json. kvbench's
side is what `slo analyze` computes from the converted records. Where the definitions
coincide the numbers must agree to AIPerf's own precision (it writes ms with 6 decimals);
where they differ (TPOT's token count, end-to-end's end) the test states the difference.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvbench.slo.cli
from tests.conftest import ROOT
from tests.helpers import run

DATA = ROOT / "tests" / "data" / "clients" / "aiperf-0.13.0"
TOL_MS = 2e-5  # AIPerf prints ms to 6 decimals; kvbench rounds its times to 6 decimals


def cli(*args) -> tuple[int, str, str]:
    return run(kvbench.slo.cli.cli, *args)


@pytest.fixture(scope="module")
def tool_records() -> list[dict]:
    return [json.loads(line) for line in (DATA / "profile_export.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tool_summary() -> dict:
    return json.loads((DATA / "profile_export_aiperf.json").read_text())


@pytest.fixture()
def converted(tmp_path) -> list[dict]:
    out = tmp_path / "agg.jsonl"
    rc, stdout, err = cli("convert", "--from", "aiperf", DATA, "--deployment", "aggregated",
                          "--out", out)
    assert rc == 0, err
    assert stdout.strip() == f"{out}: 20 records (20 ok) for aggregated at 2 rps"
    return [json.loads(line) for line in out.read_text().splitlines()]


def analyzed(tmp_path, rows: list[dict]) -> dict:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = cli("analyze", src, "--denominator", "successful", "--attainment-min", "0.5", "--ttft-max-ms", "60000",
                       "--format", "json")
    assert rc == 0, err
    (group,) = json.loads(out)["groups"]
    return group


def type7(values, q) -> float:
    return float(np.percentile(values, q))  # AIPerf's metric_dicts.py: linear, (n - 1) * q


def test_counts_and_ttft_agree_with_aiperf_summary(tmp_path, converted, tool_summary):
    g = analyzed(tmp_path, converted)
    s = tool_summary
    assert g["counts"]["records"] == s["request_count"]["avg"] == 20
    assert g["counts"]["ok"] == s["completed_request_count"]["avg"] == 20
    assert g["error_rate_pct"] == s["request_error_rate"]["avg"] == 0.0
    ttft = g["latency_ms"]["ttft"]
    assert ttft["n"] == s["time_to_first_token"]["count"]
    for q in (50, 95, 99):
        assert ttft[f"p{q}_ms"] == pytest.approx(s["time_to_first_token"][f"p{q}"], abs=TOL_MS)
    assert ttft["max_ms"] == pytest.approx(s["time_to_first_token"]["max"], abs=TOL_MS)


def test_chunk_gaps_agree_with_aiperf_inter_chunk_latency(tmp_path, converted, tool_summary):
    """Pooled chunk gaps: count, max and mean exact; AIPerf's percentiles are a t-digest estimate."""
    gaps = np.concatenate([np.diff(r["chunk_times_ms"]) for r in converted])
    icl = tool_summary["inter_chunk_latency"]
    assert len(gaps) == icl["count"] == 596
    assert gaps.max() == pytest.approx(icl["max"], abs=TOL_MS)
    assert gaps.mean() == pytest.approx(icl["avg"], abs=TOL_MS)
    g = analyzed(tmp_path, converted)["latency_ms"]["itl_per_chunk"]
    assert g["n"] == icl["count"] and g["max_ms"] == pytest.approx(icl["max"], abs=TOL_MS)
    # t-digest (list_metric_aggregation.py) against exact: close, not equal
    assert g["p50_ms"] == pytest.approx(icl["p50"], rel=0.02)


def test_tpot_is_aiperf_itl_rescaled_from_its_token_count_to_the_servers(tmp_path, converted,
                                                                         tool_records, tool_summary):
    """AIPerf ITL = (last chunk - first) / (OSL - 1) with OSL its own re-tokenisation of the text;
    kvbench TPOT divides by the server's completion tokens - 1. Same span, different divisor."""
    g = analyzed(tmp_path, converted)
    ours, theirs = [], []
    for rec, tool in zip(converted, tool_records, strict=True):
        m = tool["metrics"]
        osl, usage = m["output_sequence_length"]["value"], m["usage_completion_tokens"]["value"]
        assert rec["output_tokens"] == usage == 32
        span = rec["chunk_times_ms"][-1] - rec["chunk_times_ms"][0]
        assert span / (osl - 1) == pytest.approx(m["inter_token_latency"]["value"], abs=TOL_MS)
        ours.append(span / (usage - 1))
        theirs.append(span / (osl - 1))
    s = tool_summary["inter_token_latency"]
    for q in (50, 95, 99):
        assert type7(theirs, q) == pytest.approx(s[f"p{q}"], abs=TOL_MS)
        assert g["latency_ms"]["tpot"][f"p{q}_ms"] == pytest.approx(type7(ours, q), abs=1e-9)
    assert any(r["metrics"]["output_sequence_length"]["value"] != 32 for r in tool_records)


def test_e2e_ends_at_the_response_end_not_the_last_chunk(converted, tool_records, tool_summary):
    """AIPerf request_latency stops at the last content chunk; kvbench's E2E at request_end_ns."""
    lat = [r["chunk_times_ms"][-1] - r["actual_send_ms"] for r in converted]
    s = tool_summary["request_latency"]
    for q in (50, 95, 99):
        assert type7(lat, q) == pytest.approx(s[f"p{q}"], abs=TOL_MS)
    tails = [r["end_ms"] - r["chunk_times_ms"][-1] for r in converted]
    want = [(t["metadata"]["request_end_ns"] - t["metadata"]["request_start_ns"]) / 1e6
            - t["metrics"]["request_latency"]["value"] for t in tool_records]
    assert tails == pytest.approx(want, abs=1e-3)  # start/end are epoch ns, latency perf ns
    assert max(tails) > 100.0  # the fixture has responses whose end came well after the last chunk


def test_times_schedule_and_chunk_counts(converted, tool_records):
    t0 = min(min(t["metadata"]["request_start_ns"], t["metadata"]["credit_issued_ns"]) for t in tool_records)
    for rec, tool in zip(converted, tool_records, strict=True):
        md, m = tool["metadata"], tool["metrics"]
        assert rec["request_id"] == md["x_request_id"]
        assert rec["actual_send_ms"] == pytest.approx((md["request_start_ns"] - t0) / 1e6, abs=1e-6)
        assert rec["scheduled_send_ms"] == pytest.approx((md["credit_issued_ns"] - t0) / 1e6, abs=1e-6)
        assert rec["first_token_ms"] - rec["actual_send_ms"] == pytest.approx(
            m["time_to_first_token"]["value"], abs=TOL_MS)
        chunks = len(m["inter_chunk_latency"]["value"]) + 1
        assert len(rec["chunk_times_ms"]) == chunks
        assert rec["chunk_tokens"] == ([1] * 32 if chunks == 32 else None)  # coalesced reads: unknown
    assert min(r["actual_send_ms"] - r["scheduled_send_ms"] for r in converted) >= 0


def test_errors_cancellations_and_warmup(tmp_path, tool_records):
    lines = [dict(r) for r in tool_records[:5]]
    lines[0] = {**lines[0], "metrics": {}, "error": {"code": 429, "type": "Too Many Requests", "message": ""}}
    lines[1] = {**lines[1], "metrics": {}, "error": {"code": None, "type": "ServerTimeoutError",
                                                     "message": "read timed out"}}
    lines[2] = {**lines[2], "metadata": {**lines[2]["metadata"], "was_cancelled": True},
                "error": {"code": 499, "type": "RequestCancellationError", "message": "cancelled"}}
    lines[3] = {**lines[3], "metadata": {**lines[3]["metadata"], "benchmark_phase": "warmup"}}
    src = tmp_path / "profile_export.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "r.jsonl"
    rc, stdout, err = cli("convert", "--from", "aiperf", src, "--deployment", "d",
                          "--offered-rate", "2", "--out", out)
    assert rc == 0, err
    assert "1 AIPerf warm-up requests left out" in err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in recs] == ["rejected", "timeout", "error", "ok"]
    assert recs[2]["error"].startswith("cancelled by the client")
    assert all(r["chunk_times_ms"] == [] for r in recs[:3])


def test_no_rate_without_summary_is_one_line(tmp_path):
    src = tmp_path / "profile_export.jsonl"
    src.write_text((DATA / "profile_export.jsonl").read_text())
    rc, _, err = cli("convert", "--from", "aiperf", src, "--deployment", "d")
    assert rc == 2 and err.count("\n") == 1 and "--offered-rate" in err
    rc, _, err = cli("convert", "--from", "aiperf", DATA, "--deployment", "d", "--offered-rate", "3")
    assert rc == 2 and "differs from the request rate 2" in err


def _converted_or_refused(tmp_path, lines: list[dict]) -> tuple[int, str, list[dict] | None]:
    src = tmp_path / "profile_export.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "r.jsonl"
    rc, _, err = cli("convert", "--from", "aiperf", src, "--deployment", "d",
                     "--offered-rate", "2", "--out", out)
    return rc, err, [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else None


def _without_request_ids(lines: list[dict], sessions_turns) -> list[dict]:
    out = []
    for r, (s, t) in zip(lines, sessions_turns, strict=True):
        md = {k: v for k, v in r["metadata"].items() if k != "x_request_id"}
        out.append({**r, "metadata": {**md, "session_num": s, "turn_index": t}})
    return out


@pytest.mark.parametrize("case", ["x_request_id", "session"])
def test_a_request_given_twice_is_refused_at_convert_naming_the_line_and_id(tmp_path,
                                                                          tool_records, case):
    """convert wrote (exit 0) what analyze then refused ("duplicate request_id"): a repeated
    request is a replay or two runs pasted together, which no rule can tell apart; it is
    refused where it is read, by the rule analyze applies (kvbench.records.requests.RequestIds)."""
    lines = [dict(r) for r in tool_records[:4]]
    if case == "x_request_id":
        lines.append(lines[1])
        want = f"profile_export.jsonl:5: duplicate request_id {lines[1]['metadata']['x_request_id']!r}"
    else:  # no x_request_id: AIPerf's session and turn name the request
        lines = _without_request_ids(lines, [(0, 0), (1, 0), (2, 0), (1, 0)])
        want = "profile_export.jsonl:4: duplicate request_id 'session 1 turn 0'"
    rc, err, recs = _converted_or_refused(tmp_path, lines)
    assert rc == 2 and err.count("\n") == 1 and want in err, err
    assert "(first at " in err and "profile_export.jsonl:2)" in err and recs is None


def test_the_turns_of_one_session_are_different_requests(tmp_path, tool_records):
    lines = _without_request_ids([dict(r) for r in tool_records[:3]], [(0, 0), (0, 1), (1, 0)])
    rc, err, recs = _converted_or_refused(tmp_path, lines)
    assert rc == 0, err
    assert [r["request_id"] for r in recs] == ["session 0 turn 0", "session 0 turn 1", "session 1 turn 0"]
    assert analyzed(tmp_path, recs)["counts"]["records"] == 3


@pytest.mark.parametrize("edit, message", [
    (lambda ls: ls[1]["metrics"]["inter_chunk_latency"]["value"].__setitem__(2, -50.0),
     "profile_export.jsonl:2: metrics.inter_chunk_latency.value[2]: must be >= 0, got -50.0"),
    (lambda ls: ls[1].update(metrics=[]), "profile_export.jsonl:2: metrics: must be an object"),
    (lambda ls: ls[1]["metrics"]["inter_chunk_latency"].update(unit="tokens"),
     "metrics.inter_chunk_latency.unit: expected a time unit"),
])
def test_a_bad_aiperf_value_is_named_by_its_line_and_key_path(tmp_path, tool_records, edit, message):
    """(hostile pass) the key path read 'metrics.inter_chunk_latency..value[2]'."""
    lines = json.loads(json.dumps(tool_records[:3]))
    edit(lines)
    rc, err, recs = _converted_or_refused(tmp_path, lines)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def test_a_byte_order_mark_is_named(tmp_path, tool_records):
    src = tmp_path / "profile_export.jsonl"
    src.write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in tool_records[:2]))
    rc, _, err = cli("convert", "--from", "aiperf", src, "--deployment", "d", "--offered-rate", "2")
    assert rc == 2 and err.count("\n") == 1 and "profile_export.jsonl:1: starts with a byte-order mark" in err
