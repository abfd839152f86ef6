"""`kvbench slo scrape` and `analyze --metrics` against live `/metrics` endpoints.

The endpoints are real HTTP servers of the `prometheus-client` library (its own exposition,
its own text format) holding metrics declared as vLLM declares them (names, help, types,
buckets and the `model_name`/`engine` labels of vllm/v1/metrics/loggers.py and of the
NixlConnector's NixlPromMetrics). What this proves: the scraper, the parser and the
analysis on real Prometheus text in vLLM's names. What it does not prove: that a given vLLM
build exports exactly these series; that is what tests/data/metrics/vllm-*.txt (a capture
from a running vLLM) is for.

Each `/metrics` request advances the fake engine by one step, so the expected numbers follow
from the schedule below and from how many scrapes succeeded, not from the clock.
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
from pathlib import Path

import pytest

import kvbench.slo.cli
from tests.conftest import ROOT, committed, jsonl_kinds, wait_for
from tests.helpers import run

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

DATA = ROOT / "tests" / "data" / "metrics"
FIT = committed("tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json")  # kvbench.fit/1: no draws
FIT2 = committed("tests/data/runs/shaped-link/kvbench-p2p-20261203T092334Z.fit.json")  # /2, with draws

# vLLM's declarations (NixlPromMetrics): buckets exactly as vLLM builds them
XFER_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
POST_BUCKETS = [0.001, *XFER_BUCKETS]
BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
DESC_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]
LABELS = {"model_name": "tiny-llama", "engine": "0"}

# the schedule: every step (= every /metrics request) 5 transfers of 2 MiB with these times
STEP_TIMES_S = (0.004, 0.008, 0.02, 0.03, 0.2)
STEP_BYTES = 2 * 2**20


class FakeVllm:
    """vLLM-named metrics in a prometheus-client registry, one step per scrape."""

    def __init__(self, role: str, queue_grows: bool, fail_at_step: int | None = None):
        self.role, self.queue_grows, self.step = role, queue_grows, 0
        reg = self.registry = CollectorRegistry(auto_describe=True)
        reg.register(self)  # first: collect() advances the state before the metrics are read
        names = list(LABELS)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             names, registry=reg)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             names, registry=reg)
        self.usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                           names, registry=reg)
        self.xfer = Histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV "
                              "Cache transfers.", names, buckets=XFER_BUCKETS, registry=reg)
        self.post = Histogram("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV "
                              "Cache transfers.", names, buckets=POST_BUCKETS, registry=reg)
        self.nbytes = Histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV "
                                "Cache transfers.", names, buckets=BYTES_BUCKETS, registry=reg)
        self.desc = Histogram("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL  KV "
                              "Cache transfers.", names, buckets=DESC_BUCKETS, registry=reg)
        self.failed = Counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
                              names, registry=reg)
        self.expired = Counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV "
                               "expire. NOTE: This metric is tracked on the P instance.", names, registry=reg)
        self.fail_at_step = fail_at_step
        for counter in (self.failed, self.expired):  # vLLM creates its per-engine series at start
            counter.labels(**LABELS)

    def describe(self):
        return []

    def collect(self):
        self.step += 1
        lab = LABELS
        self.waiting.labels(**lab).set(self.step if self.queue_grows else 2)
        self.running.labels(**lab).set(4)
        self.usage.labels(**lab).set(0.25)
        if self.role == "decode":
            for t in STEP_TIMES_S:
                self.xfer.labels(**lab).observe(t)
                self.post.labels(**lab).observe(t / 10)
                self.nbytes.labels(**lab).observe(STEP_BYTES)
                self.desc.labels(**lab).observe(64)
            if self.step == self.fail_at_step:
                self.failed.labels(**lab).inc(3)
        return []

    def serve(self) -> tuple[str, object]:
        server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.server = server  # port 0: the OS picks a free one
        return f"http://127.0.0.1:{server.server_port}/metrics", server

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines():
    made = []

    def make(*args, **kw):
        e = FakeVllm(*args, **kw)
        url, _ = e.serve()
        made.append(e)
        return e, url
    yield make
    for e in made:
        try:
            e.stop()
        except OSError:
            pass


def slo(*args) -> tuple[int, str, str]:
    return run(kvbench.slo.cli.cli, *args)


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_scrape_then_analyze_a_disaggregated_pair(tmp_path, engines):
    pre, pre_url = engines("prefill", queue_grows=False)
    dec, dec_url = engines("decode", queue_grows=True, fail_at_step=3)
    out = tmp_path / "run.metrics.jsonl"
    rc, text, err = slo("scrape", f"prefill={pre_url}", f"decode={dec_url}", "--interval", "0.3",
                        "--duration", "3", "--out", out, "--deployment", "disaggregated",
                        "--offered-rate", "4", "--cache-state", "cold")
    assert rc == 0, err
    rows = lines_of(out)
    assert rows[0]["kind"] == "header" and rows[0]["schema"] == "kvbench.slo.metrics/1"
    assert rows[0]["parser"].startswith("prometheus-client ")
    assert rows[-1]["kind"] == "end" and rows[-1]["interrupted"] is False
    ticks = [r for r in rows if r["kind"] in ("sample", "gap")]
    assert len(ticks) == 2 * 11 and text.startswith(f"{out}: ")
    dec_rows = [r for r in ticks if r["role"] == "decode" and r["kind"] == "sample"]
    assert len(dec_rows) >= 9, "a local endpoint should answer most scrapes"

    rc, text, err = slo("analyze", "--metrics", out, "--metrics-window-s", "1", "--format", "json",
                        "--fit", FIT)
    assert rc == 0, err
    e = json.loads(text)["engine_metrics"][0]
    assert e["labels"] == {"deployment": "disaggregated", "offered_rate_rps": 4.0, "cache_state": "cold"}
    roles = {r["role"]: r for r in e["roles"]}
    assert roles["prefill"]["engine"] == roles["decode"]["engine"] == "vllm"
    assert roles["prefill"]["queue"]["growing"] is False
    assert roles["decode"]["queue"]["growing"] is True
    assert roles["prefill"]["kv_transfer"] is None  # no transfer series on the prefill side
    waits = [r["samples"]["vllm:num_requests_waiting"][0][1] for r in dec_rows]
    steps = waits[-1] - waits[0]  # the gauge is the fake engine's step number
    kv = roles["decode"]["kv_transfer"]
    t = kv["total"]
    assert t["transfers"] == 5 * steps and t["bytes"] == 5 * steps * STEP_BYTES
    assert t["mean_bytes"] == STEP_BYTES
    assert t["mean_ms"] == pytest.approx(1000 * sum(STEP_TIMES_S) / 5, rel=1e-12)
    assert t["p50_ms"] == pytest.approx(17.5) and t["p90_ms"] == pytest.approx(150.0)
    assert t["p99_ms"] is None  # fewer than 100 transfers cannot support a P99
    assert t["observed_gb_s"] == pytest.approx(5 * STEP_BYTES / sum(STEP_TIMES_S) / 1e9)
    assert sum(w["transfers"] for w in kv["windows"]) == t["transfers"] and len(kv["windows"]) >= 2
    assert roles["decode"]["xfer_failures"]["increase"] == (3 if waits[0] < 3 <= waits[-1] else 0)
    m = kv["model"]
    assert m["predicted_mean_ms"] == pytest.approx(7.17611 + STEP_BYTES / 1.38019e9 * 1000)
    assert m["observed_over_predicted"] == pytest.approx(52.4 / m["predicted_mean_ms"])
    assert m["predicted_band_ms"] is None and "no joint draws" in m["no_band"]  # a kvbench.fit/1 file
    # the distribution as the buckets resolve it: per step one transfer in each of the buckets
    # <= 5, 10, 25, 50 and 200 ms (4, 8, 20, 30 and 200 ms), none elsewhere
    per_bucket = dict((str(le), n) for le, n in t["time_buckets_ms"])
    assert sum(per_bucket.values()) == t["transfers"]
    assert {le for le, n in per_bucket.items() if n} == {"5.0", "10.0", "25.0", "50.0", "200.0"}
    assert all(n == steps for n in per_bucket.values() if n) and t["time_buckets_ms"][-1][0] == "+Inf"
    assert "exports no rejection counter" in " ".join(roles["decode"]["notes"])


def test_the_model_beside_the_engine_carries_the_fits_band():
    """A kvbench.fit/2 link: the prediction band at the engine's mean bytes is Link.band's, and the
    ratio's band is the observed time over its two ends."""
    from kvbench.plan.floors import links_from_fit
    from kvbench.slo.engine_metrics import model_beside

    link = links_from_fit(str(FIT2), {})[0]
    nbytes, observed = 2**21, 80.0
    m = model_beside({"mean_bytes": float(nbytes), "mean_ms": observed}, link)
    lo, hi = m["predicted_band_ms"]
    assert [lo, hi] == link.band(nbytes) and lo < m["predicted_mean_ms"] < hi
    assert m["setup_ms"] == 0.0 and link.setup_ms < 0  # a negative fitted setup is used as 0
    assert m["predicted_mean_ms"] == pytest.approx(nbytes / (link.effective_gb_s * 1e9) * 1000)
    assert m["observed_over_band"] == pytest.approx([observed / hi, observed / lo])
    assert m["no_band"] is None


def test_sigterm_ends_a_scrape_cleanly_after_one_last_reading(tmp_path, engines):
    """A caller (kvbench sweep) stops the scrape when its load ends: a complete file, exit 0."""
    import signal
    import subprocess
    import sys

    _, url = engines("decode", queue_grows=True)
    out = tmp_path / "term.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "slo", "scrape", f"decode={url}",
                             "--interval", "0.5", "--duration", "600", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # ready: two readings written (its SIGTERM handler is set before the first)
    wait_for(lambda: jsonl_kinds(out).count("sample") >= 2 or proc.poll() is not None,
             "two scrapes in " + str(out))
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)  # a hang bound, not a timing check
    assert proc.returncode == 0, stderr
    assert "stopped by SIGTERM" in stdout
    rows = lines_of(out)
    assert rows[-1]["kind"] == "end" and rows[-1]["stopped"] == "SIGTERM" and not rows[-1]["interrupted"]
    assert rows[-1]["scrapes"] >= 2 and rows[-2]["kind"] == "sample"


def test_an_endpoint_that_goes_away_is_a_gap_and_the_run_goes_on(tmp_path, engines):
    pre, pre_url = engines("prefill", queue_grows=False)
    dec, dec_url = engines("decode", queue_grows=False)
    stopper = threading.Timer(1.0, pre.stop)
    stopper.start()
    out = tmp_path / "gap.jsonl"
    rc, text, err = slo("scrape", f"prefill={pre_url}", f"decode={dec_url}", "--interval", "0.25",
                        "--duration", "2.5", "--out", out)
    stopper.join()
    assert rc == 0, err
    rows = lines_of(out)
    gaps = [r for r in rows if r["kind"] == "gap"]
    assert gaps and {g["role"] for g in gaps} == {"prefill"}
    assert all(r["kind"] == "sample" for r in rows if r.get("t_s", 0) > gaps[0]["t_s"] and r.get("role") == "decode")
    assert any("refused" in g["error"].lower() or "reset" in g["error"].lower() for g in gaps)
    rc, text, _ = slo("analyze", "--metrics", out)
    assert rc == 0 and "failed scrape(s) in 1 gap(s)" in text


def test_a_hung_endpoint_costs_one_timeout_per_scrape_not_the_run(tmp_path):
    """A server that accepts and never answers: every scrape of it is a gap, bounded by the interval."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    out = tmp_path / "hung.jsonl"
    try:
        rc, _, err = slo("scrape", f"decode=http://127.0.0.1:{sock.getsockname()[1]}/metrics",
                         "--interval", "0.2", "--duration", "1", "--out", out)
    finally:
        sock.close()
    rows = lines_of(out)
    assert rc == 0, err
    assert [r["kind"] for r in rows[1:-1]] == ["gap"] * 6
    assert rows[-1]["t_s"] < 10.0  # six timeouts of 0.2 s each (about 1.2 s), not a hang


def test_histogram_quantile_is_promqls_rule():
    from kvbench.slo.engine_metrics import histogram_quantile

    b = {0.1: 2.0, 0.2: 6.0, 0.5: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.5, b) == pytest.approx(0.175)  # 0.1 + 0.1 x (5-2)/(6-2)
    assert histogram_quantile(0.9, b) == pytest.approx(0.425)
    assert histogram_quantile(0.1, b) == pytest.approx(0.05)  # first bucket starts at 0
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0  # +Inf: the last finite bound
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None


def test_counter_reset_between_scrapes_is_skipped_not_negative(tmp_path):
    from kvbench.slo.scrape import SCHEMA_METRICS

    def sample(t, count, total_s):
        return {"kind": "sample", "role": "decode", "url": "u", "t_s": t, "samples": {
            "vllm:nixl_xfer_time_seconds_bucket": [[{"le": "0.1"}, count], [{"le": "+Inf"}, count]],
            "vllm:nixl_xfer_time_seconds_sum": [[{}, total_s]],
            "vllm:nixl_xfer_time_seconds_count": [[{}, count]]}}
    rows = [{"kind": "header", "schema": SCHEMA_METRICS, "engine": "vllm"},
            sample(0, 10, 0.5), sample(1, 20, 1.0), sample(2, 3, 0.15), sample(3, 13, 0.65)]
    f = tmp_path / "reset.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, text, _ = slo("analyze", "--metrics", f, "--format", "json")
    kv = json.loads(text)["engine_metrics"][0]["roles"][0]["kv_transfer"]
    assert kv["resets_skipped"] == 1 and kv["total"]["transfers"] == 20  # 10 + 10, the drop skipped
    assert kv["total"]["mean_ms"] == pytest.approx(50.0)


def test_a_mapping_file_reads_an_unknown_engine(tmp_path):
    from kvbench.slo.scrape import SCHEMA_METRICS

    mapping = tmp_path / "map.yaml"
    mapping.write_text("engine: toy\nmetrics:\n  waiting: {name: 'toy_queue', kind: gauge}\n"
                       "  xfer_time: {name: 'toy_xfer_ms', kind: histogram, scale: 0.001}\n")
    rows = [{"kind": "header", "schema": SCHEMA_METRICS, "engine": "auto"}]
    for k in range(12):
        rows.append({"kind": "sample", "role": "decode", "url": "u", "t_s": k, "samples": {
            "toy_queue": [[{}, float(k)]],
            "toy_xfer_ms_bucket": [[{"le": "10"}, 2.0 * k], [{"le": "+Inf"}, 2.0 * k]],
            "toy_xfer_ms_sum": [[{}, 10.0 * k]], "toy_xfer_ms_count": [[{}, 2.0 * k]]}})
    f = tmp_path / "toy.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, text, err = slo("analyze", "--metrics", f, "--metrics-map", mapping, "--format", "json")
    assert rc == 0, err
    role = json.loads(text)["engine_metrics"][0]["roles"][0]
    assert role["queue"]["growing"] is True and role["kv_transfer"]["total"]["mean_ms"] == pytest.approx(5.0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: toy\nmetrics:\n  queue: {name: x, kind: gauge}\n")
    rc, _, err = slo("analyze", "--metrics", f, "--metrics-map", bad)
    assert rc == 2 and "unknown quantity 'queue'" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["scrape", "http://127.0.0.1:18001/metrics", "--duration", "1", "--out", "x"], "expected ROLE=http://"),
    (["scrape", "a=http://x/metrics", "a=http://y/metrics", "--duration", "1", "--out", "x"], "role 'a' given twice"),
    (["scrape", "a=http://x/metrics", "--duration", "inf", "--out", "x"], "argument --duration: must be a positive number"),
    (["scrape", "a=http://x/metrics", "--duration", "1", "--interval", "0.001", "--out", "x"], "argument --interval: must be a positive number (>= 0.05"),
    (["analyze"], "give request records (RECORDS.jsonl), --metrics SCRAPE.jsonl, or both"),
])
def test_bad_scrape_and_analyze_arguments(tmp_path, args, message):
    rc, out, err = slo(*args)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_the_plan_asks_for_engine_metrics_the_run_did_not_give(tmp_path):
    from tests.slo.helpers import req, write_jsonl

    plan = ROOT / "examples" / "pd-benchmark-plan.yaml"
    rows = [{**req(i, rate=1.0), "cache_state": "cold"} for i in range(30)]
    f = write_jsonl(tmp_path / "r.jsonl", rows)
    rc, text, err = slo("analyze", f, "--plan", plan, "--format", "json")
    assert rc == 0, err
    assert json.loads(text)["notes"] == [
        "the plan asks for scheduler and kv_transfer metrics: record them with `kvbench slo scrape` "
        "and pass --metrics FILE"]


# ---------------------------------------------------------------------------
# committed text: prometheus-client's own output, and the slot for a real vLLM capture


def test_committed_prometheus_client_sample_parses_to_the_vllm_table():
    from kvbench.slo.engines import ENGINES, detect_engine
    from kvbench.slo.scrape import parse_metrics_text

    text = (DATA / "promclient-vllm-decode.txt").read_text()
    samples = parse_metrics_text(text, lambda n: True)
    assert detect_engine(set(samples)) == "vllm"
    for q, m in ENGINES["vllm"].items():
        names = {m.name, m.name + "_total", m.name + "_count"}
        assert names & set(samples), f"{q}: {m.name} not in the sample"


REAL_VLLM = sorted(DATA.glob("vllm-*.txt"))


@pytest.mark.skipif(not REAL_VLLM, reason="no capture from a running vLLM committed yet: the slot is "
                    "tests/data/metrics/vllm-*.txt (see tests/data/metrics/README.md)")
@pytest.mark.parametrize("path", REAL_VLLM, ids=[p.name for p in REAL_VLLM])
def test_real_vllm_capture_reads_through_the_table(path):
    from kvbench.slo.engine_metrics import histogram, histogram_quantile, scalar
    from kvbench.slo.engines import ENGINES, detect_engine
    from kvbench.slo.scrape import parse_metrics_text

    text = path.read_text()
    samples = parse_metrics_text(text, lambda n: True)
    table = ENGINES["vllm"]
    assert detect_engine(set(samples)) == "vllm"
    # the queue gauges as the capture holds them (an idle engine: 0 and 0) ...
    assert scalar(samples, table["waiting"], "sum") == 0.0
    assert scalar(samples, table["running"], "sum") == 0.0
    # ... read from exactly their series: planted values come back, not the by-reason ones
    planted = re.sub(r"^(vllm:num_requests_waiting\{[^}]*\}) 0\.0$", r"\1 3.0", text, flags=re.M)
    planted = re.sub(r"^(vllm:num_requests_running\{[^}]*\}) 0\.0$", r"\1 2.0", planted, flags=re.M)
    planted = re.sub(r"^(vllm:num_requests_waiting_by_reason\{[^}]*\}) 0\.0$", r"\1 50.0", planted,
                     flags=re.M)
    again = parse_metrics_text(planted, lambda n: True)
    assert scalar(again, table["waiting"], "sum") == 3.0
    assert scalar(again, table["running"], "sum") == 2.0
    h = histogram(samples, table["xfer_time"])
    if h is not None and h[2] > 0:  # a decode instance that has received KV
        assert 0 <= histogram_quantile(0.5, h[0]) < 3600
