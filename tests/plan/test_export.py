"""`kvbench plan export`: one tool-neutral model, each tool's fragment derived from it.

The tutorial's vectors pin the arithmetic (80 layers x 8 KV heads x 128 x 2 B = 327,680
B/token; setup 1 ms + 10 GB/s at 300 tokens = 10.8304 ms; 100 GB/s at 2,000 = 7.5536 ms).
Dynamo's own replay checks its fragment in tests/plan/test_export_dynamo.py.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import committed, run_cli
from tests.plan.helpers import export, fit_file

FIT = committed("tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json")


def model_doc(fit, *args) -> dict:
    rc, out, err = export("--fit", fit, "--to", "json", *args)
    assert rc == 0, err
    return json.loads(out)


def test_the_model_is_the_tutorials_arithmetic(tmp_path):
    doc = model_doc(fit_file(tmp_path), "--fold-at-tokens", "300")
    assert doc["schema"] == "kvbench.kv-transfer-model/1"
    assert doc["bytes_per_token_per_rank"] == doc["bytes_per_token_all_ranks"] == 327_680
    assert doc["handoff_ms"]["300"] == pytest.approx(10.8304, abs=1e-9)
    assert doc["handoff_ms"]["2000"] == pytest.approx(66.536, abs=1e-9)
    assert doc["transport"] == "nixl" and doc["setup_ms_ci95"] == [0.5, 1.5]
    blis = doc["tools"]["blis"]
    assert blis["parameters"] == {"--pd-transfer-bandwidth": 10.0, "--pd-transfer-base-latency": 1.0,
                                  "--pd-kv-bytes-per-token": 327_680}
    assert all(abs(e) < 1e-9 for e in blis["error_vs_model_ms"].values())  # BLIS has both terms
    fold = doc["fold"]["effective_gb_s_with_setup"]
    assert fold == pytest.approx(300 * 327_680 / 10.8304e-3 / 1e9)
    dyn = doc["tools"]["dynamo"]
    assert dyn["parameters"]["kv_transfer_bandwidth"] == fold
    assert dyn["error_vs_model_ms"]["300"] == pytest.approx(0, abs=1e-9)  # exact at the fold length
    assert dyn["error_vs_model_ms"]["500"] > 0 > -dyn["error_vs_model_ms"]["500"]  # longer: predicted long
    assert "setup_ms 1 is folded" in dyn["cannot_represent"][0]


def test_tensor_parallel_splits_bytes_per_rank(tmp_path):
    doc = model_doc(fit_file(tmp_path, effective_gb_s=100.0), "--tp", "4")
    assert doc["bytes_per_token_per_rank"] == 327_680 // 4 and doc["tp"] == 4
    assert doc["handoff_ms"]["2000"] == pytest.approx(1.0 + 2000 * 81_920 / 100e9 * 1000)
    replicated = model_doc(fit_file(tmp_path, name="f2.json"), "--tp", "16")
    assert replicated["bytes_per_token_per_rank"] == 327_680 // 8  # 8 KV heads: one per rank, replicated
    assert "replicated" in replicated["tp_note"]


def test_drop_keeps_the_bandwidth_term_only(tmp_path):
    doc = model_doc(fit_file(tmp_path), "--setup-as", "drop")
    dyn = doc["tools"]["dynamo"]
    assert dyn["parameters"]["kv_transfer_bandwidth"] == 10.0
    assert all(e == pytest.approx(-1.0) for e in dyn["error_vs_model_ms"].values())  # short by setup


def test_each_format_is_what_the_tool_reads(tmp_path):
    fit = fit_file(tmp_path)
    rc, out, _ = export("--fit", fit, "--to", "aisimulate")
    kv = yaml.safe_load(out)["engine"]["kv_transfer"]
    assert set(kv) == {"bytes_per_token", "bandwidth_gb_per_second", "timing_mode"} and kv["timing_mode"] == "full_prompt"
    rc, out, _ = export("--fit", fit, "--to", "dynamo")
    body = json.loads("".join(ln for ln in out.splitlines(True) if not ln.startswith("#")))
    assert set(body["engine"]) == {"kv_transfer_bandwidth", "kv_transfer_bytes_per_token"}
    assert "cannot represent: a per-handoff setup term" in out
    rc, out, _ = export("--fit", fit, "--to", "blis")
    assert out.splitlines()[-1] == "--pd-transfer-bandwidth 10.0 --pd-transfer-base-latency 1.0 --pd-kv-bytes-per-token 327680"
    rc, out, _ = export("--fit", fit, "--to", "splitwise")
    assert yaml.safe_load(out)["transfer_bandwidth"] == pytest.approx(
        json.loads(export("--fit", fit, "--to", "json")[1])["fold"]["effective_gb_s_with_setup"] * 1e9 / 2**30)


def test_a_real_fit_exports_through_link(tmp_path):
    res = run_cli("kvbench.plan", "export", "--fit", str(FIT), "--to", "json", "--out", str(tmp_path / "m.json"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["setup_ms"] == 7.17611 and doc["effective_gb_s"] == 1.38019
    assert doc["context"]["fit_warnings"] == ["intercept_not_distinguishable_from_zero"]


@pytest.mark.parametrize("args, message", [
    (["--to", "json", "--tp", "3"], "TP 3 does not divide kv_heads 8"),
    (["--to", "json", "--tp", "0"], "argument --tp: must be a positive integer"),
    (["--to", "json", "--fold-at-tokens", "1e400"], "argument --fold-at-tokens: must be a positive integer"),
    (["--to", "vllm"], "argument --to: invalid choice: 'vllm'"),
    (["--to", "json", "--where", "transport=mpi"], "no group in"),
])
def test_bad_export_arguments(tmp_path, args, message):
    rc, out, err = export("--fit", fit_file(tmp_path), *args)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1


def test_several_links_need_where(tmp_path):
    fit = fit_file(tmp_path, groups=2)
    rc, _, err = export("--fit", fit, "--to", "blis")
    assert rc == 2 and "holds 2 fitted links; pick one with --where" in err
    rc, out, err = export("--fit", fit, "--to", "blis", "--where", "n=1")
    assert rc == 0 and "link 1" in out
