"""kvbench.lab pieces that need no vLLM: the `lab:` section, plan reading through slo, metric
snapshots of real captured text, process tracking with real process groups, `kvbench slo
scrape` driven by the sweep, the report assembled from slo's analysis, capacity cuts, resume
and the one-line refusals."""

import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvbench.cli import UsageError
from kvbench.lab.config import parse_lab
from kvbench.lab.load import snapshot
from kvbench.lab.planfile import load_lab_plan, load_lab_section
from kvbench.lab.stack import procs
from kvbench.lab.sweep.main import Point, open_out, points, scrape_endpoints, scraping, set_aside
from kvbench.lab.sweep.report import adjusted_capacity
from tests.conftest import committed, free_port, jsonl_kinds, wait_for

ROOT = Path(__file__).resolve().parents[2]
METRICS = ROOT / "tests" / "data" / "metrics"
EXAMPLE = ROOT / "examples" / "lab-plan.yaml"
FIT2 = committed("tests/data/runs/shaped-link/kvbench-p2p-20261203T092334Z.fit.json")  # kvbench.fit/2


# --- config ---------------------------------------------------------------------------

def test_defaults_are_an_equal_budget():
    cfg = parse_lab({})
    assert cfg.aggregated_instances == cfg.prefill_instances + cfg.decode_instances == len(cfg.cores)


@pytest.mark.parametrize("section, words", [
    ({"aggregated": {"instances": 3}}, "plan: lab: not an equal core budget"),
    ({"disaggregated": {"prefill": 2, "decode": 1}}, "not an equal core budget"),
    ({"base_port": 18000}, "lab.base_port: the lab uses base_port..base_port+299, which must lie in 19000-19999"),
    ({"base_port": 19800}, "19000-19999, got 19800"),
    ({"load": {"output_len": 1}}, "lab.load.output_len: must be >= 2, got 1"),
    ({"load": {"input_len": 1000}}, "exceeds max_model_len 1024"),
    ({"load": {"model": "<served model name>"}}, "lab.load.model: placeholder '<served model name>' not filled in"),
    ({"kv_load_failure_policy": "retry"}, "lab.kv_load_failure_policy: must be 'fail' or 'recompute', got 'retry'"),
    ({"workarounds": {"pthr": 1}}, "lab.workarounds.pthr: unknown key"),
    ({"cores": [0, 0]}, "lab.cores: must list distinct core numbers"),
    ({"cores": ["0", 1]}, "lab.cores[0]: must be an integer, got '0'"),
    ({"kv_lease_s": True}, "lab.kv_lease_s: must be an integer, got True"),
    ({"kv_lease_s": 10**30}, "lab.kv_lease_s: must be <= 86400"),
    ({"model": {"hidden": 250}}, "hidden (250) must be a multiple of heads (4)"),
    (["not", "a", "mapping"], "lab: must be an object"),
])
def test_bad_lab_sections_are_refused_with_the_field(section, words):
    with pytest.raises(UsageError) as exc:
        parse_lab(section)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_workarounds_switch_off_and_unset_keys_keep_their_defaults():
    cfg = parse_lab({"workarounds": {"nixl_poll_delay_us": 0}, "load": {"output_len": 16}})
    assert cfg.workarounds.nixl_poll_delay_us == 0 and cfg.workarounds.keep_model_thread_affinity is True
    assert cfg.load.output_len == 16 and cfg.load.input_len == 256 and cfg.model.layers == 4
    w = parse_lab({"workarounds": {"keep_model_thread_affinity": False}}).workarounds
    assert w.nixl_poll_delay_us == 1000 and w.keep_model_thread_affinity is False


# --- plan -----------------------------------------------------------------------------

def test_example_plan_is_the_tutorials_form_with_a_lab_section():
    plan, lab = load_lab_plan(EXAMPLE)
    assert plan.form == "tutorial" and plan.cache_states == ("cold", "warm") and lab.kv_lease_s == 10
    assert plan.gpus == {"aggregated": 2, "disaggregated": 2}
    assert set(plan.metrics) == {"client", "scheduler", "kv_transfer"}
    assert all(d.endpoint is None for d in plan.deployment_specs.values())
    pts = points(plan, repeats=2)
    assert len(pts) == 2 * len(plan.runs()) == 32
    assert [p.deployment for p in pts] == sorted(p.deployment for p in pts)  # one deployment at a time
    assert load_lab_section(EXAMPLE) == lab and load_lab_section(None) == parse_lab({})


def _plan(tmp_path, text: str) -> Path:
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    return p


def _without_lab(tmp_path, endpoints: bool) -> Path:
    text = EXAMPLE.read_text().split("\nlab:\n")[0]
    if endpoints:
        text = text.replace("  aggregated:                        #", "  aggregated:\n"
                            "    endpoint: http://10.0.0.1:8000\n"
                            "    metrics_endpoints: {aggregated: [http://10.0.0.1:8000/metrics]}\n    #")
        text = text.replace("  disaggregated:                     #", "  disaggregated:\n"
                            "    endpoint: http://10.0.0.2:8000\n    #")
    return _plan(tmp_path, text)


def test_plan_without_lab_needs_endpoints(tmp_path):
    with pytest.raises(UsageError, match="no endpoint"):
        load_lab_plan(_without_lab(tmp_path, endpoints=False))


def test_plan_with_endpoints_needs_no_lab(tmp_path):
    plan, lab = load_lab_plan(_without_lab(tmp_path, endpoints=True))
    assert lab is None
    agg = plan.deployment_specs["aggregated"]
    assert agg.endpoint == "http://10.0.0.1:8000"
    assert agg.metrics_endpoints == {"aggregated": ("http://10.0.0.1:8000/metrics",)}


@pytest.mark.parametrize("edits, words", [
    ([("cores: [0, 1]\n  aggregated: {instances: 2}\n  disaggregated: {prefill: 1, decode: 1}",
       "cores: [0, 1, 2]\n  aggregated: {instances: 3}\n  disaggregated: {prefill: 2, decode: 1}")],
     "the plan's aggregated aggregated replicas (2) differ from the lab's aggregated instances (3)"),
    ([("cores: [0, 1]", "cores: [0, 1, 2]")], "not an equal core budget"),
    ([("    replicas: 2\n    tensor_parallel: 1", "    replicas: 1\n    tensor_parallel: 2")],
     "the lab runs one vLLM instance per core (TP 1, PP 1), the plan says aggregated TP2 x PP1"),
    ([("cores: [0, 1]", "cores: [0, 1]\n  kv_cache_gib: 0")], "lab.kv_cache_gib: must be >= 1, got 0"),
])
def test_lab_and_plan_must_agree(tmp_path, edits, words):
    text = EXAMPLE.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    with pytest.raises(UsageError) as exc:
        load_lab_plan(_plan(tmp_path, text))
    assert words in str(exc.value)


def test_the_plan_itself_is_checked_by_slo(tmp_path):
    text = EXAMPLE.read_text().replace("duration_seconds: 30", "duration_seconds: 30\n  duration_seconds: 31")
    with pytest.raises(UsageError, match="duration_seconds"):
        load_lab_plan(_plan(tmp_path, text))  # a key given twice: slo's bounded YAML loader
    with pytest.raises(UsageError, match="lab.base_port"):
        load_lab_section(_plan(tmp_path, EXAMPLE.read_text().replace("base_port: 19000", "base_port: 20000")))


# --- metrics text captured from the real engine ----------------------------------------

DECODE_TEXT = (METRICS / "vllm-0.32.0-decode.txt").read_text()


def test_snapshot_of_captured_decode_metrics():
    snap = snapshot.of_text(DECODE_TEXT)
    # values as captured (see the file's header): 24 transfers, every prompt token external
    assert snap["nixl_xfer_count"] == 24 and snap["nixl_bytes_sum"] == 14155776
    assert snap["nixl_xfer_sum_s"] == pytest.approx(0.138042)
    assert snap["prompt_tokens_local_compute"] == 0 and snap["prompt_tokens_external_kv"] == 5563
    assert snap["kv_cache_usage_perc"] == 0.0 and snap["num_requests_running"] == 0
    assert snap["request_success"] == 24 and snap["generation_tokens"] == 384


def test_snapshot_of_captured_prefill_metrics():
    snap = snapshot.of_text((METRICS / "vllm-0.32.0-prefill.txt").read_text())
    assert snap["prompt_tokens_local_compute"] == 5563 and snap["prompt_tokens_external_kv"] == 0
    assert snap["nixl_num_kv_expired_reqs"] == 0 and snap["nixl_xfer_count"] == 0


class _Metrics(http.server.BaseHTTPRequestHandler):
    """Serves the captured decode text; with `grow`, every histogram sample times the request count."""

    grow = False
    hits = 0

    def do_GET(self):
        type(self).hits += 1
        body = _scaled(DECODE_TEXT, type(self).hits) if self.grow else DECODE_TEXT
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def _scaled(text: str, k: int) -> str:
    """The captured text with every NIXL histogram sample (buckets, sum, count) times k."""
    out = []
    for line in text.splitlines():
        if line.startswith("vllm:nixl_") and not line.startswith("#") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            line = f"{name} {float(value) * k!r}"
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture
def metrics_server():
    servers = []

    def make(grow=False):
        handler = type("H", (_Metrics,), {"grow": grow, "hits": 0})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/metrics"
    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def test_fetch_reads_a_live_endpoint_and_a_dead_one_is_none(metrics_server):
    url = metrics_server()
    assert snapshot.fetch(url)["nixl_xfer_count"] == 24
    assert snapshot.fetch(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=2) is None


# --- the sweep's scrape: kvbench slo scrape, stopped with the load ---------------------------

def test_scraping_runs_slo_scrape_and_stops_it_with_the_load(tmp_path, metrics_server):
    decode = metrics_server()
    dead = f"http://127.0.0.1:{free_port()}/metrics"  # nobody listens: gaps, the run goes on
    p = Point("cold", "disaggregated", 2.0, 1)
    out = tmp_path / "scrape.jsonl"
    with scraping({"decode": [decode], "prefill": [dead]}, tmp_path, 600, p):
        # the load's body ends once two readings of each endpoint are written
        wait_for(lambda: jsonl_kinds(out).count("sample") >= 2 and "gap" in jsonl_kinds(out),
                 "two scrapes in " + str(out))
    rows = [json.loads(x) for x in (tmp_path / "scrape.jsonl").read_text().splitlines()]
    head, end = rows[0], rows[-1]
    assert head["schema"] == "kvbench.slo.metrics/1" and head["deployment"] == "disaggregated"
    assert head["offered_rate_rps"] == 2.0 and head["cache_state"] == "cold"
    assert end["stopped"] == "SIGTERM" and not end["interrupted"] and end["scrapes"] >= 2
    samples = [r for r in rows if r["kind"] == "sample"]
    assert {r["role"] for r in samples} == {"decode"}
    assert "vllm:nixl_xfer_time_seconds_count" in samples[0]["samples"]
    assert any(r["kind"] == "gap" and r["role"] == "prefill" for r in rows)


def test_scrape_endpoints_name_each_role_once():
    assert scrape_endpoints({"aggregated": ["a", "b"], "decode": ["d"]}) == \
        ["aggregated-0=a", "aggregated-1=b", "decode=d"]


# --- the report, from slo's analysis of runs on disk -----------------------------------------

def _plan_2x2(tmp_path) -> Path:
    text = EXAMPLE.read_text().replace("cache_state: [cold, warm]", "cache_state: [cold]")
    return _plan(tmp_path, re.sub(r"offered_rates_rps: \[[^]]*\]", "offered_rates_rps: [2, 8]", text))


def _fake_runs(tmp_path, plan_path, metrics_url) -> tuple:
    """Run folders as the sweep leaves them, with synthetic records (slo synth) and, for the
    disaggregated runs, a real `kvbench slo scrape` of an endpoint whose NIXL histograms grow."""
    from kvbench.slo.benchplan import load_benchmark_plan

    plan = load_benchmark_plan(plan_path)
    out = tmp_path / "sweep"
    open_out(out, str(plan_path), ["plan.yaml"])
    synth = tmp_path / "synth.jsonl"
    subprocess.run([sys.executable, "-m", "kvbench", "slo", "synth", "sweep", "--plan", str(plan_path),
                    "--out", str(synth)], check=True, cwd=ROOT, capture_output=True)
    rows = [json.loads(x) for x in synth.read_text().splitlines()]
    pts = points(plan, 1)
    for p in pts:
        folder = p.folder(out)
        folder.mkdir(parents=True)
        mine = [{**r, "cache_state": "cold"} for r in rows
                if r["deployment"] == p.deployment and r["offered_rate_rps"] == p.rate_rps]
        (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
        if p.deployment == "disaggregated":
            with scraping({"decode": [metrics_url]}, folder, 600, p):  # three readings
                wait_for(lambda f=folder: jsonl_kinds(f / "scrape.jsonl").count("sample") >= 3,
                         f"three scrapes in {folder}")
        (folder / "run.json").write_text(json.dumps({"point": {}, "status": "done", "reason": "",
                                                     "load_before": 0.5, "load_after": 0.7}))
    return plan, out, pts


@pytest.mark.slow  # four real scrapes of three readings each: out of make check
def test_report_shows_capacity_queues_kv_distribution_and_the_models_band(tmp_path, metrics_server):
    from kvbench.lab.sweep.report import write_report
    from kvbench.plan.floors import links_from_fit

    plan_path = _plan_2x2(tmp_path)
    plan, out, pts = _fake_runs(tmp_path, plan_path, metrics_server(grow=True))
    shaped = tmp_path / "engine-shaped.jsonl"  # engine-shaped p2p records around the mean bytes
    shaped.write_text("".join(json.dumps({"bytes": b, "wrong": 0, "nixl_post_mean_ms": p,
                                          "nixl_xfer_mean_ms": x}) + "\n"
                              for b, p, x in ((524288, 0.2, 3.0), (655360, 0.3, 4.0))))
    text = write_report(out, plan, pts, FIT2, shaped)
    report = json.loads((out / "sweep-report.json").read_text())
    assert not report["analysis_errors"]
    caps = report["capacity"]["cold"][0]
    assert {c["deployment"] for c in caps} == {"aggregated", "disaggregated"}
    assert report["verdicts"]["cold"][0] and len(report["points"]) == 4
    sched = {(r["deployment"], r["rate_rps"]): r for r in report["scheduler"]}
    assert set(sched) == {("disaggregated", 2.0), ("disaggregated", 8.0)}
    kv = report["kv_transfers"]
    assert [(r["rate_rps"], r["role"]) for r in kv] == [(2.0, "decode"), (8.0, "decode")]
    for r in kv:  # the served histograms grow by the captured ones per scrape: same mean, same shape
        n = r["transfers"]["median"]
        assert n > 0 and n % 24 == 0
        assert r["mean_ms"]["median"] == pytest.approx(1000 * 0.138042 / 24)
        assert r["mean_bytes"]["median"] == pytest.approx(14155776 / 24)
        assert sum(c for _, c in r["time_buckets_ms"]) == pytest.approx(n)
        assert r["time_buckets_ms"][0] == [5.0, pytest.approx(17 * n / 24)]
        link = links_from_fit(str(FIT2), {})[0]
        band = link.band(round(14155776 / 24))
        m = r["model"]
        assert m["predicted_band_ms"] == band and band[0] < m["predicted_ms"]["median"] < band[1]
        observed = 1000 * 0.138042 / 24
        assert m["ratio"]["median"] == pytest.approx(observed / m["predicted_ms"]["median"])
        assert m["ratio_band"] == pytest.approx([observed / band[1], observed / band[0]])
        es = r["engine_shaped"]  # 589824 B sits halfway between the measured sizes
        assert es["predicted_ms"]["median"] == pytest.approx(3.5)
        assert es["ratio"]["median"] == pytest.approx(observed / 3.5)
    assert "## Scheduler: queues per role" in text and "95% band" in text
    assert "engine/engine-shaped" in text and "plain model" in text
    assert (out / "sweep-cold.png").stat().st_size > 10_000 and (out / "analysis" / "rep1.png").exists()
    assert "runs/cold/disaggregated/2rps-rep1/scrape.jsonl" in report["files"]
    made = (out / "analysis" / "rep1.json").stat().st_mtime_ns
    write_report(out, plan, pts, FIT2)  # same inputs: slo's analysis is reused
    assert (out / "analysis" / "rep1.json").stat().st_mtime_ns == made
    assert not list((out / "analysis").glob("*.stale-*"))
    write_report(out, plan, pts, None)  # other inputs (no fit): the old analysis is kept aside
    assert len(list((out / "analysis").glob("rep1.stale-*.json"))) == 1


def test_set_aside_keeps_a_cut_short_run(tmp_path):
    folder = tmp_path / "2rps-rep1"
    folder.mkdir()
    (folder / "vllm-bench.log").write_text("half")
    set_aside(folder)
    assert not folder.exists()
    kept = list(tmp_path.glob("2rps-rep1.partial-*"))
    assert len(kept) == 1 and (kept[0] / "vllm-bench.log").read_text() == "half"
    done = tmp_path / "4rps-rep1"
    done.mkdir()
    (done / "run.json").write_text("{}")
    set_aside(done)
    assert done.exists()


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


# --- capacity, resume ---------------------------------------------------------------

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
    from kvbench.lab.load.bench import run_bounded

    ok, why = run_bounded(["sleep", "60"], tmp_path / "log", 50, progress=lambda: (7,), stall_s=1.0)
    assert not ok and "stopped answering" in why


def test_the_stall_watch_waits_out_the_client_start_up(tmp_path):
    """No token during the start-up grace is not a stall; after it, it is."""
    from kvbench.lab.load.bench import run_bounded

    ok, why = run_bounded(["sleep", "4.5"], tmp_path / "log", 50, progress=lambda: (7,), stall_s=1.0,
                          startup_s=30)
    assert ok and why == ""
    ok, why = run_bounded(["sleep", "60"], tmp_path / "log", 50, progress=lambda: (7,), stall_s=1.0,
                          startup_s=2)
    assert not ok and "stopped answering" in why


def test_a_progressing_run_is_left_to_finish(tmp_path):
    from kvbench.lab.load.bench import run_bounded

    ticks = iter(range(1000))
    ok, why = run_bounded(["sleep", "4.5"], tmp_path / "log", 50, progress=lambda: next(ticks), stall_s=1.0)
    assert ok and why == ""


def test_the_hard_bound_kills_and_says_so(tmp_path):
    from kvbench.lab.load.bench import run_bounded

    ok, why = run_bounded(["sleep", "60"], tmp_path / "log", 1.0)
    assert not ok and "no result within" in why
