"""`kvbench slo convert-vllm`: a vllm bench serve --save-result --save-detailed file, converted
and analyzed; the numbers must agree with vLLM's own definitions (TTFT, TPOT per request, ITL
per chunk)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvbench.slo.cli
from tests.conftest import run_cli
from tests.helpers import run, vllm_result


def write(path, *docs) -> str:
    path.write_text("\n".join(json.dumps(d) for d in docs))
    return str(path)


def convert_inproc(*args) -> tuple[int, str, str]:
    return run(kvbench.slo.cli.cli, "convert-vllm", *args)  # what `kvbench slo convert-vllm` calls


def test_convert_then_analyze_agrees_with_vllm_definitions(tmp_path):
    src = write(tmp_path / "vllm.json", vllm_result())
    out = tmp_path / "agg.jsonl"
    res = run_cli("kvbench.slo", "convert-vllm", src, "--deployment", "aggregated", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (f"{out}: 6 records (1 error, 3 ok, 1 rejected, 1 timeout) "
                                  "for aggregated at 4 rps")
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in recs] == ["ok", "ok", "rejected", "timeout", "error", "ok"]
    assert [r["actual_send_ms"] for r in recs] == [0.0, 250.0, 500.0, 750.0, 1000.0, 1250.0]
    assert all(r["scheduled_send_ms"] is None and r["offered_rate_rps"] == 4.0 for r in recs)
    assert recs[0]["first_token_ms"] == 250.0 and recs[0]["chunk_times_ms"][-1] == pytest.approx(390.0)
    assert recs[0]["chunk_tokens"] == [1] * 8 and recs[1]["chunk_tokens"] is None
    assert recs[1]["output_tokens"] == 8 and len(recs[1]["chunk_times_ms"]) == 4
    assert recs[0]["end_ms"] == pytest.approx(390.0) and recs[0]["input_tokens"] == 512
    assert recs[3]["error"].endswith("TimeoutError\n") and recs[2]["output_tokens"] == 0

    res = run_cli("kvbench.slo", "analyze", str(out), "--ttft-max-ms", "280", "--tpot-max-ms", "30",
                  "--denominator", "all_offered_after_warmup", "--attainment-min", "0.5", "--format", "json")
    assert res.returncode == 0, res.stderr
    (g,) = json.loads(res.stdout)["groups"]
    c, lat = g["counts"], g["latency_ms"]
    assert (c["ok"], c["rejected"], c["timeout"], c["error"]) == (3, 1, 1, 1)
    assert g["error_rate_pct"] == 50.0
    doc = vllm_result()
    ok = [i for i, e in enumerate(doc["errors"]) if not e]
    ttfts_ms = [doc["ttfts"][i] * 1000 for i in ok]
    tpots_ms = [(doc["latencies"][i] - doc["ttfts"][i]) / (doc["output_lens"][i] - 1) * 1000 for i in ok]
    itls_ms = [x * 1000 for i in ok for x in doc["itls"][i]]  # vLLM pools ITL over chunks
    for name, samples in (("ttft", ttfts_ms), ("tpot", tpots_ms), ("itl_per_chunk", itls_ms)):
        assert lat[name]["n"] == len(samples)
        for q in (50, 95, 99):
            assert lat[name][f"p{q}_ms"] == pytest.approx(np.percentile(samples, q)), (name, q)
    # TTFT 300 ms of the second request misses the 280 ms limit: 2 of 3 ok, 2 of 6 offered
    assert g["attainment"]["numerator_count"] == 2
    assert g["attainment"]["of_all_offered_pct"] == pytest.approx(100 * 2 / 6)
    lag = next(x for x in g["gates"] if x["name"] == "client_send_lag")
    assert lag["passed"] is None and "no scheduled_send_ms" in lag["detail"]


def test_stdout_output_and_append_result_files(tmp_path):
    src = write(tmp_path / "two.json", vllm_result(), vllm_result(request_rate=8.0))
    rc, _, err = convert_inproc(src, "--deployment", "disaggregated")
    assert rc == 2 and "holds 2 results (written with --append-result); choose one with --index 0..1" in err
    rc, out, err = convert_inproc(src, "--deployment", "disaggregated", "--index", "1")
    assert rc == 0 and err == ""
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 6 and {x["offered_rate_rps"] for x in lines} == {8.0}
    assert {x["deployment"] for x in lines} == {"disaggregated"}


def test_client_concurrency_cap_is_noted(tmp_path):
    src = write(tmp_path / "cap.json", vllm_result(max_concurrency=16))
    rc, _, err = convert_inproc(src, "--deployment", "aggregated", "--out", str(tmp_path / "o.jsonl"))
    assert rc == 0 and err.startswith("note: max_concurrency=16: vLLM held requests back at the client")


@pytest.mark.parametrize("doc, args, message", [
    (vllm_result(request_rate="inf"), (),
     "request_rate is 'inf', not a finite offered rate (an open-loop SLO analysis needs one); pass --offered-rate RPS"),
    (vllm_result(), ("--offered-rate", "5"), "--offered-rate 5 differs from the file's request_rate 4"),
    ({k: v for k, v in vllm_result().items() if k not in ("start_times", "ttfts", "itls", "errors",
                                                          "output_lens", "input_lens", "generated_texts")},
     (), "no start_times, ttfts, itls, output_lens, errors: run vllm bench serve with --save-result --save-detailed"),
    (vllm_result(ramp_up_strategy="linear"), (), "a ramp-up run (linear) has no single offered rate"),
    (vllm_result(itls=[[0.01]] * 5), (), "itls must be a list of 6 entries, one per request"),
    (vllm_result(ttfts=[0.25, -0.1, 0, 0, 0, 0.2]), (), "ttfts[1]: must be >= 0, got -0.1"),
])
def test_bad_vllm_files_are_one_line(tmp_path, doc, args, message):
    src = write(tmp_path / "v.json", doc)
    out = tmp_path / "o.jsonl"
    rc, stdout, err = convert_inproc(src, "--deployment", "aggregated", "--out", str(out), *args)
    assert rc == 2 and stdout == "" and err.count("\n") == 1
    assert message in err
    assert not out.exists()


def test_inf_rate_with_an_explicit_offered_rate_converts(tmp_path):
    src = write(tmp_path / "inf.json", vllm_result(request_rate="inf"))
    rc, out, _ = convert_inproc(src, "--deployment", "aggregated", "--offered-rate", "4")
    assert rc == 0 and all(json.loads(x)["offered_rate_rps"] == 4.0 for x in out.splitlines())


def test_not_json_and_never_overwrite(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ttfts": [0.1,\n  oops]}')
    rc, _, err = convert_inproc(str(bad), "--deployment", "a")
    assert rc == 2 and f"{bad}:2: not valid JSON" in err
    src = write(tmp_path / "v.json", vllm_result())
    existing = tmp_path / "exists.jsonl"
    existing.write_text("keep")
    rc, _, err = convert_inproc(src, "--deployment", "a", "--out", str(existing))
    assert rc == 2 and "refusing to overwrite existing file" in err and existing.read_text() == "keep"


def test_cache_state_is_written_into_every_record(tmp_path):
    src = write(tmp_path / "r.json", vllm_result())
    rc, out, err = convert_inproc(src, "--deployment", "aggregated", "--cache-state", "warm")
    assert rc == 0, err
    assert {json.loads(x)["cache_state"] for x in out.splitlines()} == {"warm"}
    rc, _, err = convert_inproc(src, "--deployment", "aggregated", "--cache-state", " ")
    assert rc == 2 and "--cache-state must not be empty" in err
