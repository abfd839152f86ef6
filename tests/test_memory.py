"""Memory bounds of the readers that grew with their input (issue 25, group 2).

Each command runs in a fresh child of a small wrapper process that reports the child's peak
resident set (`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`), so earlier children of the
test process cannot leak into the figure. Bounds are generous (2-4x what the fixed code
uses, docs/robustness.md) and each planted input broke them before the fix: the 1,000-size
fit peaked at 3.8 GB, convert-vllm at ~15x its file, analyze kept every 4 KB request id.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import ANALYZE, cohort_lines, run

MiB = 2**20
_WRAPPER = ("import resource, subprocess, sys\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stderr.write(p.stderr)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def peak_rss(*argv: str) -> tuple[int, int]:
    """(exit status, peak RSS in bytes) of `python -m kvbench ARGV` in a fresh child."""
    p = subprocess.run([sys.executable, "-c", _WRAPPER, sys.executable, "-m", "kvbench", *argv],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    rc, kib = p.stdout.split()
    assert int(rc) == 0, p.stderr[-2000:]
    return int(rc), int(kib) * 1024


def p2p_sizes_file(path, n_sizes: int, samples: int = 5):
    """n_sizes distinct payload sizes, a few samples each (a 1,000-size file is ~1.2 MB)."""
    rec = json.loads((ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl").read_text().splitlines()[0])
    for k in ("env", "transport_info"):
        rec.pop(k)
    rng = random.Random(1)
    with open(path, "w") as fh:
        for k in range(n_sizes):
            b = 4096 * (k + 1)
            ms = [0.05 + b / 1e6 * (1 + 0.05 * rng.random()) for _ in range(samples)]
            fh.write(json.dumps({**rec, "argv": [], "bytes": b, "samples_ms": ms, "iters": samples,
                                 "warmup_ms": []}) + "\n")


def test_fit_over_a_thousand_sizes_stays_small(tmp_path):
    """The lack-of-fit test was a (241, K, K) stack of solves: 3.8 GB at K = 1,000."""
    p2p_sizes_file(tmp_path / "s.jsonl", 1000)
    _, peak = peak_rss("fit", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "f.json"))
    assert peak < 600 * MiB, f"fit over 1,000 sizes peaked at {peak / MiB:.0f} MiB"


def test_fit_refuses_more_sizes_than_it_can_bound(tmp_path, monkeypatch):
    import kvbench.fit.cli
    import kvbench.fit.fitting

    monkeypatch.setattr(kvbench.fit.fitting, "MAX_SIZES", 20)
    p2p_sizes_file(tmp_path / "s.jsonl", 21)
    rc, _, err = run(kvbench.fit.cli.cli, tmp_path / "s.jsonl", "--out", tmp_path / "f.json")
    assert rc == 2 and err.count("\n") == 1 and "21 distinct payload sizes" in err, err
    assert not (tmp_path / "f.json").exists()


def vllm_file(path, n: int, chunks: int) -> int:
    """A vllm bench serve result with short ITL literals (the most floats per byte)."""
    rng = random.Random(0)
    itls = [[rng.choice((0.02, 0.03, 0.01)) for _ in range(chunks)] for _ in range(n)]
    doc = {"request_rate": 4.0, "max_concurrency": None, "input_lens": [512] * n,
           "output_lens": [chunks + 1] * n, "ttfts": [0.25] * n, "itls": itls,
           "latencies": [0.25 + sum(i) for i in itls], "start_times": [1000.0 + k / 4 for k in range(n)],
           "errors": [""] * n}
    path.write_text(json.dumps(doc))
    return path.stat().st_size


def test_convert_vllm_peak_follows_the_stated_bound(tmp_path):
    """docs/robustness.md: peak <= 10 x the file above the interpreter's own footprint."""
    vllm_file(tmp_path / "small.json", 4, 4)
    _, base = peak_rss("slo", "convert-vllm", str(tmp_path / "small.json"), "--deployment", "agg",
                       "--out", str(tmp_path / "small.jsonl"))
    size = vllm_file(tmp_path / "v.json", 4000, 900)
    _, peak = peak_rss("slo", "convert-vllm", str(tmp_path / "v.json"), "--deployment", "agg",
                       "--out", str(tmp_path / "v.jsonl"))
    assert peak - base <= 10 * size, (f"{(peak - base) / size:.1f}x the {size / MiB:.0f} MiB file "
                                      f"({peak / MiB:.0f} MiB peak, {base / MiB:.0f} MiB base)")


def long_id_records(path, n: int) -> int:
    base = cohort_lines()
    ids = 0
    with open(path, "w") as fh:
        for k in range(n):
            rid = f"{k:08d}" + "x" * 4000
            ids += len(rid)
            fh.write(json.dumps({**base[k % len(base)], "request_id": rid}) + "\n")
    return ids


@pytest.mark.parametrize("n", [25_000])
def test_analyze_does_not_keep_request_ids(tmp_path, n):
    """Duplicate ids are found from a 16-byte digest per request, not the ids themselves."""
    long_id_records(tmp_path / "small.jsonl", 100)
    _, base = peak_rss("slo", "analyze", str(tmp_path / "small.jsonl"), *ANALYZE, "--format", "json")
    ids = long_id_records(tmp_path / "r.jsonl", n)
    _, peak = peak_rss("slo", "analyze", str(tmp_path / "r.jsonl"), *ANALYZE, "--format", "json")
    assert peak - base < ids / 2, (f"{(peak - base) / MiB:.0f} MiB above the 100-record run for "
                                   f"{ids / MiB:.0f} MiB of request ids")
