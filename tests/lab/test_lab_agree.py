"""`kvbench lab agree` against the real lab (lab group): one rate, one repeat, few iterations.

Checks the document, not the agreement: every field there, every number finite, both
predictions (engine-shaped, the replica of decode at the rate, the plain fit) present. The agreement itself is a benchmark
result (docs/lab.md, results/lab/agree-*), never a test threshold.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.lab.stack import env as labenv

ROOT = Path(__file__).resolve().parents[2]
REASON = labenv.missing_reason()
pytestmark = [pytest.mark.lab, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def _finite(x, where="doc"):
    if isinstance(x, float):
        assert math.isfinite(x), where
    elif isinstance(x, dict):
        for k, v in x.items():
            _finite(v, f"{where}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _finite(v, f"{where}[{i}]")


def test_agree_writes_both_predictions(tmp_path):
    text = (ROOT / "examples" / "lab-plan.yaml").read_text()
    text = text.replace("base_port: 19000", "base_port: 19500")
    text = re.sub(r"duration_seconds: \d+", "duration_seconds: 10", text)
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    out = tmp_path / "agree"
    r = subprocess.run([sys.executable, "-m", "kvbench", "lab", "agree", str(plan), "--rates", "1",
                        "--repeats", "1", "--p2p-iters", "10", "--out", str(out)],
                       capture_output=True, text=True, timeout=2400, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "agreement.json").read_text())
    _finite(doc)
    assert doc["schema"] == "kvbench.lab.agree/1" and doc["rates_rps"] == [1.0]
    (row,) = doc["agreement"]["rates"]
    assert row["engine_runs"] == 1
    for q in ("post", "xfer"):
        assert row["engine_mean_ms"][q] > 0
        assert row["engine_shaped"]["predicted_mean_ms"][q] > 0
        assert row["engine_shaped"]["ratio"][q]["mean"] > 0
        assert row["replica"]["predicted_mean_ms"][q] > 0  # decode at the rate: judged on it
    assert row["plain"]["predicted_mean_ms"] > 0 and row["plain"]["ratio"]["xfer"]["mean"] > 0
    costs = {c["config"] for c in doc["agreement"]["factor_costs"]}
    assert {"engine", "off:threads", "off:step-poll", "off:per-request", "kv-split",
            "waits-yield", "waits-spin", "unpinned"} <= costs
    effects = doc["agreement"]["feature_effects"]
    assert {e["feature"] for e in effects["main"]} == {"threads", "progress-thread",
                                                        "per-request", "step-poll"}
    assert len(effects["interactions"]) == 6
    md = (out / "agreement.md").read_text()
    assert "engine-shaped" in md and "plain fit" in md and "replica@1" in md
    assert doc["agreement"]["target_at_lowest_rate"]["post"]["prediction"] == "replica"
    # the engine's per-transfer trace sees exactly the transfers its own histograms count
    (run,) = doc["engine"]["1"]
    tr = run["transfers"]
    assert len(tr["xfer_ms"]) == run["metrics"]["xfer"]["count"]
    for q in ("post", "xfer"):
        assert sum(tr[f"{q}_ms"]) / len(tr[f"{q}_ms"]) == pytest.approx(
            run["metrics"][q]["mean"], rel=1e-3, abs=2e-3)
    assert doc["engine_warmup"]["transfers"]["xfer_ms"]  # the cold transfers, kept apart
    rem = row["remainder"]
    assert rem["engine"]["n"] == len(tr["xfer_ms"]) and rem["kvbench"]["n"] > 0
    assert "Where xfer goes beyond post" in md
