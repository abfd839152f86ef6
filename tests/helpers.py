"""Helpers the test modules share: run a command in-process and judge a refusal, build hostile
JSON, and the small inputs several components' tests start from (an HF config, an SLO cohort,
a vLLM result file, p2p records). A test module imports helpers from here (or from its
component's `tests/<component>/helpers.py`), never from another test module
(tests/test_test_layout.py holds that)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np

from kvbench.fit.data import spec_id
from kvbench.records.requests import record_to_json
from kvbench.slo import synth
from tests.conftest import ROOT

HUGE = 10**400
GB = 1e9


def run(cli, *argv) -> tuple[int, str, str]:
    """A command in-process, as `kvbench ...` calls it: (exit status, stdout, stderr);
    argparse's SystemExit included. Every argument is passed as str (paths welcome)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = cli([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def refused(result, *fragments, code: int = 2) -> str:
    """A refusal as the project promises it: exit `code`, exactly one stderr line naming every
    fragment, no traceback. Returns stderr."""
    rc, out, err = result
    assert rc == code, (rc, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


def no_traceback(result, codes=(0, 2)) -> str:
    """No traceback whatever happens: exit in `codes`, and where not 0, exactly one stderr
    line (a verdict such as "no rate can be fitted" may still exit 0). Returns stderr."""
    rc, out, err = result
    assert rc in codes, (rc, err[-2000:])
    assert "Traceback" not in err and (rc == 0 or err.count("\n") == 1), err[-2000:]
    return err


def json_with(doc: dict, key: str, raw: str) -> str:
    """doc as JSON text with doc[key] replaced by the literal raw (NaN, 10**400, deep [[..]])."""
    return json.dumps({**doc, key: "@@"}).replace('"@@"', raw)


def deep(n: int) -> str:
    """n nested JSON/YAML lists: deeper than any reader takes."""
    return "[" * n + "]" * n


# --- inputs: an HF config, an SLO cohort, a vLLM result --------------------------------------

LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "intermediate_size": 14336, "model_type": "llama"}
ANALYZE = ("--ttft-max-ms", "2000", "--tpot-max-ms", "50", "--denominator", "successful",
           "--attainment-min", "0.9")


def cohort_lines() -> list[dict]:
    """The synthetic SLO cohort (kvbench.slo.synth) as JSON-ready request records."""
    return [record_to_json(r) for r in synth.cohort()]


T0 = 81234.5  # time.perf_counter() origin: arbitrary, vLLM saves it as is


# (start offset s, ttft s, itls s, output_lens, error)
REQUESTS = [
    (0.00, 0.250, [0.020] * 7, 8, ""),
    (0.25, 0.300, [0.030] * 3, 8, ""),  # 4 chunks carrying 8 tokens: per-chunk counts unknown
    (0.50, 0.0, [], 0, "Too Many Requests"),
    (0.75, 0.0, [], 0, "Traceback (most recent call last):\n  ...\nasyncio.exceptions.TimeoutError\n"),
    (1.00, 0.0, [], 0, "Internal Server Error"),
    (1.25, 0.200, [0.025] * 5, 6, ""),
]


def vllm_result(**overrides) -> dict:
    """The shape vllm/benchmarks/serve.py saves with --save-result --save-detailed."""
    ok = [r for r in REQUESTS if not r[4]]
    doc = {
        "date": "20260101-000000", "endpoint_type": "openai", "backend": "openai", "label": None,
        "model_id": "example-org/Example-8B", "tokenizer_id": "example-org/Example-8B",
        "num_prompts": len(REQUESTS), "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None,
        "duration": 1.6, "completed": len(ok), "failed": len(REQUESTS) - len(ok),
        "total_input_tokens": 512 * len(ok), "total_output_tokens": sum(r[3] for r in ok),
        "request_throughput": 1.9, "request_goodput": None, "output_throughput": 13.1,
        "total_token_throughput": 900.0,
        "input_lens": [512] * len(REQUESTS),
        "output_lens": [r[3] for r in REQUESTS],
        "ttfts": [r[1] for r in REQUESTS],
        "itls": [r[2] for r in REQUESTS],
        "latencies": [r[1] + sum(r[2]) if not r[4] else 0.0 for r in REQUESTS],
        "start_times": [T0 + r[0] for r in REQUESTS],
        "queue_times": [0.0] * len(REQUESTS),
        "generated_texts": ["x" * r[3] for r in REQUESTS],
        "errors": [r[4] for r in REQUESTS],
        "mean_ttft_ms": 250.0, "median_ttft_ms": 250.0, "p99_ttft_ms": 299.0,
    }
    doc.update(overrides)
    return doc


# --- p2p records, as the p2p benchmark writes them ------------------------------------------


def p2p_record(nbytes: int, samples, **overrides) -> dict:
    """A kvbench.p2p/1 record with exactly the fields the p2p benchmark writes."""
    s = np.asarray(samples, dtype=float)
    p50 = float(np.percentile(s, 50)) if len(s) else None
    rec = {
        "schema": "kvbench.p2p/1",
        "transport": "gloo",
        "pattern": "sequential",
        "granularity": "whole",
        "layout": "raw",
        "dtype": None,
        "device": "cpu",
        "model": None,
        "prompt_tokens": None,
        "bytes": int(nbytes),
        "world_size": 2,
        "hosts": ["node-a", "node-a"],
        "iters": len(s),
        "samples_ms": [float(v) for v in s],
        "p50_ms": p50,
        "p95_ms": float(np.percentile(s, 95)) if len(s) else None,
        "p99_ms": float(np.percentile(s, 99)) if len(s) else None,
        "mean_ms": float(s.mean()) if len(s) else None,
        "min_ms": float(s.min()) if len(s) else None,
        "max_ms": float(s.max()) if len(s) else None,
        "gbps": nbytes / GB / (p50 / 1000) if p50 else None,
        "cold_ms": 25.0,
        "wrong": 0,
        "argv": ["python", "-m", "kvbench.p2p", "--bytes", "..."],
        "env": {"torch": "2.13.0"},
        "timestamp": "2026-01-01T00:00:00Z",
    }
    rec.update(overrides)
    return rec


def synthetic(sizes, setup_ms, gb_s, *, n=40, noise=0.03, outliers=0.06, seed=0,
              time_fn=None, **overrides) -> list[dict]:
    """Samples drawn from setup + bytes/rate with multiplicative noise and slow outliers."""
    rng = np.random.default_rng(seed)
    out = []
    for b in sizes:
        t = time_fn(b) if time_fn else setup_ms + b / (gb_s * GB) * 1000
        s = t * (1 + noise * rng.standard_normal(n))
        k = rng.random(n) < outliers
        s[k] *= rng.uniform(2.0, 6.0, k.sum())  # stalls: always slower, often much slower
        out.append(p2p_record(b, s, **overrides))
    return out


SPEC = {"transport": "gloo", "transport_options": {}, "pattern": "sequential", "variant": None,
        "granularity": "whole", "layout": "raw", "block_size": None, "dtype": None,
        "device": "cpu", "pack_kernel": None, "model": None, "compute": None,
        "layer_poll": None, "world": {"size": 2, "prefill_ranks": [0], "decode_ranks": [1]},
        "hosts": ["node-a", "node-a"]}


def rounds_records(sizes, setup_ms, gb_s, *, rounds=20, noise=0.02, round_shift=0.02, seed=0,
                   run_id="run-a", time_fn=None, spec=None, **overrides) -> list[dict]:
    """Records of one p2p run in interleaved rounds, with the fields docs/contracts.md section 1
    adds: each round's load (round_shift) is shared by every size timed in it."""
    rng = np.random.default_rng(seed)
    spec = dict(SPEC if spec is None else spec)
    shift = rng.normal(0, round_shift, rounds)
    out = []
    for b in sizes:
        t = time_fn(b) if time_fn else setup_ms + b / (gb_s * GB) * 1000
        s = t * np.exp(shift + rng.normal(0, noise, rounds))
        out.append(p2p_record(b, s, spec=spec, spec_id=spec_id(spec), run_id=run_id,
                              order="rounds", sample_rounds=list(range(rounds)),
                              fit_as_link=True, not_link_reason=None, n_samples=rounds,
                              **overrides))
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- memory: the peak resident set of one command ---------------------------------------------

MiB = 2**20


_WRAPPER = ("import resource, subprocess, sys\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stderr.write(p.stderr)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def peak_rss(*argv: str) -> tuple[int, int]:
    """(exit status, peak RSS in bytes) of `python -m kvbench ARGV` in a fresh child of a small
    wrapper process (RUSAGE_CHILDREN), so earlier children of the test process cannot leak
    into the figure."""
    p = subprocess.run([sys.executable, "-c", _WRAPPER, sys.executable, "-m", "kvbench", *argv],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    rc, kib = p.stdout.split()
    assert int(rc) == 0, p.stderr[-2000:]
    return int(rc), int(kib) * 1024
