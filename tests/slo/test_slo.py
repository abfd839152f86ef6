"""SLO analysis through the CLI a user runs: the tutorial cohort, gates, queue growth, capacity.

End-to-end cases run `python -m kvbench.slo` in a fresh interpreter; the bad-input matrix
calls `kvbench.slo.cli.cli(argv)` in-process (the very function `kvbench slo` dispatches to)
so that the suite stays fast.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvbench.slo.cli
from tests.conftest import run_cli
from tests.helpers import run
from tests.slo.helpers import req, write_jsonl

LIMITS = ("--ttft-max-ms", "2000", "--tpot-max-ms", "50")


def slo_json(*args: str) -> dict:
    res = run_cli("kvbench.slo", "analyze", *args, "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def slo_json_in(*args: str) -> dict:
    """The same analysis in-process: `kvbench slo` calls kvbench.slo.cli.cli(argv) exactly so."""
    rc, out, err = slo_inproc("analyze", *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def slo_inproc(*args: str) -> tuple[int, str, str]:
    return run(kvbench.slo.cli.cli, *args)  # what `kvbench slo ...` calls


def tutorial_cohort() -> list[dict]:
    """100 requests: 5 errors, 3 with TTFT 2500 ms, 2 with TPOT 60 ms, 90 meeting both limits."""
    rows = []
    for i in range(100):
        if i % 20 == 19:
            rows.append(req(i, status="error"))
        elif i in (5, 25, 45):
            rows.append(req(i, ttft=2500.0))
        elif i in (65, 85):
            rows.append(req(i, tpot=60.0))
        else:
            rows.append(req(i))
    return rows


# ---------------------------------------------------------------------------
# the tutorial's synthetic cohort


def test_tutorial_cohort_numbers_and_fail_against_95_of_all(tmp_path):
    f = write_jsonl(tmp_path / "cohort.jsonl", tutorial_cohort())
    out = slo_json(f, *LIMITS, "--denominator", "all_offered_after_warmup", "--attainment-min", "0.95")
    (g,) = out["groups"]
    c, a = g["counts"], g["attainment"]
    assert (c["offered_after_warmup"], c["ok"], c["error"], c["meeting_limits"]) == (100, 95, 5, 90)
    assert c["missed_limit"] == {"ttft": 3, "tpot": 2}
    assert g["error_rate_pct"] == 5.0
    assert round(a["of_successful_pct"], 1) == 94.7
    assert a["of_all_offered_pct"] == 90.0
    assert a["declared_pct"] == 90.0 and a["min_pct"] == 95.0
    gates = {x["name"]: x["passed"] for x in g["gates"]}
    assert gates["attainment"] is False and gates["queue_stability"] is True
    assert g["passed"] is False and g["failed_gates"] == ["attainment"]
    assert out["capacity"][0]["status"] == "below_lowest"
    assert out["records_total"] == 100


def test_gate_uses_the_declared_denominator(tmp_path):
    """94.7% of successes passes a 92% gate; 90% of all offered does not. Both are shown."""
    f = write_jsonl(tmp_path / "cohort.jsonl", tutorial_cohort())
    for den, expect in (("successful", True), ("all_offered_after_warmup", False)):
        (g,) = slo_json_in(f, *LIMITS, "--denominator", den, "--attainment-min", "0.92")["groups"]
        att = next(x for x in g["gates"] if x["name"] == "attainment")
        assert att["passed"] is expect, den
        assert round(g["attainment"]["of_successful_pct"], 1) == 94.7
        assert g["attainment"]["of_all_offered_pct"] == 90.0


def test_cohort_table_and_markdown_show_both_attainments(tmp_path):
    f = write_jsonl(tmp_path / "cohort.jsonl", tutorial_cohort())
    args = ("analyze", f, *LIMITS, "--denominator", "all_offered_after_warmup", "--attainment-min", "0.95")
    res = run_cli("kvbench.slo", *args)
    assert res.returncode == 0, res.stderr
    assert "94.7% of 95 successful, 90.0% of 100 offered" in res.stdout
    assert "error rate   5.0%" in res.stdout
    assert "aggregated @ 1 rps: FAIL (attainment)" in res.stdout
    md = run_cli("kvbench.slo", *args, "--format", "markdown")
    assert md.returncode == 0, md.stderr
    row = next(line for line in md.stdout.splitlines() if line.startswith("| aggregated | 1 |"))
    cells = [x.strip() for x in row.strip("|").split("|")]
    assert cells[9:12] == ["94.7", "90.0", "5.0"] and cells[-1] == "FAIL: attainment"


def test_shipped_synthetic_cohort_reproduces_the_public_vector(tmp_path):
    f = tmp_path / "c.jsonl"
    res = run_cli("kvbench.slo", "synth", "cohort", "--out", str(f))
    assert res.returncode == 0, res.stderr
    (g,) = slo_json_in(str(f), *LIMITS, "--denominator", "all_offered_after_warmup",
                    "--attainment-min", "0.95")["groups"]
    assert g["error_rate_pct"] == 5.0 and g["attainment"]["of_all_offered_pct"] == 90.0
    assert round(g["attainment"]["of_successful_pct"], 1) == 94.7 and g["passed"] is False


# ---------------------------------------------------------------------------
# metric definitions


def test_ttft_tpot_pooled_itl_and_max_itl(tmp_path):
    """TTFT/TPOT one sample per request, ITL one per chunk gap, percentiles numpy-linear."""
    rows = [req(0), req(1)]
    rows[0]["chunk_times_ms"] = [100.5, 110.5, 130.5, 160.5]  # send at 0.5: TTFT 100, gaps 10, 20, 30
    rows[1]["chunk_times_ms"] = [1210.5, 1215.5, 1220.5, 1225.5]  # send at 1000.5: TTFT 210, gaps 5
    for r in rows:
        r["output_tokens"], r["chunk_tokens"] = 4, [1, 1, 1, 1]
    f = write_jsonl(tmp_path / "m.jsonl", rows)
    (g,) = slo_json_in(f, "--ttft-max-ms", "150", "--denominator", "successful", "--attainment-min", "0.5",
                    "--no-queue-check")["groups"]
    lat = g["latency_ms"]
    assert lat["ttft"]["n"] == 2 and lat["ttft"]["p50_ms"] == pytest.approx(155.0)
    assert lat["tpot"]["p50_ms"] == pytest.approx(np.percentile([20.0, 5.0], 50))
    gaps = [10, 20, 30, 5, 5, 5]
    assert lat["itl_per_chunk"]["n"] == 6
    for q in (50, 95, 99):
        assert lat["itl_per_chunk"][f"p{q}_ms"] == pytest.approx(np.percentile(gaps, q))
    assert lat["max_itl_per_request"]["max_ms"] == pytest.approx(30.0)
    assert g["counts"]["meeting_limits"] == 1 and g["attainment"]["of_successful_pct"] == 50.0
    assert g["queue"]["growing"] is None  # two requests cannot show a trend ...
    assert next(x for x in g["gates"] if x["name"] == "queue_stability")["passed"] is None  # ... not gated


def test_each_declared_limit_counts_separately(tmp_path):
    rows = [req(i) for i in range(12)]  # TTFT 300 ms, TPOT 30 ms, 16 tokens: e2e 750 ms
    rows[3] = req(3, ttft=900.0)  # TTFT over 800
    rows[4] = req(4, tpot=45.0)  # TPOT over 40
    rows[5] = req(5, tokens=40)  # one 260 ms stall: max ITL over 250, TPOT 35.9, e2e 1.7 s
    rows[5]["chunk_times_ms"] = [t + (230.0 if k >= 8 else 0.0) for k, t in enumerate(rows[5]["chunk_times_ms"])]
    rows[6] = req(6, tokens=2, tpot=45.0)  # too short for the TPOT limit: not applicable
    rows[7] = req(7, tokens=60)  # e2e 300 + 59 x 30 = 2070 ms > deadline 1.8 s
    f = write_jsonl(tmp_path / "l.jsonl", rows)
    limits = ("--ttft-max-ms", "800", "--tpot-max-ms", "40", "--max-itl-ms", "250", "--deadline-s", "1.8",
              "--min-tokens-for-tpot", "4", "--denominator", "successful", "--attainment-min", "0.5")
    (g,) = slo_json_in(f, *limits)["groups"]
    assert g["counts"]["missed_limit"] == {"ttft": 1, "tpot": 1, "max_itl": 1, "deadline": 1}
    assert g["counts"]["tpot_not_applicable"] == 1
    assert g["counts"]["meeting_limits"] == 8
    # the TTFT-and-TPOT numerator ignores the max-ITL and deadline limits
    (g2,) = slo_json_in(f, *limits, "--numerator", "requests_meeting_ttft_and_tpot")["groups"]
    assert g2["counts"]["meeting_limits"] == 10 and g2["counts"]["missed_limit"] == {"ttft": 1, "tpot": 1}


def test_every_record_is_counted_somewhere(tmp_path):
    rows = [req(i, status=s) for i, s in enumerate(["ok", "error", "rejected", "timeout"] * 6)]
    f = write_jsonl(tmp_path / "s.jsonl", rows)
    (g,) = slo_json_in(f, *LIMITS, "--denominator", "all_offered_after_warmup", "--attainment-min", "0.2",
                    "--warmup-requests", "4", "--error-rate-max", "0.5")["groups"]
    c = g["counts"]
    assert c["records"] == 24 and c["warmup_excluded"] == 4
    assert (c["ok"], c["error"], c["rejected"], c["timeout"]) == (5, 5, 5, 5)
    assert c["warmup_excluded"] + c["ok"] + c["error"] + c["rejected"] + c["timeout"] == c["records"]
    assert g["error_rate_pct"] == 75.0
    assert {x["name"]: x["passed"] for x in g["gates"]}["error_rate"] is False


def test_warmup_excludes_the_first_requests_by_schedule(tmp_path):
    rows = [req(i, ttft=9000.0 if i < 3 else 300.0) for i in range(30)]
    rows.reverse()  # file order must not matter: the schedule decides what is warm-up
    f = write_jsonl(tmp_path / "w.jsonl", rows)
    (g,) = slo_json_in(f, *LIMITS, "--denominator", "all_offered_after_warmup", "--attainment-min", "1",
                    "--warmup-requests", "3")["groups"]
    assert g["counts"]["warmup_excluded"] == 3 and g["attainment"]["of_all_offered_pct"] == 100.0
    assert g["passed"] is True


def test_client_back_pressure_fails_the_send_lag_gate(tmp_path):
    rows = [req(i, rate=4.0, lag=5.0 + 40.0 * i) for i in range(40)]  # the client falls behind
    f = write_jsonl(tmp_path / "lag.jsonl", rows)
    (g,) = slo_json_in(f, *LIMITS, "--denominator", "all_offered_after_warmup", "--attainment-min", "0.9",
                    "--no-queue-check")["groups"]
    lag_gate = next(x for x in g["gates"] if x["name"] == "client_send_lag")
    assert lag_gate["passed"] is False and lag_gate["value"] > 1000
    assert g["client"]["send_lag_ms"]["max_ms"] == pytest.approx(5.0 + 40.0 * 39)
    assert g["client"]["send_rate_rps"] < 4.0 * 0.9


# ---------------------------------------------------------------------------
# queue growth


def fifo_server(n: int, rate: float, service_ms: float, dep: str) -> list[dict]:
    """Uniform arrivals into one FIFO server: TTFT = waiting + service."""
    rows, free = [], 0.0
    for i in range(n):
        send = i * 1000.0 / rate + 0.5
        start = max(send, free)
        free = start + service_ms
        rows.append(req(i, dep=dep, rate=rate, ttft=free - send))
    return rows


def test_a_growing_queue_fails_the_stability_gate_and_a_stable_one_passes(tmp_path):
    # one server finishing a request every 333 ms keeps up with 2 rps and falls behind at 4 rps
    rows = fifo_server(120, 2.0, 333.0, "aggregated") + fifo_server(240, 4.0, 333.0, "aggregated")
    f = write_jsonl(tmp_path / "q.jsonl", rows)
    # limits so loose that attainment passes: only the queue gate may fail
    out = slo_json(f, "--ttft-max-ms", "1e9", "--denominator", "all_offered_after_warmup",
                   "--attainment-min", "0.99")
    stable, growing = out["groups"]
    assert stable["offered_rate_rps"] == 2.0 and stable["passed"] is True
    assert stable["queue"]["growing"] is False
    assert stable["queue"]["achieved_over_offered"] == pytest.approx(1.0, abs=0.02)
    q = growing["queue"]
    assert growing["failed_gates"] == ["queue_stability"] and q["growing"] is True
    assert q["achieved_over_offered"] < 0.95
    assert q["ttft_median_last_third_ms"] > 3 * q["ttft_median_first_third_ms"]
    assert q["in_flight_mean_last_third"] > 3 * q["in_flight_mean_first_third"]
    assert len(q["reasons"]) == 3
    cap = out["capacity"][0]
    assert (cap["capacity_rps"], cap["first_failing_rate_rps"], cap["first_failing_gates"]) == \
        (2.0, 4.0, ["queue_stability"])
    # the same records, with the check switched off, no longer fail
    off = slo_json(f, "--ttft-max-ms", "1e9", "--denominator", "all_offered_after_warmup",
                   "--attainment-min", "0.99", "--no-queue-check")
    assert off["groups"][1]["passed"] is True and off["groups"][1]["queue"]["growing"] is True


# ---------------------------------------------------------------------------
# capacity from a sweep with a known answer


def sweep_rows() -> list[dict]:
    """aggregated passes 1-3 rps and misses TTFT on 1 in 5 requests at 4 and 5 rps;
    disaggregated passes 1-4 rps and errors on 1 in 10 requests at 5 rps."""
    rows = []
    for rate in (1.0, 2.0, 3.0, 4.0, 5.0):
        for i in range(40):
            slow = rate >= 4 and i % 5 == 0
            rows.append(req(i, dep="aggregated", rate=rate, ttft=2500.0 if slow else 300.0))
            err = rate == 5 and i % 10 == 9
            rows.append(req(i, dep="disaggregated", rate=rate, status="error" if err else "ok"))
    return rows


def test_capacity_and_verdict_from_a_sweep_with_a_known_answer(tmp_path):
    f = write_jsonl(tmp_path / "sweep.jsonl", sweep_rows())
    out = slo_json(f, *LIMITS, "--denominator", "all_offered_after_warmup", "--attainment-min", "0.85",
                   "--error-rate-max", "0.05", "--warmup-requests", "8")
    assert out["records_total"] == 400 and len(out["groups"]) == 10
    assert all(g["counts"]["offered_after_warmup"] == 32 for g in out["groups"])
    caps = {c["deployment"]: c for c in out["capacity"]}
    agg, dis = caps["aggregated"], caps["disaggregated"]
    assert (agg["capacity_rps"], agg["first_failing_rate_rps"], agg["first_failing_gates"]) == \
        (3.0, 4.0, ["attainment"])
    assert (dis["capacity_rps"], dis["first_failing_rate_rps"], dis["first_failing_gates"]) == \
        (4.0, 5.0, ["error_rate"])
    assert agg["status"] == dis["status"] == "bounded"
    v = out["verdict"]
    assert v["winner"] == "disaggregated"
    assert "4 rps vs aggregated 3 rps" in v["text"] and "disaggregation pays" in v["text"]
    assert "equal budget not checked" in v["text"]


def test_capacity_does_not_trust_a_pass_above_a_failure(tmp_path):
    rows = []
    for rate in (1.0, 2.0, 3.0):
        rows += [req(i, dep="edge", rate=rate, ttft=5000.0 if rate == 2 else 300.0) for i in range(24)]
    f = write_jsonl(tmp_path / "nm.jsonl", rows)
    (cap,) = slo_json_in(f, *LIMITS, "--denominator", "all_offered_after_warmup",
                      "--attainment-min", "0.9")["capacity"]
    assert cap["capacity_rps"] == 1.0 and cap["first_failing_rate_rps"] == 2.0
    assert cap["highest_passing_rate_rps"] == 3.0 and cap["passed_above_first_failure_rps"] == [3.0]
    assert "not monotonic" in cap["text"]


def test_tie_and_open_ended_sweeps_give_no_winner(tmp_path):
    rows = [req(i, dep=d, rate=r) for d in ("aggregated", "disaggregated") for r in (1.0, 2.0)
            for i in range(24)]
    f = write_jsonl(tmp_path / "open.jsonl", rows)
    v = slo_json_in(f, *LIMITS, "--denominator", "successful", "--attainment-min", "0.9")["verdict"]
    assert v["winner"] is None and v["text"].startswith("inconclusive")
    rows = [req(i, dep=d, rate=r, ttft=5000.0 if r == 2 else 300.0)
            for d in ("aggregated", "disaggregated") for r in (1.0, 2.0) for i in range(24)]
    f = write_jsonl(tmp_path / "tie.jsonl", rows)
    v = slo_json_in(f, *LIMITS, "--denominator", "successful", "--attainment-min", "0.9")["verdict"]
    assert v["winner"] is None and v["text"].startswith("tie") and "keep the simpler aggregated" in v["text"]


# ---------------------------------------------------------------------------
# with a plan


def small_plan(tmp_path, **changes) -> str:
    import yaml

    from tests.conftest import ROOT

    plan = yaml.safe_load((ROOT / "examples" / "pd-benchmark-plan.yaml").read_text())
    plan["comparison"].update(offered_rates_rps=[2, 4], warmup_requests=4, duration_seconds=10,
                              output_tokens_minimum_for_tpot=8, cache_state="cold")
    for key, value in changes.items():
        plan["comparison"][key] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return str(path)


def test_analysis_driven_by_a_plan(tmp_path):
    plan = small_plan(tmp_path)
    rows = []
    for dep, rates in (("aggregated", (2.0, 4.0)), ("disaggregated", (2.0,))):
        for rate in rates:
            n = 4 + int(10 * rate)  # warm-up, then the declared 10 s
            rows += [req(i, dep=dep, rate=rate, ttft=9000.0 if i < 4 else 300.0) for i in range(n)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    out = slo_json(f, "--plan", plan)
    assert out["inputs"]["plan"] == plan
    assert out["equal_budget"]["total_gpus"] == 8 and out["equal_budget"]["gpus"] == \
        {"aggregated": 8, "disaggregated": 8}
    assert out["untested"] == [{"cache_state": "cold", "deployment": "disaggregated",
                                "offered_rate_rps": 4.0}]
    for g in out["groups"]:
        assert g["counts"]["warmup_excluded"] == 4
        # the last request (2 rps), the last two (4 rps) finish after the declared 10 s
        assert g["window"] == {"window_s": 10.0, "source": "declared", "sent_after_window": 0,
                               "finished_after_window": {2.0: 1, 4.0: 2}[g["offered_rate_rps"]]}
        assert g["attainment"]["of_all_offered_pct"] == 100.0 and g["passed"] is True
    assert out["verdict"]["text"].startswith("inconclusive")
    assert "8 GPUs each, checked by the plan" in out["verdict"]["text"]
    assert out["criteria"]["request_deadline_ms"] == 60000.0


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(deployment="agg"), "deployment 'agg' is not in the plan (aggregated, disaggregated)"),
    (lambda r: r.update(offered_rate_rps=3.0), "offered rate 3 rps is not in the plan's offered_rates_rps (2, 4)"),
])
def test_records_must_match_the_plan(tmp_path, mutate, message):
    plan = small_plan(tmp_path)
    rows = [req(i, rate=2.0) for i in range(10)]
    mutate(rows[6])
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    rc, out, err = slo_inproc("analyze", f, "--plan", plan)
    assert rc == 2 and out == ""
    assert err.strip() == f"kvbench slo: error: {f}:7: {message}"


@pytest.mark.parametrize("state, message", [
    (None, "the plan runs every rate once per cache state (cold, warm): the record must say which "
           "(cache_state; convert --cache-state)"),
    ("lukewarm", "cache state 'lukewarm' is not in the plan's cache_state (cold, warm)"),
])
def test_records_must_carry_one_of_the_plans_cache_states(tmp_path, state, message):
    plan = small_plan(tmp_path, cache_state=["cold", "warm"])
    rows = [{**req(i, rate=2.0), "cache_state": "cold"} for i in range(10)]
    rows[6]["cache_state"] = state
    if state is None:
        del rows[6]["cache_state"]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    rc, out, err = slo_inproc("analyze", f, "--plan", plan)
    assert rc == 2 and err.strip() == f"kvbench slo: error: {f}:7: {message}"


def test_each_cache_state_is_its_own_run_with_its_own_capacity(tmp_path):
    plan = small_plan(tmp_path, cache_state=["cold", "warm"])
    rows = []
    for state, slow in (("cold", 9000.0), ("warm", 300.0)):  # cold misses TTFT after warm-up
        for rate in (2.0, 4.0):
            n = 4 + int(10 * rate)
            rows += [{**req(i, rate=rate, ttft=slow if i >= 4 else 300.0), "cache_state": state}
                     for i in range(n)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    out = slo_json(f, "--plan", plan)
    assert [(g["cache_state"], g["offered_rate_rps"], g["passed"]) for g in out["groups"]] == \
        [("cold", 2.0, False), ("cold", 4.0, False), ("warm", 2.0, True), ("warm", 4.0, True)]
    assert [(c["cache_state"], c["status"]) for c in out["capacity"]] == \
        [("cold", "below_lowest"), ("warm", "not_reached")]
    assert len(out["untested"]) == 4 and {u["deployment"] for u in out["untested"]} == {"disaggregated"}
    assert [v["cache_state"] for v in out["verdicts"]] == ["cold", "warm"]


def test_limit_flags_conflict_with_a_plan(tmp_path):
    plan = small_plan(tmp_path)
    f = write_jsonl(tmp_path / "p.jsonl", [req(0, rate=2.0)])
    rc, _, err = slo_inproc("analyze", f, "--plan", plan, "--ttft-max-ms", "10")
    assert rc == 2 and "--ttft-max-ms conflicts with --plan" in err


# ---------------------------------------------------------------------------
# bad input: one clear line, exit status 2, nothing written


def _bad(i: int, **fields) -> dict:
    r = req(i)
    r.update(fields)
    return r


@pytest.mark.parametrize("line, message", [
    ("{not json", ":3: not valid JSON"),
    (json.dumps(_bad(2, actual_send_ms=-1.0)), ":3: actual_send_ms: must be >= 0, got -1.0"),
    (json.dumps(_bad(2, chunk_times_ms=[2400.0, 2390.0])), ":3: chunk_times_ms: not monotonic: [1]=2390.0 < [0]=2400.0"),
    (json.dumps(_bad(2, status="cancelled")), ":3: status: must be 'ok', 'error', 'rejected' or 'timeout', got 'cancelled'"),
    (json.dumps(_bad(2, first_token_ms=5.0)), ":3: first_token_ms=5.0 differs from chunk_times_ms[0]"),
    (json.dumps(_bad(2, chunk_times_ms=[1.0])), ":3: first token at 1.0 ms is before the send at 2000.5 ms"),
    (json.dumps(_bad(2, ttft_ms=3.0)), ":3: ttft_ms: unknown key (put free-form data under 'meta')"),
    (json.dumps(_bad(2, schema="kvbench.p2p/1")), ":3: schema: must be 'kvbench.slo.request/1', got 'kvbench.p2p/1'"),
    (json.dumps(_bad(2, offered_rate_rps=0)), ":3: offered_rate_rps: must be > 0, got 0"),
    (json.dumps(_bad(2, output_tokens=3)), ":3: chunk_tokens add up to 16, output_tokens is 3"),
    (json.dumps(_bad(1)), ":3: duplicate request_id 'aggregated-1-1' for aggregated at 1 rps (first at"),
    (json.dumps({k: v for k, v in _bad(2).items() if k != "status"}), ":3: status: missing"),
])
def test_bad_records_are_one_line_with_file_and_line(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(req(0)) + "\n" + json.dumps(req(1)) + "\n" + line + "\n")
    out_file = tmp_path / "report.json"
    rc, out, err = slo_inproc("analyze", str(f), *LIMITS, "--denominator", "successful",
                              "--attainment-min", "0.9", "--out", str(out_file))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvbench slo: error: {f}:")
    assert message in err
    assert not out_file.exists()


@pytest.mark.parametrize("args, message", [
    ((*LIMITS, "--attainment-min", "0.9"), "declare the attainment denominator: --denominator"),
    ((*LIMITS, "--denominator", "everyone", "--attainment-min", "0.9"), "argument --denominator: invalid choice"),
    ((*LIMITS, "--denominator", "successful"), "declare the attainment gate: --attainment-min"),
    (("--denominator", "successful", "--attainment-min", "0.9"), "declare at least one latency limit"),
    ((*LIMITS, "--denominator", "successful", "--attainment-min", "95"),
     "argument --attainment-min: expected a fraction in 0..1 (0.95 means 95%), got '95'"),
])
def test_undeclared_or_bad_acceptance_is_refused(tmp_path, args, message):
    f = write_jsonl(tmp_path / "ok.jsonl", [req(i) for i in range(3)])
    rc, out, err = slo_inproc("analyze", f, *args)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1


def test_never_overwrites_and_python_m_reports_one_line(tmp_path):
    f = write_jsonl(tmp_path / "ok.jsonl", [req(i) for i in range(3)])
    existing = tmp_path / "report.json"
    existing.write_text("keep me")
    res = run_cli("kvbench.slo", "analyze", f, *LIMITS, "--denominator", "successful",
                  "--attainment-min", "0.9", "--out", str(existing))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"kvbench slo: error: refusing to overwrite existing file {existing}"
    assert existing.read_text() == "keep me"


# ---------------------------------------------------------------------------
# plots


def test_plot_writes_an_image_and_the_json_report(tmp_path):
    pytest.importorskip("matplotlib")
    f = write_jsonl(tmp_path / "sweep.jsonl", sweep_rows())
    png, report = tmp_path / "sweep.png", tmp_path / "sweep.json"
    res = run_cli("kvbench.slo", "analyze", f, *LIMITS, "--denominator", "all_offered_after_warmup",
                  "--attainment-min", "0.85", "--plot", str(png), "--out", str(report))
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads(report.read_text())["verdict"]["winner"] == "disaggregated"


def test_plot_without_matplotlib_says_how_to_install(tmp_path):
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    f = write_jsonl(tmp_path / "ok.jsonl", [req(i) for i in range(3)])
    import os

    env = {**os.environ, "PYTHONPATH": str(fake)}
    png = tmp_path / "x.png"
    res = run_cli("kvbench.slo", "analyze", f, *LIMITS, "--denominator", "successful",
                  "--attainment-min", "0.9", "--plot", str(png), env=env)
    assert res.returncode == 2
    assert res.stderr.strip() == "kvbench slo: error: --plot needs matplotlib: pip install kvbench[plot]"
    assert not png.exists()


def test_too_few_requests_cannot_show_a_stable_queue(tmp_path):
    f = write_jsonl(tmp_path / "few.jsonl", [req(i) for i in range(5)])
    (g,) = slo_json_in(f, *LIMITS, "--denominator", "successful", "--attainment-min", "0.9")["groups"]
    gate = next(x for x in g["gates"] if x["name"] == "queue_stability")
    assert g["queue"]["growing"] is None and g["queue"]["achieved_over_offered"] is None
    assert gate["passed"] is False and gate["detail"] == "too few requests after warm-up (5) to judge a trend"
    assert g["failed_gates"] == ["queue_stability"]
