"""`kvbench slo convert --from guidellm` on a real GuideLLM 0.8.1 run (tests/data/clients/README.md).

Expectations come from GuideLLM's own benchmarks.json: its per-request computed fields and its
summary distributions (metrics.*.successful). GuideLLM's percentiles are the smallest value
whose cumulative probability reaches q (schemas/base/statistics.py Percentiles.from_pdf), not
kvbench's linear interpolation, so percentiles are compared through GuideLLM's rule applied to
kvbench's converted samples; count, mean, min and max compare directly.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import kvbench.slo.cli
from tests.conftest import ROOT
from tests.helpers import run

DATA = ROOT / "tests" / "data" / "clients" / "guidellm-0.8.1" / "benchmarks.json"
TOL_MS = 1e-5  # epoch seconds as doubles (~0.2 us resolution) and kvbench's 6-decimal ms


def cli(*args) -> tuple[int, str, str]:
    return run(kvbench.slo.cli.cli, *args)


def guidellm_pct(values, q: float) -> float:
    """GuideLLM's percentile: equal weights, cumulative sum, first index reaching q."""
    v = np.sort(np.asarray(values, dtype=float))
    cdf = np.cumsum(np.full(len(v), 1.0 / len(v)))
    return float(v[np.searchsorted(cdf, q, side="left")])


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(DATA.read_text())


@pytest.fixture()
def converted(tmp_path) -> list[dict]:
    out = tmp_path / "agg.jsonl"
    rc, stdout, err = cli("convert", "--from", "guidellm", DATA, "--deployment", "aggregated",
                          "--out", out)
    assert rc == 0, err
    assert stdout.strip() == f"{out}: 20 records (20 ok) for aggregated at 2 rps"
    assert "chunk gaps (ITL per chunk, max ITL) are unknown" in err
    return [json.loads(line) for line in out.read_text().splitlines()]


def analyzed(tmp_path, rows: list[dict], *limits: str) -> dict:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = cli("analyze", src, "--denominator", "successful", "--attainment-min", "0.5",
                       *(limits or ("--ttft-max-ms", "60000")), "--format", "json")
    assert rc == 0, err
    (group,) = json.loads(out)["groups"]
    return group


def summary(report: dict, key: str) -> dict:
    return report["benchmarks"][0]["metrics"][key]["successful"]


def check_distribution(ours, theirs: dict, scale: float = 1.0) -> None:
    ours = np.asarray(ours) * scale
    assert len(ours) == theirs["count"]
    assert ours.mean() == pytest.approx(theirs["mean"], abs=TOL_MS * scale)
    assert ours.min() == pytest.approx(theirs["min"], abs=TOL_MS * scale)
    assert ours.max() == pytest.approx(theirs["max"], abs=TOL_MS * scale)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99)):
        assert guidellm_pct(ours, q) == pytest.approx(theirs["percentiles"][name], abs=TOL_MS * scale)


def test_counts_ttft_and_e2e_agree_with_guidellm_summary(tmp_path, converted, report):
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    g = analyzed(tmp_path, converted)
    assert g["counts"]["records"] == totals["total"] == 20
    assert (g["counts"]["ok"], g["counts"]["error"], g["counts"]["timeout"]) == (
        totals["successful"], totals["errored"], totals["incomplete"])
    ttft = [r["first_token_ms"] - r["actual_send_ms"] for r in converted]
    check_distribution(ttft, summary(report, "time_to_first_token_ms"))
    assert g["latency_ms"]["ttft"]["max_ms"] == pytest.approx(max(ttft), abs=1e-9)
    assert g["latency_ms"]["ttft"]["p50_ms"] == pytest.approx(float(np.percentile(ttft, 50)), abs=1e-9)
    e2e_s = [(r["end_ms"] - r["actual_send_ms"]) for r in converted]
    check_distribution(e2e_s, summary(report, "request_latency"), scale=1e-3)  # GuideLLM: seconds


def test_tpot_is_guidellm_itl_and_guidellm_tpot_includes_the_first_token(tmp_path, converted,
                                                                         report):
    """GuideLLM inter_token_latency_ms = kvbench TPOT; its time_per_output_token_ms spreads TTFT
    over every token: (last - start) / tokens. Both summaries weight each request by its tokens
    (metrics.py), the same as per request here because every request has 32 tokens."""
    g = analyzed(tmp_path, converted)
    tpot = [(r["chunk_times_ms"][-1] - r["chunk_times_ms"][0]) / (r["output_tokens"] - 1) for r in converted]
    assert {r["output_tokens"] for r in converted} == {32}
    theirs = summary(report, "inter_token_latency_ms")
    assert theirs["count"] == 20 * 31  # token-weighted
    assert np.mean(tpot) == pytest.approx(theirs["mean"], abs=TOL_MS)
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        assert guidellm_pct(tpot, q) == pytest.approx(theirs["percentiles"][name], abs=TOL_MS)
    assert g["latency_ms"]["tpot"]["p95_ms"] == pytest.approx(float(np.percentile(tpot, 95)), abs=1e-9)
    per_token = [(r["chunk_times_ms"][-1] - r["actual_send_ms"]) / r["output_tokens"] for r in converted]
    assert np.mean(per_token) == pytest.approx(summary(report, "time_per_output_token_ms")["mean"], abs=TOL_MS)


def test_schedule_send_lag_is_guidellm_dispatch_delay(converted, report):
    lag = [r["actual_send_ms"] - r["scheduled_send_ms"] for r in converted]
    check_distribution(lag, summary(report, "request_dispatch_delay"), scale=1e-3)
    by_id = {r["request_id"]: r for r in report["benchmarks"][0]["requests"]["successful"]}
    for rec in converted:
        tool = by_id[rec["request_id"]]
        assert rec["first_token_ms"] - rec["actual_send_ms"] == pytest.approx(tool["time_to_first_token_ms"],
                                                                             abs=TOL_MS)
        assert rec["output_tokens"] == tool["output_tokens"] and rec["input_tokens"] == tool["prompt_tokens"]
        assert rec["chunk_gaps_recorded"] is False and len(rec["chunk_times_ms"]) == 2
    sends = [r["actual_send_ms"] for r in converted]
    assert sends == sorted(sends) and min(r["scheduled_send_ms"] for r in converted) == 0.0


def test_unrecorded_chunk_gaps_fail_a_declared_max_itl_limit(tmp_path, converted):
    g = analyzed(tmp_path, converted, "--ttft-max-ms", "60000", "--max-itl-ms", "1e8")
    assert g["counts"]["chunk_gaps_unrecorded"] == 20
    assert g["counts"]["missed_limit"]["max_itl"] == 20 and g["counts"]["meeting_limits"] == 0
    assert g["latency_ms"]["itl_per_chunk"]["n"] == 0
    g = analyzed(tmp_path, converted)  # no max ITL limit: nothing unknown is judged
    assert g["counts"]["meeting_limits"] == 20


def _variant(report: dict, tmp_path, mutate) -> str:
    doc = copy.deepcopy(report)
    mutate(doc)
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_errored_and_incomplete_requests(tmp_path, report):
    def mutate(doc):
        b = doc["benchmarks"][0]
        reqs = b["requests"]
        moved = reqs["successful"][:3]
        reqs["successful"] = reqs["successful"][3:]
        moved[0]["info"]["error"] = "HTTP 429 Too Many Requests"
        moved[1]["info"]["error"] = "ReadTimeout: timed out"
        reqs["errored"], reqs["incomplete"] = moved[:2], moved[2:]
        b["metrics"]["request_totals"].update(successful=17, errored=2, incomplete=1)

    src = _variant(report, tmp_path, mutate)
    out = tmp_path / "r.jsonl"
    rc, stdout, err = cli("convert", "--from", "guidellm", src, "--deployment", "d", "--out", out)
    assert rc == 0, err
    assert "(17 ok, 1 rejected, 2 timeout)" in stdout
    recs = {r["meta"]["group"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["incomplete"]["status"] == "timeout" and "incomplete" in recs["incomplete"]["error"]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["benchmarks"][0]["metrics"]["request_totals"].update(successful=25),
     "successful: 20 requests kept of 25 made"),
    (lambda d: d["benchmarks"].append(copy.deepcopy(d["benchmarks"][0])),
     "holds 2 benchmarks (0: poisson@2, 1: poisson@2); choose one with --index"),
    (lambda d: d["benchmarks"][0]["config"]["strategy"].update(type_="concurrent", rate=None),
     "has no request rate: pass --offered-rate RPS"),
    (lambda d: d["benchmarks"][0]["requests"]["successful"][4]["info"]["timings"].update(request_start="x"),
     "request_start"),
])
def test_bad_reports_are_one_line_exit_2(tmp_path, report, mutate, message):
    src = _variant(report, tmp_path, mutate)
    out = tmp_path / "r.jsonl"
    rc, stdout, err = cli("convert", "--from", "guidellm", src, "--deployment", "d", "--out", out)
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_a_request_id_given_twice_is_refused_at_convert(tmp_path, report):
    """convert wrote (exit 0) what analyze then refused ("duplicate request_id"); now convert
    refuses it, by analyze's rule, naming where both are."""
    def mutate(doc):
        reqs = doc["benchmarks"][0]["requests"]["successful"]
        reqs[7]["request_id"] = reqs[2]["request_id"]

    src = _variant(report, tmp_path, mutate)
    out = tmp_path / "r.jsonl"
    rc, _, err = cli("convert", "--from", "guidellm", src, "--deployment", "d", "--out", out)
    assert rc == 2 and err.count("\n") == 1 and "duplicate request_id" in err, err
    assert "requests.successful[7]" in err and "(first at " in err and "requests.successful[2])" in err
    assert not out.exists()
