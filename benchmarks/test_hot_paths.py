"""The code kvbench adds around a transfer, timed on this machine's CPU (pytest-benchmark).

Where a plain operation bounds a benchmark from below it is timed beside it as `floor_*` (the
same bytes copied, compared, parsed): compare.py prints kvbench / floor ratios, which change
less with the machine and its load than the times themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbench.model import get_dtype, resolve_model
from kvbench.p2p.layout import KVCache, KVSpec

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 300  # the README's short prompt: 98,304,000 B of the default model in bf16


def _spec(layout: str, origin: int = 0) -> KVSpec:
    return KVSpec(resolve_model("seed-70b-gqa"), get_dtype("bf16"), TOKENS, layout=layout,
                  block_size=16, origin=origin)


# ---------------------------------------------------------------------------
# layout: allocation, seeded fill, the data check, paged pack/unpack


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_layout_allocate_and_fill(benchmark, layout):
    benchmark.extra_info["floor"] = "test_floor_fill_same_bytes"

    def run():
        cache = KVCache(_spec(layout))
        cache.fill()
        return cache

    cache = benchmark(run)
    assert cache.count_wrong() == 0


def test_floor_fill_same_bytes(benchmark):
    """torch.empty + fill_ of the payload's bytes: what any fill costs."""
    n = _spec("contiguous").payload_bytes
    benchmark(lambda: torch.empty(n, dtype=torch.uint8).fill_(7))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_data_check(benchmark, layout):
    benchmark.extra_info["floor"] = "test_floor_compare_same_bytes"
    cache = KVCache(_spec(layout))
    cache.fill()
    assert benchmark(cache.count_wrong) == 0


def test_floor_compare_same_bytes(benchmark):
    """count_nonzero(a != b) over the payload's bytes as 2-byte elements."""
    n = _spec("contiguous").payload_bytes // 2
    a, b = torch.ones(n, dtype=torch.int16), torch.ones(n, dtype=torch.int16)
    assert benchmark(lambda: int(torch.count_nonzero(a != b))) == 0


def test_paged_pack_unpack(benchmark):
    """Every (layer, part) of a paged KV gathered in token order and scattered into another
    rank's blocks (torch index_select / index_copy_, the reference the CUDA kernel matches)."""
    benchmark.extra_info["floor"] = "test_floor_copy_same_bytes"
    src, dst = KVCache(_spec("paged")), KVCache(_spec("paged"), table_seed=1)
    src.fill()
    layers, parts = src.spec.model.layers, src.spec.parts

    def run():
        for layer in range(layers):
            for part in range(parts):
                dst.scatter(layer, part, src.gather(layer, part))

    benchmark(run)
    assert dst.count_wrong() == 0


def test_floor_copy_same_bytes(benchmark):
    """One contiguous copy of the payload's bytes (a pack's lower bound, twice for pack+unpack)."""
    n = _spec("contiguous").payload_bytes
    a, b = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    benchmark(lambda: b.copy_(a))


# ---------------------------------------------------------------------------
# records: build 100 records of 1,000 samples, write them (JSONL + CSV, synced, together)


def _records(n: int = 100, samples: int = 1000) -> list[dict]:
    from kvbench.p2p.assemble import make_record
    from kvbench.p2p.harness import LoopResult
    from kvbench.p2p.patterns.base import Measured, Point, SpecEntries
    from kvbench.records.schema.p2p import HandoffSpec
    from kvbench.records.stats import Measurement

    rng = np.random.default_rng(0)
    spec = HandoffSpec(transport="mpi", pattern="sequential", granularity="whole", layout="raw",
                       device="cpu", world={"size": 2, "prefill_ranks": [0], "decode_ranks": [1]},
                       hosts=["a", "b"], transport_options={"path": "host"})
    base = {"transport": "mpi", "layout": "raw", "dtype": None, "device": "cpu", "model": None,
            "world_size": 2, "hosts": ["a", "b"], "run_id": "bench", "order": "rounds"}
    out = []
    for i in range(n):
        ms = list(rng.lognormal(0, 0.1, samples))
        loop = LoopResult(cold_ms=2.0, warmup_ms=[1.0, 1.0], samples=Measurement(ms),
                          iters=samples, rounds=list(range(samples)))
        fields = {"pattern": "sequential", "granularity": "whole", "bytes": 1 << (10 + i % 16),
                  "spec": spec.as_dict(), "spec_id": spec.spec_id,
                  "fit_as_link": True, "not_link_reason": None, "wrong": 0}
        measured = Measured(loop, fields, SpecEntries("whole", [0], [1]))
        out.append(make_record(base, Point(raw_bytes=fields["bytes"]), measured, 0.002))
    return out


def test_build_records(benchmark):
    recs = benchmark(_records)
    assert len(recs) == 100 and recs[0]["n_samples"] == 1000


def test_write_records(benchmark, tmp_path):
    from kvbench.records.write import write_records

    recs = _records()
    benchmark.extra_info["floor"] = "test_floor_json_dumps_records"
    jsonl, _ = benchmark(lambda: write_records(tmp_path, recs, "bench"))
    assert sum(1 for _ in open(jsonl)) == 100


def test_floor_json_dumps_records(benchmark):
    recs = _records()
    benchmark(lambda: "".join(json.dumps(r) + "\n" for r in recs))


# ---------------------------------------------------------------------------
# fit on 10^5 samples, slo analyze on 10^5 requests, the metrics parser on a large scrape


def test_fit_1e5_samples(benchmark, heavy_rounds):
    """50 simulated runs x 400 rounds x 5 sizes (kvbench.fit.sim), 1000 resamples."""
    from kvbench.fit.fitting import fit_records
    from kvbench.fit.sim import simulate

    recs = simulate(np.random.default_rng(0), setup_ms=0.5, effective_gb_s=2.0, rounds=400, runs=50)
    assert sum(len(r["samples_ms"]) for r in recs) == 100_000
    fits, _ = benchmark.pedantic(lambda: fit_records(recs, n_boot=1000, seed=0),
                                 rounds=heavy_rounds, iterations=1)
    assert fits[0].record["effective_gb_s_ci95"] is not None


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory) -> Path:
    from benchmarks.slo_analyze_big import write_records

    path = tmp_path_factory.mktemp("slo") / "records.jsonl"
    write_records(path, 100_000)
    return path


def test_slo_analyze_1e5_requests(benchmark, heavy_rounds, requests_file):
    """Read, check and judge 10^5 request records (16 chunks each; 2 deployments x 4 rates)."""
    from kvbench.records.requests import iter_records
    from kvbench.slo.gates import Criteria, analyze

    benchmark.extra_info["floor"] = "test_floor_json_loads_requests"
    crit = Criteria(denominator="all_offered_after_warmup", slo_attainment_min=0.9,
                    ttft_max_ms=500.0, tpot_max_ms=30.0, warmup_requests=5)
    out = benchmark.pedantic(lambda: analyze(iter_records([requests_file]), crit, "benchmark"),
                             rounds=heavy_rounds, iterations=1)
    assert out["records_total"] == 100_000


def test_floor_json_loads_requests(benchmark, heavy_rounds, requests_file):
    from benchmarks.bigfile import parse_floor

    benchmark.pedantic(lambda: parse_floor(requests_file), rounds=heavy_rounds, iterations=1)


@pytest.fixture(scope="module")
def large_scrape() -> str:
    """A real vLLM 0.32.0 /metrics capture as 64 engines would expose it (~3.9 MB of text)."""
    text = (ROOT / "tests/data/metrics/vllm-0.32.0-decode.txt").read_text()
    body = [line for line in text.splitlines() if not line.startswith("# Real")]
    out = []
    for e in range(64):
        out += [line.replace('engine="0"', f'engine="{e}"') for line in body
                if not line.startswith("#") or e == 0]
    return "\n".join(out) + "\n"


def test_metrics_parser_large_scrape(benchmark, large_scrape):
    from kvbench.slo.scrape import parse_metrics_text

    got = benchmark(lambda: parse_metrics_text(large_scrape, lambda name: True))
    assert len(got["vllm:num_requests_waiting"]) == 64
