"""Memory bounds of `kvbench fit` on many payload sizes: a fit over 1,000 sizes stays small (its
lack-of-fit test was a (241, K, K) stack of solves, 3.8 GB at K = 1,000), and more sizes than
it can bound are refused. The peak resident set of a fresh child is measured
(`tests.helpers.peak_rss`); the bound is 2-4x what the fixed code uses (docs/robustness.md).
(Found by issue 25, group 2.)
"""

from __future__ import annotations

import json
import random

from tests.conftest import ROOT
from tests.helpers import MiB, peak_rss, run


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
