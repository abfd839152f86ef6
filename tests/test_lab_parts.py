"""kvbench.lab pieces that need no vLLM: config, plan reading, metrics parsing on real
captured text, process tracking with real process groups, the raw scraper, capacity cuts,
resume and the one-line refusals."""

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvbench.cli import UsageError
from kvbench.lab import procs, promtext
from kvbench.lab.config import LabConfigError, parse_lab
from kvbench.lab.planfile import load_lab_plan
from kvbench.lab.scrapeglue import Scraper, endpoint_args
from kvbench.lab.sweep import Point, open_out
from kvbench.lab.sweepreport import adjusted_capacity

ROOT = Path(__file__).resolve().parent.parent
METRICS = ROOT / "tests" / "data" / "metrics"
EXAMPLE = ROOT / "examples" / "lab-plan.yaml"


# --- config ---------------------------------------------------------------------------

def test_defaults_are_an_equal_budget():
    cfg = parse_lab({})
    assert cfg.aggregated_instances == cfg.prefill_instances + cfg.decode_instances == len(cfg.cores)


@pytest.mark.parametrize("section, words", [
    ({"aggregated": {"instances": 3}}, "not an equal core budget"),
    ({"disaggregated": {"prefill": 2, "decode": 1}}, "not an equal core budget"),
    ({"base_port": 18000}, "19000-19999"),
    ({"base_port": 19800}, "19000-19999"),
    ({"load": {"output_len": 1}}, "TPOT"),
    ({"kv_load_failure_policy": "retry"}, "fail or recompute"),
    ({"workarounds": {"pthr": 1}}, "unknown key"),
    ({"cores": [0, 0]}, "distinct"),
])
def test_bad_lab_sections_are_refused_with_the_field(section, words):
    with pytest.raises(LabConfigError, match=words):
        parse_lab(section)


def test_workarounds_switch_off():
    w = parse_lab({"workarounds": {"nixl_poll_delay_us": 0, "keep_model_thread_affinity": False}}).workarounds
    assert w.nixl_poll_delay_us == 0 and w.keep_model_thread_affinity is False


# --- plan -----------------------------------------------------------------------------

def test_example_plan_loads_with_its_lab_section():
    plan, lab_plan = load_lab_plan(EXAMPLE)
    assert lab_plan.cache_states == ("cold", "warm") and lab_plan.lab.kv_lease_s == 10
    assert plan.gpus == {"aggregated": 2, "disaggregated": 2}
    assert all(t.endpoint is None for t in lab_plan.targets.values())


def _without_lab(tmp_path, endpoints: bool) -> Path:
    text = EXAMPLE.read_text().split("\nlab:\n")[0]
    if endpoints:
        text = text.replace("  aggregated:\n", "  aggregated:\n    endpoint: http://10.0.0.1:8000\n"
                            "    metrics_endpoints: {aggregated: [http://10.0.0.1:8000/metrics]}\n")
        text = text.replace("  disaggregated:\n", "  disaggregated:\n    endpoint: http://10.0.0.2:8000\n")
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    return p


def test_plan_without_lab_needs_endpoints(tmp_path):
    with pytest.raises(UsageError, match="no endpoint"):
        load_lab_plan(_without_lab(tmp_path, endpoints=False))


def test_plan_with_endpoints_needs_no_lab(tmp_path):
    _, lab_plan = load_lab_plan(_without_lab(tmp_path, endpoints=True))
    assert lab_plan.lab is None
    assert lab_plan.targets["aggregated"].metrics_endpoints == {"aggregated": ["http://10.0.0.1:8000/metrics"]}


# --- metrics text captured from the real engine ----------------------------------------

def test_snapshot_of_captured_decode_metrics():
    snap = promtext.snapshot((METRICS / "vllm-0.32.0-decode.txt").read_text())
    # values as captured (see the file's header): 24 transfers, every prompt token external
    assert snap["nixl_xfer_count"] == 24 and snap["nixl_bytes_sum"] == 14155776
    assert snap["prompt_tokens_local_compute"] == 0 and snap["prompt_tokens_external_kv"] == 5563
    assert snap["kv_cache_usage_perc"] == 0.0 and snap["num_requests_running"] == 0


def test_histogram_of_captured_transfer_times():
    h = promtext.histogram((METRICS / "vllm-0.32.0-decode.txt").read_text(), "vllm:nixl_xfer_time_seconds")
    assert h["count"] == 24 and h["buckets"][0] == (0.005, 17.0) and h["buckets"][-1][0] == float("inf")
    q50 = promtext.bucket_quantile(h, 0.5)
    assert 0 < q50 <= 0.005  # 17 of 24 transfers fell in the first bucket


def test_bucket_quantile_interpolates_inside_a_bucket():
    h = {"buckets": [(1.0, 2.0), (2.0, 4.0), (float("inf"), 4.0)], "sum": 5.0, "count": 4.0}
    assert promtext.bucket_quantile(h, 0.5) == 1.0
    assert promtext.bucket_quantile(h, 0.75) == 1.5
    assert promtext.bucket_quantile({"buckets": [], "sum": 0, "count": 0}, 0.5) is None


def test_histogram_delta_is_what_happened_between_readings():
    a = {"buckets": [(1.0, 2.0), (float("inf"), 3.0)], "sum": 2.0, "count": 3.0}
    b = {"buckets": [(1.0, 5.0), (float("inf"), 7.0)], "sum": 6.5, "count": 7.0}
    assert promtext.histogram_delta(a, b) == {"buckets": [(1.0, 3.0), (float("inf"), 4.0)],
                                              "sum": 4.5, "count": 4.0}


# --- process groups ---------------------------------------------------------------------

def _spawn_tree(tmp_path, name="tree"):
    cmd = ["sh", "-c", "sleep 300 & sleep 300"]  # a leader and a child in one group
    return procs.spawn(name, "aggregated", cmd, dict(os.environ), 0, tmp_path / f"{name}.log")


def test_stop_ends_the_whole_process_group(tmp_path):
    svc = _spawn_tree(tmp_path)
    assert svc.alive() and svc.group_alive()
    assert procs.stop(svc, grace_s=5) == "stopped"
    assert not svc.group_alive()


def test_a_reused_pid_is_never_signalled(tmp_path):
    svc = _spawn_tree(tmp_path, "real")
    try:
        stale = procs.Service("old", "aggregated", svc.pid, svc.start_ticks - 1, 0, "x")
        assert not stale.alive()
        assert procs.stop(stale, grace_s=1) == "gone"
        assert svc.alive()  # the process that now owns the PID was left alone
    finally:
        procs.stop(svc, grace_s=5)


def test_stop_on_exit_stops_everything_on_an_exception(tmp_path):
    started = []
    with pytest.raises(RuntimeError), procs.stop_on_exit(started):
        started.append(_spawn_tree(tmp_path, "a"))
        started.append(_spawn_tree(tmp_path, "b"))
        raise RuntimeError("start-up failed half way")
    assert not any(s.group_alive() for s in started)


def test_state_round_trips(tmp_path):
    st = procs.LabState("aggregated", [procs.Service("agg0", "aggregated", 1, 2, 19001, "l", [0])],
                        "http://127.0.0.1:19000", {"aggregated": ["u"]}, {"start_s": 30})
    procs.write_state(tmp_path / "s.json", st)
    assert procs.LabState.from_json((tmp_path / "s.json").read_text()) == st


# --- raw scraper, capacity, resume -------------------------------------------------------

class _Metrics(http.server.BaseHTTPRequestHandler):
    body = (METRICS / "vllm-0.32.0-decode.txt").read_bytes()

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_raw_scraper_records_text_and_gaps(tmp_path, monkeypatch):
    monkeypatch.setattr("kvbench.lab.scrapeglue.slo_has_scrape", lambda: False)
    server = http.server.HTTPServer(("127.0.0.1", 19990), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        metrics = {"decode": ["http://127.0.0.1:19990/metrics"], "prefill": ["http://127.0.0.1:19991/metrics"]}
        s = Scraper(metrics, tmp_path / "scrape.jsonl", 1.5, {"deployment": "disaggregated"})
        s.start()
        s.stop()
    finally:
        server.shutdown()
    lines = [json.loads(x) for x in (tmp_path / "scrape.jsonl").read_text().splitlines()]
    assert lines[0]["header"]["deployment"] == "disaggregated"
    assert any("vllm:nixl_xfer_time_seconds" in x.get("text", "") for x in lines[1:])
    assert any(x["role"] == "prefill" and "gap" in x for x in lines[1:])  # nobody on 19991


def test_endpoint_args_name_each_role_once():
    assert endpoint_args({"aggregated": ["a", "b"], "decode": ["d"]}) == \
        ["aggregated-0=a", "aggregated-1=b", "decode=d"]


def test_a_run_without_result_cuts_capacity_below_it():
    cap = {"deployment": "aggregated", "tested_rates_rps": [2.0, 4.0], "capacity_rps": 4.0, "text": "x"}
    cut = adjusted_capacity(cap, [4.0])
    assert cut["capacity_rps"] == 2.0 and "stopped answering" in cut["text"]
    assert adjusted_capacity(cap, [2.0])["capacity_rps"] is None
    assert adjusted_capacity(cap, []) == cap


def test_sweep_folder_resumes_only_the_same_plan(tmp_path):
    out = tmp_path / "sweep"
    open_out(out, str(EXAMPLE), [])
    open_out(out, str(EXAMPLE), [])  # same plan: resume
    other = tmp_path / "other.yaml"
    other.write_text(EXAMPLE.read_text().replace("duration_seconds: 30", "duration_seconds: 31"))
    with pytest.raises(UsageError, match="different plan"):
        open_out(out, str(other), [])
    p = Point("cold", "aggregated", 2.0, 1)
    assert p.folder(out) == out / "runs" / "cold" / "aggregated" / "2rps-rep1"


# --- one-line refusals -------------------------------------------------------------------

def _kvbench(args, tmp_path):
    env = dict(os.environ, KVBENCH_LAB_HOME=str(tmp_path / "empty-lab-home"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path)


@pytest.mark.parametrize("args", [["lab", "up", str(EXAMPLE)], ["sweep", str(EXAMPLE)],
                                  ["faults", str(EXAMPLE)]])
def test_missing_lab_env_is_one_line_exit_2(args, tmp_path):
    r = _kvbench(args, tmp_path)
    assert r.returncode == 2 and "kvbench lab install" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_bad_fault_choice_is_one_line_exit_2(tmp_path):
    r = _kvbench(["faults", str(EXAMPLE), "--injections", "meteor"], tmp_path)
    assert r.returncode == 2 and "side_channel" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- the bounded load-generator run -------------------------------------------------------

def test_a_stalled_deployment_gets_the_run_killed(tmp_path):
    from kvbench.lab.bench import run_bounded

    ok, why = run_bounded(["sleep", "60"], tmp_path / "log", 50, progress=lambda: (7,), stall_s=1.0)
    assert not ok and "stopped answering" in why


def test_a_progressing_run_is_left_to_finish(tmp_path):
    from kvbench.lab.bench import run_bounded

    ticks = iter(range(1000))
    ok, why = run_bounded(["sleep", "4.5"], tmp_path / "log", 50, progress=lambda: next(ticks), stall_s=1.0)
    assert ok and why == ""


def test_the_hard_bound_kills_and_says_so(tmp_path):
    from kvbench.lab.bench import run_bounded

    ok, why = run_bounded(["sleep", "60"], tmp_path / "log", 1.0)
    assert not ok and "no result within" in why
