"""Helpers the SLO tests share: request records on a uniform schedule written as JSON lines, and
a valid metrics scrape file."""

from __future__ import annotations

import json

from tests.conftest import ROOT

SCHEMA = "kvbench.slo.request/1"


def req(i: int, *, dep: str = "aggregated", rate: float = 1.0, ttft: float = 300.0,
        tpot: float = 30.0, tokens: int = 16, status: str = "ok", send: float | None = None,
        lag: float = 0.5, scheduled: bool = True) -> dict:
    """One record on a uniform schedule; ok requests stream one token per chunk."""
    sched = i * 1000.0 / rate if send is None else send
    d = {"schema": SCHEMA, "request_id": f"{dep}-{rate:g}-{i}", "deployment": dep,
         "offered_rate_rps": rate, "scheduled_send_ms": sched if scheduled else None,
         "actual_send_ms": sched + lag, "status": status,
         "output_tokens": tokens if status == "ok" else 0}
    if status == "ok":
        first = sched + lag + ttft
        d["chunk_times_ms"] = [first + k * tpot for k in range(tokens)]
        d["chunk_tokens"] = [1] * tokens
    else:
        d["end_ms"] = sched + lag + 20.0
        d["error"] = f"synthetic {status}"
    return d


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def scrape_lines() -> list[dict]:
    """A valid metrics scrape file (header, ten samples of the committed vLLM decode metrics,
    end) as JSON-ready lines."""
    from kvbench.slo.scrape import parse_metrics_text

    samples = parse_metrics_text((ROOT / "tests/data/metrics/vllm-0.32.0-decode.txt").read_text(),
                                 lambda name: name.startswith("vllm:num_requests"))
    head = {"kind": "header", "schema": "kvbench.slo.metrics/1", "endpoints": [], "interval_s": 1.0}
    body = [{"kind": "sample", "role": "decode", "url": "http://127.0.0.1:18012/metrics",
             "t_s": float(i), "elapsed_ms": 1.0, "samples": samples} for i in range(10)]
    return [head, *body, {"kind": "end", "t_s": 10.0, "scrapes": 10, "gaps": 0, "interrupted": False}]


GUIDELLM_REPORT = ROOT / "tests" / "data" / "clients" / "guidellm-0.8.1" / "benchmarks.json"


def convert_guidellm_variant(tmp_path, mutate) -> tuple[int, str, str, list[dict]]:
    """`kvbench slo convert --from guidellm` on the committed real report with its first
    benchmark changed by `mutate`: (status, stdout, stderr, the records written)."""
    import kvbench.slo.cli
    from tests.helpers import run

    doc = json.loads(GUIDELLM_REPORT.read_text())
    mutate(doc["benchmarks"][0])
    src, out = tmp_path / "benchmarks.json", tmp_path / "r.jsonl"
    src.write_text(json.dumps(doc))
    rc, stdout, err = run(kvbench.slo.cli.cli, "convert", "--from", "guidellm", src, "--deployment", "d",
                          "--out", out)
    return rc, stdout, err, [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
