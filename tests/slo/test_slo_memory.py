"""Memory bounds of `kvbench slo`'s readers on inputs that grow: convert-vllm's peak follows its
stated bound (it was ~15x its file), and analyze does not keep every request id (it kept each
4 KB id). Each command runs in a fresh child whose peak resident set is measured
(`tests.helpers.peak_rss`); bounds are generous, 2-4x what the fixed code uses
(docs/robustness.md), and each planted input broke them before the fix.
(Found by issue 25, group 2.)
"""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers import ANALYZE, MiB, cohort_lines, peak_rss


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
