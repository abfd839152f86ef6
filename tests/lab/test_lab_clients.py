"""The `lab` group: AIPerf and GuideLLM driven by the sweep's own code against the lab's vLLM.

One aggregated deployment is brought up once; for each client the sweep runs one short
open-loop point (kvbench.lab.sweep.main.Sweep.run_point: the client from its own venv, bounded,
/metrics scraped) and converts it with `kvbench slo convert --from CLIENT`; the records are
then judged by `kvbench slo analyze --plan`. Kept short for the lab group's CI time: 12
requests at 2 rps per client. A client whose venv is missing is skipped with the install line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import UsageError
from kvbench.lab.load.clients import find_client
from kvbench.lab.stack import env as labenv

ROOT = Path(__file__).resolve().parents[2]
REASON = labenv.missing_reason()
pytestmark = [pytest.mark.lab, pytest.mark.skipif(REASON is not None, reason=str(REASON))]
BASE = 19500


def available(tool: str) -> tuple[str | None, str]:
    try:
        return find_client(tool, None), ""
    except UsageError as exc:
        return None, str(exc)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    """The example plan on the test port block: cold only, warm-up 2, 5 s at 2 rps (12 requests)."""
    text = (ROOT / "examples" / "lab-plan.yaml").read_text()
    text = text.replace("base_port: 19000", f"base_port: {BASE}").replace(
        "cache_state: [cold, warm]", "cache_state: [cold]")
    text = re.sub(r"offered_rates_rps: \[[^]]*\]", "offered_rates_rps: [2]", text)
    text = text.replace("warmup_requests: 5", "warmup_requests: 2").replace("duration_seconds: 30",
                                                                            "duration_seconds: 5")
    assert "[cold]" in text and "[2]" in text and "duration_seconds: 5" in text
    path = tmp_path_factory.mktemp("clients") / "plan.yaml"
    path.write_text(text)
    return path


def kvbench(*args, env_extra=None, timeout=900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    r = subprocess.run([sys.executable, "-m", "kvbench", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("tool", ["aiperf", "guidellm"])
def test_client_runs_against_the_lab_and_converts(plan, tmp_path, tool, lab_aggregated):
    exe, why = available(tool)
    if exe is None:
        pytest.skip(why)
    from kvbench.lab.planfile import load_lab_plan
    from kvbench.lab.stack.deploy import model_for
    from kvbench.lab.sweep.main import Point, Sweep, lab_target

    p, lab = load_lab_plan(str(plan))
    target = lab_target(lab_aggregated, model_for(lab))
    sweep = Sweep(p, lab, tmp_path, exe, tool)
    res = sweep.run_point(Point("cold", "aggregated", 2.0, 1), target)
    folder = Point("cold", "aggregated", 2.0, 1).folder(tmp_path)
    assert res["status"] == "done", f"{res['reason']}\n{(folder / f'{tool}-bench.log').read_text()[-3000:]}"
    assert res["client"] == tool and res["num_prompts"] == 12 and res["scrape"]
    recs = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    # every one of the 12 is a record, or named by the client's own counts as still in flight
    # when it ended (GuideLLM 0.8.1 can end a max_requests run with one still processing:
    # kvbench.slo.guidellm.Shortfall); a request lost any other way fails here
    gap = res["client_shortfall"]
    assert gap is None or (gap["created"] == 12 and gap["processing"] == gap["missing"]), gap
    made = 12 - (gap["missing"] if gap else 0)
    assert len(recs) == made and all(r["cache_state"] == "cold" and r["offered_rate_rps"] == 2.0 for r in recs)
    ok = [r for r in recs if r["status"] == "ok"]
    assert ok and all(r["output_tokens"] == 32 for r in ok)  # ignore_eos reached the server
    # both tools record the schedule; GuideLLM 0.8.1's Poisson workers can read its shared
    # offset before it is set and schedule from -1.0 s (kvbench.slo.guidellm._target): then the
    # converter says so, and the analysis must call the schedule unknown, not judge a lag
    lost = tool == "guidellm" and "not Unix times near" in (folder / "convert.log").read_text()
    assert all(r["scheduled_send_ms"] is not None for r in recs) or lost
    assert all(r.get("chunk_gaps_recorded", True) == (tool == "aiperf") for r in ok)
    report = json.loads(kvbench("slo", "analyze", folder / "records.jsonl", "--plan", plan, "--format",
                                "json").stdout)
    (g,) = report["groups"]
    assert g["counts"]["records"] == made
    if lost and not all(r["scheduled_send_ms"] is not None for r in recs):
        assert not g["client"]["scheduled_send_known"] and g["client"]["send_lag_ms"] is None
        return
    assert g["counts"]["warmup_excluded"] == 2
    assert g["latency_ms"]["ttft"]["n"] == g["counts"]["ok"] > 0
    assert g["client"]["send_lag_ms"] is not None  # the send-lag gate is evaluated for both


@pytest.fixture(scope="module")
def lab_aggregated(plan, tmp_path_factory):
    """`kvbench lab up --deployment aggregated` once for the module; `lab down` afterwards."""
    from kvbench.lab.stack import procs

    run = {"KVBENCH_LAB_RUN": str(tmp_path_factory.mktemp("labrun"))}
    kvbench("lab", "up", plan, "--deployment", "aggregated", env_extra=run)
    try:
        yield procs.LabState.from_json((Path(run["KVBENCH_LAB_RUN"]) / "aggregated.json").read_text())
    finally:
        kvbench("lab", "down", env_extra=run)
