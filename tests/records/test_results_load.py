"""kvbench.results.load: every kind of result file as a DataFrame, on real files (published
runs copied into tests/data/runs, a real p2p run in tests/data/p2p, the lab's request records
and a real scrape)."""

from __future__ import annotations

import http.server
import io
import json
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench import results
from kvbench.cli import UsageError
from kvbench.records.frames import iter_frames
from tests.conftest import ROOT, committed, run_cli

P2P = ROOT / "tests/data/p2p/kvbench-p2p-20261203T122234Z-b96bb8.jsonl"
RUNS = committed("tests/data/runs")  # published runs of several transports (README there)
LAB = RUNS / "lab-sweep"  # part of results/lab/sweep-20261203T101133Z


def test_p2p_rows_typed_and_grouped_by_spec():
    df = results.load(P2P)
    assert len(df) == 3 and list(df["payload_bytes"]) == [65536, 1048576, 4194304]
    for col in ("transport", "pattern", "layout", "spec_id", "spec_transport", "hosts", "source"):
        assert isinstance(df[col].dtype, pd.CategoricalDtype), col
    for col in ("payload_bytes", "n_samples", "prompt_tokens", "spec_world_size", "line"):
        assert str(df[col].dtype) == "Int64", col
    assert df["prompt_tokens"].isna().all() and str(df["fit_as_link"].dtype) == "boolean"
    assert set(df["spec_transport_options_path"]) == {"host"} and set(df["order"]) == {"rounds"}
    # 20 samples: p95 is supported (n >= 20), p99 is not (n < 100) and is NA, not a number
    raw = [json.loads(line) for line in P2P.read_text().splitlines()]
    assert list(df["p95_ms"]) == [r["p95_ms"] for r in raw] and df["p99_ms"].isna().all()
    assert df.groupby("spec_id", observed=True).size().to_dict() == {"91e013fad477": 3}
    assert set(df["env_torch"]) == {"2.13.0+cpu"} and set(df["transport_path"]) == {"host"}


def test_csv_twin_gives_the_same_rows():
    j = results.load(P2P)
    c = results.load(P2P.with_suffix(".csv"))
    assert list(c["line"]) == [2, 3, 4]  # the CSV's own lines (line 1 is its header)
    cols = [k for k in j.columns if k not in ("source", "line")]
    pd.testing.assert_frame_equal(c[cols], j[cols])


def test_samples_are_long_with_their_rounds():
    s = results.load(P2P, samples=True)
    raw = [json.loads(line) for line in P2P.read_text().splitlines()]
    assert len(s) == sum(len(r["samples_ms"]) for r in raw) == 60
    first = s[s["payload_bytes"] == 65536]
    assert list(first["round"]) == raw[0]["sample_rounds"]
    assert list(first["time_ms"]) == raw[0]["samples_ms"]
    assert "p50_ms" not in s.columns and str(s["round"].dtype) == "Int64"


def test_a_folder_reads_each_record_once_and_only_its_kind():
    df = results.load(RUNS, kind="p2p")
    files = sorted({Path(p).name for p in df["source"].astype(str)})
    assert files and all(f.endswith(".jsonl") for f in files)  # the .csv twins are skipped
    n_lines = sum(len(Path(p).read_text().splitlines())
                  for p in set(df["source"].astype(str)))
    assert len(df) == n_lines
    assert set(df["transport"]) >= {"mpi", "gloo", "nixl"}
    fits = results.load(RUNS, kind="fit")
    assert len(fits) == sum(len(json.loads((ROOT / p).read_text())["groups"])
                            for p in set(fits["source"].astype(str)))


def test_bad_rows_name_their_file_and_line(tmp_path):
    lines = P2P.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["bytes"] = -5
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines[:2] + [json.dumps(bad)]) + "\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:3: bytes: must be >= 0, got -5"):
        results.load(p)
    csv_lines = P2P.with_suffix(".csv").read_text().splitlines()
    q = tmp_path / "bad.csv"
    q.write_text("\n".join(csv_lines[:3] + [csv_lines[3].replace(",mpi,", ",,", 1)]) + "\n")
    with pytest.raises(UsageError, match=r"bad\.csv:4: transport: missing"):
        results.load(q)
    with pytest.raises(UsageError, match="holds kvbench.p2p/1, not fit"):
        results.load(P2P, kind="fit")
    with pytest.raises(UsageError, match="unknown kind 'p2q'"):
        results.load(P2P, kind="p2q")


def test_chunks_concatenate_to_the_same_frame():
    whole = results.load([RUNS, P2P], kind="p2p")
    chunks = list(iter_frames([RUNS, P2P], kind="p2p", chunksize=7))
    assert len(chunks) > 5 and all(len(c) <= 7 + 5 for c in chunks)
    again = results.load([RUNS, P2P], kind="p2p", chunksize=7)
    pd.testing.assert_frame_equal(again, whole)
    # categories of chunks that never saw a value are merged, not turned into object columns
    assert isinstance(again["spec_id"].dtype, pd.CategoricalDtype)


def test_fits_groups_sizes_and_draws():
    path = committed("tests/data/runs/shaped-link/kvbench-p2p-20261203T092334Z.fit.json")
    doc = json.loads(path.read_text())
    (g,) = doc["groups"]
    f = results.load(path, kind="fit")
    row = f.iloc[0]
    assert row["effective_gbps"] == g["effective_gb_s"]
    assert [row["effective_gbps_ci95_lo"], row["effective_gbps_ci95_hi"]] == g["effective_gb_s_ci95"]
    assert row["transport"] == "gloo" and row["n_draws"] == 1000
    sizes = results.load(path, kind="fit-sizes")
    assert list(sizes["payload_bytes"]) == [s["bytes"] for s in g["sizes"]]
    draws = results.load(path, kind="fit", samples=True)
    assert len(draws) == 1000
    lo, hi = 1000.0 / np.percentile(draws["ms_per_gb"], [97.5, 2.5])  # the fit's own rule
    assert (lo, hi) == pytest.approx(tuple(g["effective_gb_s_ci95"]), rel=1e-3)


def test_request_rows_agree_with_the_committed_slo_report():
    """TTFT per request, taken through the pandas frame, gives the report's own percentiles
    (the sweep's 2 rps warm runs of both deployments: the report's groups at that rate)."""
    q = results.load(LAB / "runs", kind="slo-requests")
    report = json.loads((LAB / "analysis/warm-rep1.json").read_text())
    warmup = report["criteria"]["warmup_requests"]
    groups = [g for g in report["groups"] if g["offered_rate_rps"] == 2.0]
    assert len(groups) == 2 and len(q) == sum(g["counts"]["records"] for g in groups)
    for g in groups:
        run = q[(q["deployment"] == g["deployment"]) & (q["offered_rate_rps"] == g["offered_rate_rps"])]
        send = run["scheduled_send_ms"].fillna(run["send_ms"])
        measured = run.loc[send.sort_values(kind="stable").index[warmup:]]
        ttft = measured.loc[measured["status"] == "ok", "ttft_ms"]
        want = g["latency_ms"]["ttft"]
        assert len(ttft) == want["n"] and np.percentile(ttft, 50) == pytest.approx(want["p50_ms"])
    chunks = results.load(LAB / "runs", kind="slo-requests", samples=True)
    assert len(chunks) == int(q["n_chunks"].sum())
    assert chunks.groupby(["source", "line"], observed=True)["itl_ms"].max().dropna().equals(
        q.set_index(["source", "line"])["max_itl_ms"].dropna().rename("itl_ms"))


def test_report_rows():
    path = LAB / "analysis/cold-rep1.json"
    doc = json.loads(path.read_text())
    r = results.load(path, kind="slo-report")
    assert len(r) == len(doc["groups"])
    for (_, row), g in zip(r.iterrows(), doc["groups"], strict=True):
        assert row["ttft_p95_ms"] == g["latency_ms"]["ttft"]["p95_ms"]
        assert row["attainment_of_all_pct"] == g["attainment"]["of_all_offered_pct"]
        assert bool(row["passed"]) == g["passed"]


class _Text(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 - the http.server API
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_metric_rows_of_a_real_scrape(tmp_path):
    """`kvbench slo scrape` of a real vLLM capture, served over HTTP: every sample is a row."""
    from kvbench.slo.scrape import parse_metrics_text

    text = (ROOT / "tests/data/metrics/vllm-0.32.0-decode.txt").read_text()
    _Text.body = text.encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Text)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "scrape.jsonl"
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        res = run_cli("kvbench.slo", "scrape", f"decode={url}", "--interval", "0.2",
                      "--duration", "0.6", "--out", str(out))
        assert res.returncode == 0, res.stderr
    finally:
        server.shutdown()
        server.server_close()
    m = results.load(out, kind="metrics")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    n_scrapes = sum(1 for x in lines if x["kind"] == "sample")
    wanted = parse_metrics_text(text, lambda name: name.startswith("vllm:"))
    kept = set(m["metric"])
    assert kept and kept <= set(wanted)
    per_scrape = sum(len(wanted[k]) for k in kept)
    assert len(m) == n_scrapes * per_scrape and set(m["role"]) == {"decode"}
    name = "vllm:num_requests_waiting"
    assert set(m.loc[m["metric"] == name, "value"]) == {float(v) for _, v in wanted[name]}


def test_progress_is_reported(tmp_path):
    said = io.StringIO()
    results.load(RUNS, kind="fit", progress=lambda msg: said.write(msg + "\n"))
    assert "files read" in said.getvalue()
