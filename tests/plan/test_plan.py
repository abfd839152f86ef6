"""kvbench plan and kvbench plan route, through the CLI, on fits made by the real kvbench fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbench.plan.route import LinkCost, breakeven, decide, interference_at
from tests.conftest import run_cli
from tests.helpers import p2p_record, synthetic, write_jsonl
from tests.plan.helpers import BPT_8B, bad, kv_records, make_fit, run_json

BPT_70B = 327_680


# ---------------------------------------------------------------------------
# floors from user rates: the tutorial's numbers


def test_tutorial_floors_from_given_rates():
    out = run_json("--gbps", "100,25,10", "--setup-ms", "1", "--prompt-tokens", "300,2000",
                   "--budget-ms", "20")
    assert out["schema"] == "kvbench.plan/1" and out["model"] == "seed-70b-gqa"
    rows = {(r["effective_gb_s"], r["prompt_tokens"]): r for r in out["rows"]}
    assert len(rows) == 6
    expect = {(100, 2000): (7.5536, True), (25, 2000): (27.2144, False),
              (10, 2000): (66.5360, False), (10, 300): (10.8304, True)}
    for key, (floor, ok) in expect.items():
        r = rows[key]
        assert round(r["handoff_floor_ms"], 4) == floor
        assert r["within_budget"] is ok
        assert r["setup_ms"] == 1.0 and r["includes_setup"] is False
        assert round(r["handoff_floor_ms"] - r["bandwidth_floor_ms"], 6) == 1.0
        assert r["kv_bytes"] == key[1] * BPT_70B
        assert r["measured_p50_ms"] is None and r["measured_p99_ms"] is None
    assert rows[(10, 2000)]["bandwidth_floor_ms"] == 65.536


def test_end_to_end_rate_never_gets_setup_added():
    out = run_json("--gbps", "10", "--includes-setup", "--prompt-tokens", "2000")
    (r,) = out["rows"]
    assert r["includes_setup"] is True and r["setup_ms"] is None
    assert r["handoff_floor_ms"] == r["bandwidth_floor_ms"] == 65.536
    assert "end to end" in r["link"]


def test_table_format_shows_separate_columns():
    res = run_cli("kvbench.plan", "--gbps", "100,25,10", "--setup-ms", "1", "--format", "table")
    assert res.returncode == 0, res.stderr
    assert "setup ms" in res.stdout and "bw floor ms" in res.stdout and "handoff ms" in res.stdout
    for v in ("7.5536", "27.2144", "66.5360", "65.5360", "OVER"):
        assert v in res.stdout
    res = run_cli("kvbench.plan", "--gbps", "10", "--includes-setup", "--format", "table")
    assert "in rate" in res.stdout


# ---------------------------------------------------------------------------
# floors from a fit


def test_plan_from_fit_with_measured_beside_floor(tmp_path):
    fitted = make_fit(tmp_path, kv_records([16, 64, 256, 1024], 0.5, 5.0, seed=3))
    fdoc = json.loads(open(fitted).read())
    (g,) = fdoc["groups"]
    out = run_json("--fit", fitted, "--model", "llama-3.1-8b", "--prompt-tokens", "64,2000",
                   "--budget-ms", "20")
    assert out["source"] == fitted
    r64, r2000 = out["rows"]
    for r in (r64, r2000):
        assert r["source"] == "fit" and r["group"]["transport"] == "gloo"
        assert r["setup_ms"] == g["setup_ms"] and r["effective_gb_s"] == g["effective_gb_s"]
        assert r["bandwidth_floor_ms"] == pytest.approx(
            r["kv_bytes"] / (g["effective_gb_s"] * 1e9) * 1000, rel=1e-6)
        assert r["handoff_floor_ms"] == pytest.approx(r["setup_ms"] + r["bandwidth_floor_ms"],
                                                      abs=2e-6)
        lo, hi = r["handoff_floor_ms_band95"]
        assert lo <= r["handoff_floor_ms"] <= hi
        assert r["within_budget"] is (r["handoff_floor_ms"] <= 20)
    assert r64["kv_bytes"] == 64 * BPT_8B
    size64 = next(s for s in g["sizes"] if s["bytes"] == 64 * BPT_8B)
    assert r64["measured_p50_ms"] == size64["p50_ms"]
    assert r64["measured_p99_ms"] is None  # 20 samples cannot support a p99
    assert r64["measured_n"] == 20
    assert r64["handoff_floor_ms"] == pytest.approx(0.5 + 64 * BPT_8B / 5e9 * 1e3, rel=0.02)
    assert r2000["measured_p50_ms"] is None  # never measured: no number invented
    assert r2000["within_budget"] is False  # 262 MB at 5 GB/s is 52 ms
    assert any("extrapolated" in n for n in r2000["notes"])
    assert r64["notes"] == []
    res = run_cli("kvbench.plan", "--fit", fitted, "--model", "llama-3.1-8b",
                  "--prompt-tokens", "64", "--format", "table")
    assert res.returncode == 0 and f"{size64['p50_ms']:.4f}" in res.stdout
    lo, hi = r64["handoff_floor_ms_band95"]
    assert f"{lo:.4f}..{hi:.4f}" in res.stdout and "n<100" in res.stdout


def test_band_comes_from_the_joint_draws(tmp_path):
    fitted = make_fit(tmp_path, kv_records([16, 64, 256, 1024], 0.5, 5.0, seed=4))
    (g,) = json.loads(open(fitted).read())["groups"]
    draws = np.array(g["draws"]["values"])
    out = run_json("--fit", fitted, "--model", "llama-3.1-8b", "--prompt-tokens", "200")
    (r,) = out["rows"]
    floor = np.maximum(draws[:, 0], 0) + draws[:, 1] * r["kv_bytes"] / 1e9
    assert r["handoff_floor_ms_band95"] == pytest.approx(np.percentile(floor, [2.5, 97.5]),
                                                         rel=1e-5)
    # the old band joined the ends of two marginal intervals: wider than the joint one
    s_lo, s_hi = g["setup_ms_ci95"]
    r_lo, r_hi = g["effective_gb_s_ci95"]
    ends = (s_lo + r["kv_bytes"] / (r_hi * 1e9) * 1e3, s_hi + r["kv_bytes"] / (r_lo * 1e9) * 1e3)
    lo, hi = r["handoff_floor_ms_band95"]
    assert ends[0] < lo < hi < ends[1]


def test_no_band_without_draws_and_says_why(tmp_path):
    fitted = make_fit(tmp_path, synthetic([1 << 20, 1 << 22, 1 << 24], 0.2, 2.0, seed=2))
    (r,) = run_json("--fit", fitted, "--prompt-tokens", "100")["rows"]
    assert r["handoff_floor_ms_band95"] is None
    assert any(n.startswith("no band: 1 back-to-back block(s)") for n in r["notes"])


def test_plan_reads_a_fit1_file_and_skips_groups_that_are_not_links(tmp_path):
    fitted = make_fit(tmp_path, kv_records([16, 64, 256, 1024], 0.5, 5.0, seed=3))
    doc = json.loads(open(fitted).read())
    (g,) = doc["groups"]
    old = {**g, "group": {"transport": "gloo", "pattern": "sequential"}, "label": "seq"}
    old.pop("draws")
    compute = {**old, "group": {"transport": "gloo", "pattern": "layerwise",
                                "variant": "compute"}, "label": "layerwise compute"}
    isolated = {**old, "group": {"transport": "gloo", "pattern": "sharded",
                                 "variant": "isolated"}, "label": "sharded isolated"}
    v1 = tmp_path / "v1.fit.json"
    v1.write_text(json.dumps({"schema": "kvbench.fit/1", "groups": [old, compute, isolated]}))
    res = run_cli("kvbench.plan", "--fit", str(v1), "--prompt-tokens", "100")
    assert res.returncode == 0, res.stderr
    (r,) = json.loads(res.stdout)["rows"]
    assert r["link"] == "seq" and r["handoff_floor_ms_band95"] is None
    assert any("kvbench.fit/1 fit file has no joint draws" in n for n in r["notes"])
    (note,) = res.stderr.strip().splitlines()
    assert "[layerwise compute] (layerwise variant 'compute' includes the sender's compute)" in note
    assert "[sharded isolated] (sharded isolated: bytes summed over edges" in note


def test_plan_names_the_groups_fit_skipped(tmp_path):
    recs = kv_records([16, 64, 256], 0.5, 5.0) + synthetic(
        [1 << 20, 1 << 22], 0.1, 1.0, pattern="sharded", variant="isolated")
    fitted = make_fit(tmp_path, recs)
    res = run_cli("kvbench.plan", "--fit", fitted, "--model", "llama-3.1-8b",
                  "--prompt-tokens", "64")
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["rows"]) == 1
    (note,) = res.stderr.strip().splitlines()
    assert note.startswith("kvbench plan: note: skipped group(s): [") and "isolated" in note


def test_plan_uses_the_regime_the_payload_falls_in(tmp_path):
    sizes = [1 << k for k in range(12, 27, 2)]

    def t(b):
        return 0.02 + b / 1e9 * 1e3 if b < 600_000 else 0.5 + b / 5e9 * 1e3

    fitted = make_fit(tmp_path, synthetic(sizes, 0, 0, seed=8, time_fn=t, n=30))
    out = run_json("--fit", fitted, "--model", "llama-3.1-8b", "--prompt-tokens", "2,64")
    small, large = out["rows"]
    assert small["regime"] == "small" and large["regime"] == "large"
    assert small["effective_gb_s"] == pytest.approx(1.0, rel=0.05)
    assert large["effective_gb_s"] == pytest.approx(5.0, rel=0.03)
    assert "two_regimes" in large["fit_warnings"]
    assert any("large-message fit" in n for n in large["notes"])


def test_negative_fitted_setup_is_not_subtracted(tmp_path):
    fitted = make_fit(tmp_path, synthetic([1 << 20, 1 << 22, 1 << 24, 1 << 26], -0.3, 2.0,
                                          seed=5, noise=0.01))
    out = run_json("--fit", fitted, "--model", "llama-3.1-8b", "--prompt-tokens", "64")
    (r,) = out["rows"]
    assert r["setup_ms"] == 0.0
    assert r["handoff_floor_ms"] == r["bandwidth_floor_ms"]
    assert any("negative; used 0" in n for n in r["notes"])


def test_where_selects_groups(tmp_path):
    recs = synthetic([1 << 20, 1 << 24], 0.1, 2.0, seed=1) + synthetic(
        [1 << 20, 1 << 24], 0.1, 8.0, seed=2, transport="mpi")
    fitted = make_fit(tmp_path, recs)
    both = run_json("--fit", fitted, "--prompt-tokens", "100")
    assert len(both["rows"]) == 2
    one = run_json("--fit", fitted, "--prompt-tokens", "100", "--where", "transport=mpi")
    (r,) = one["rows"]
    assert r["group"]["transport"] == "mpi" and r["effective_gb_s"] == pytest.approx(8, rel=0.03)


# ---------------------------------------------------------------------------
# routing


def test_route_tutorial_short_prompt_case():
    res = run_cli("kvbench.plan", "route", "--gbps", "10", "--setup-ms", "1", "--prompt-tokens",
                  "300", "--local-interference-ms", "2", "--itl-p95-ms", "35",
                  "--itl-target-ms", "50")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["schema"] == "kvbench.route/1"
    (d,) = out["decisions"]
    assert d["verdict"] == "keep-local"
    assert round(d["handoff_floor_ms"], 4) == 10.8304
    assert round(d["added_ms"], 4) == 8.8304 and d["saved_ms"] is None
    assert d["itl_headroom_ms"] == 15 and d["slo_violated"] is False
    assert "evidence insufficient; no SLO violation claimed" in d["reason"]
    assert "at least 8.8304 ms" in d["reason"]
    (b,) = out["breakeven"]
    # constant 2 ms: only a prompt under ~30 tokens moves for less than it costs locally
    assert b["remote_floor_below_interference_for"] == "shorter prompts"
    assert b["prompt_tokens"] == 30
    table = run_cli("kvbench.plan", "route", "--gbps", "10", "--setup-ms", "1",
                    "--prompt-tokens", "300", "--local-interference-ms", "2", "--itl-p95-ms",
                    "35", "--itl-target-ms", "50", "--format", "table").stdout
    assert "keep-local" in table and "adds at least 8.8304 ms" in table
    assert "evidence insufficient; no SLO violation claimed" in table


def test_route_remote_candidate_and_breakeven_with_scaled_interference():
    # 0.05 ms of interference per token (5 ms measured at 100 tokens) against 1 ms + 0.032768
    # ms/token on the link: remote is cheaper from 1 / (0.05 - 0.032768) = 58.03 -> 59 tokens.
    out = run_json("route", "--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "30,300",
                   "--local-interference-ms", "5", "--interference-at-tokens", "100",
                   "--itl-p95-ms", "60", "--itl-target-ms", "50")
    short, long_ = out["decisions"]
    assert short["verdict"] == "keep-local" and short["slo_violated"] is True
    assert short["added_ms"] == pytest.approx(1 + 30 * BPT_70B / 1e10 * 1e3 - 1.5, abs=1e-6)
    assert "makes it worse" in short["reason"]
    assert long_["verdict"] == "remote-candidate"
    assert long_["local_interference_ms"] == 15
    assert long_["saved_ms"] == pytest.approx(15 - 10.8304, abs=1e-6)
    assert long_["itl_headroom_ms"] == -10
    (b,) = out["breakeven"]
    assert b["remote_floor_below_interference_for"] == "longer prompts"
    assert b["prompt_tokens"] == 59


def test_route_overlapped_exposes_only_the_last_layer():
    out = run_json("route", "--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "2000",
                   "--local-interference-ms", "2", "--itl-p95-ms", "35", "--itl-target-ms",
                   "50", "--handoff", "overlapped")
    (d,) = out["decisions"]
    assert d["handoff_floor_ms"] == 66.536
    assert d["exposed_handoff_ms"] == pytest.approx(655_360_000 / 80 / 1e10 * 1e3)  # 0.8192
    assert d["saved_ms"] == pytest.approx(2 - 0.8192)
    assert d["verdict"] == "keep-local"  # saves, but no violation: no claim
    assert "evidence insufficient; no SLO violation claimed" in d["reason"]


def test_route_from_fit(tmp_path):
    fitted = make_fit(tmp_path, kv_records([16, 64, 256, 1024], 0.5, 5.0, seed=3))
    out = run_json("route", "--fit", fitted, "--model", "llama-3.1-8b", "--prompt-tokens", "64",
                   "--local-interference-ms", "10", "--itl-p95-ms", "70", "--itl-target-ms", "50")
    (d,) = out["decisions"]
    g = json.loads(open(fitted).read())["groups"][0]
    assert d["setup_ms"] == g["setup_ms"] and d["effective_gb_s"] == g["effective_gb_s"]
    assert d["verdict"] == "remote-candidate"
    assert d["saved_ms"] == pytest.approx(10 - d["handoff_floor_ms"], abs=1e-6)


def test_route_functions_directly():
    link = LinkCost(10.0, 1.0)
    d = decide(300, 300 * BPT_70B, 80, link, 2.0, 35.0, 50.0)
    assert (d.verdict, round(d.added_ms, 4), d.saved_ms) == ("keep-local", 8.8304, None)
    e2e = LinkCost(10.0, None, includes_setup=True)
    d = decide(300, 300 * BPT_70B, 80, e2e, 2.0, 35.0, 50.0)
    assert round(d.handoff_floor_ms, 4) == 9.8304 and d.setup_ms is None
    with pytest.raises(ValueError):
        decide(300, 1, 80, link, 2.0, 35.0, 50.0, handoff="sideways")
    # f(t) = 1 + 0.032768 t - 0.05 t crosses zero between 58 and 59
    f = interference_at(5.0, 100)
    b = breakeven(lambda t: 1 + t * BPT_70B / 1e10 * 1e3 - f(t))
    assert (b.prompt_tokens, b.remote_floor_below_interference_for) == (59, "longer prompts")
    assert breakeven(lambda t: 1.0).remote_floor_below_interference_for == "no prompt length"
    assert breakeven(lambda t: -1.0).remote_floor_below_interference_for == "every prompt length"


# ---------------------------------------------------------------------------
# bad input: one line, exit 2


def test_bad_fit_files(tmp_path):
    assert "no such file" in bad("--fit", str(tmp_path / "none.json"))
    notjson = tmp_path / "x.json"
    notjson.write_text("{nope")
    assert "not valid JSON" in bad("--fit", str(notjson))
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"schema": "kvbench.fit/9", "groups": []}))
    assert "unknown fit schema 'kvbench.fit/9'" in bad("--fit", str(future))
    records = tmp_path / "records.jsonl"
    write_jsonl(records, [p2p_record(1 << 20, [1.0])])
    assert "unknown fit schema 'kvbench.p2p/1'" in bad("--fit", str(records))


def test_no_matching_group_and_group_without_rate(tmp_path):
    fitted = make_fit(tmp_path, synthetic([1 << 20, 1 << 24], 0.1, 2.0, seed=1))
    msg = bad("--fit", fitted, "--where", "transport=nccl")
    assert "no group in" in msg and "matches transport=nccl" in msg and "transport=gloo" in msg
    assert "unknown key" in bad("--fit", fitted, "--where", "colour=red")
    single = make_fit(tmp_path, synthetic([1 << 20], 0.1, 2.0), name="single")
    msg = bad("--fit", single)
    assert "is a link with a fitted rate" in msg and "fewer_than_two_sizes" in msg
    msg = bad("route", "--fit", single, "--prompt-tokens", "300", "--local-interference-ms", "2",
              "--itl-p95-ms", "35", "--itl-target-ms", "50", prog="kvbench plan route")
    assert "is a link with a fitted rate" in msg


@pytest.mark.parametrize("args,needle", [
    (("--prompt-tokens", "300"), "give the link"),
    (("--gbps", "10"), "--gbps needs --setup-ms"),
    (("--gbps", "10", "--includes-setup", "--setup-ms", "1"), "count setup twice"),
    (("--gbps", "0", "--setup-ms", "1"), "positive"),
    (("--gbps", "10", "--setup-ms", "-1"), "negative"),
    (("--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "0"), "positive"),
    (("--gbps", "10", "--setup-ms", "1", "--model", "gpt-9"), "unknown model"),
    (("--gbps", "10", "--setup-ms", "1", "--where", "transport=gloo"), "--where selects"),
    (("--gbps", "10", "--setup-ms", "1", "--budget-ms", "0"), "positive"),
    (("--fit", "x.json", "--gbps", "10"), "either --fit or --gbps"),
    (("--fit", "x.json", "--includes-setup"), "excludes setup by construction"),
    (("--bogus",), "unrecognized arguments"),
])
def test_bad_plan_arguments(args, needle):
    assert needle in bad(*args)


@pytest.mark.parametrize("args,needle", [
    (("--gbps", "10", "--setup-ms", "1", "--local-interference-ms", "2", "--itl-p95-ms", "35",
      "--itl-target-ms", "50"), "--prompt-tokens"),
    (("--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "300", "--itl-p95-ms", "35",
      "--itl-target-ms", "50"), "--local-interference-ms"),
    (("--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "300", "--local-interference-ms",
      "-2", "--itl-p95-ms", "35", "--itl-target-ms", "50"), "negative"),
    (("--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "300", "--local-interference-ms",
      "2", "--itl-p95-ms", "35", "--itl-target-ms", "50", "--handoff", "sideways"), "invalid choice"),
])
def test_bad_route_arguments(args, needle):
    assert needle in bad("route", *args, prog="kvbench plan route")


def test_out_file_is_never_overwritten(tmp_path):
    out = tmp_path / "plan.json"
    args = ("--gbps", "10", "--setup-ms", "1", "--out", str(out))
    assert run_cli("kvbench.plan", *args).returncode == 0
    assert json.loads(out.read_text())["rows"][0]["handoff_floor_ms"] == 66.536
    assert "refusing to overwrite" in bad(*args)


def _on_a_terminal(*argv: str) -> str:
    """stdout of `python -m ...argv` when stdout is a terminal (a pseudo-terminal)."""
    import os
    import pty
    import subprocess
    import sys

    from tests.conftest import ROOT

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=follower, stderr=subprocess.PIPE,
                            cwd=ROOT)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return b"".join(chunks).decode()


@pytest.mark.parametrize("command", [("kvbench.plan", "--gbps", "10", "--setup-ms", "1"),
                                     ("kvbench.plan", "route", "--gbps", "10", "--setup-ms", "1",
                                      "--local-interference-ms", "2", "--itl-p95-ms", "35",
                                      "--itl-target-ms", "50"),
                                     ("kvbench.model",)])
def test_a_table_on_a_terminal_and_json_when_piped(command):
    """plan printed JSON on a terminal by default; a person reads the table, a pipe gets JSON."""
    argv = (*command, "--prompt-tokens", "300")
    shown = _on_a_terminal(*argv)
    assert shown.lstrip()[:1] not in "[{" and "300" in shown, shown
    assert json.loads(_on_a_terminal(*argv, "--format", "json"))
    piped = run_cli(*argv)
    assert piped.returncode == 0 and json.loads(piped.stdout)
    assert run_cli(*argv, "--format", "table").stdout.lstrip()[:1] not in "[{"


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_standard_output_is_one_line_naming_it():
    """`kvbench plan > /dev/full` said "cannot use ?: No space left on device"."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "kvbench.plan", "--gbps", "10", "--setup-ms", "1"],
                             stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert res.returncode == 3 and res.stderr.count("\n") == 1, res.stderr
    assert "cannot write the output (standard output" in res.stderr and "?" not in res.stderr
