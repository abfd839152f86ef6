"""`kvbench sweep --client`: the parts that need no running vLLM (the lab test runs the tools).

Finding each tool in its own venv, refusing to resume a sweep with another client, the sweep's
conversion step on the committed real exports, and how a run's workload reaches each tool's
flags (the same rate, count, lengths, seed and ignore_eos for every client).
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from kvbench.cli import UsageError
from kvbench.lab.load import bench
from kvbench.lab.load.clients import client_run, find_client
from kvbench.lab.sweep.main import Point, Sweep, conversion_failure, open_out

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lab-plan.yaml"
CLIENTS = ROOT / "tests" / "data" / "clients"
RUN = bench.BenchRun("http://127.0.0.1:19000", "tiny", "/models/tiny", 2.5, 17, 256, 32, 7)


def test_find_client_own_venv_then_path_else_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CLIENTS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match=r"`aiperf` not found .*pip install aiperf==0\.13\.0"):
        find_client("aiperf", None)
    exe = tmp_path / "home" / "guidellm" / "bin" / "guidellm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert find_client("guidellm", None) == str(exe)


def test_sweep_resumes_only_with_the_same_client(tmp_path):
    out = tmp_path / "sweep"
    open_out(out, str(EXAMPLE), [], "aiperf")
    assert json.loads((out / "sweep.json").read_text())["client"] == "aiperf"
    open_out(out, str(EXAMPLE), [], "aiperf")
    with pytest.raises(UsageError, match="driven by --client aiperf; use a new --out folder for --client vllm"):
        open_out(out, str(EXAMPLE), [], "vllm")
    old = tmp_path / "old"  # a sweep folder from before --client: vLLM's
    open_out(old, str(EXAMPLE), [])
    meta = json.loads((old / "sweep.json").read_text())
    del meta["client"]
    (old / "sweep.json").write_text(json.dumps(meta))
    open_out(old, str(EXAMPLE), [], "vllm")
    with pytest.raises(UsageError, match="driven by --client vllm"):
        open_out(old, str(EXAMPLE), [], "guidellm")


@pytest.mark.parametrize("tool, src", [("aiperf", "aiperf-0.13.0"), ("guidellm", "guidellm-0.8.1")])
def test_sweep_converts_each_clients_result_with_the_point_labels(tmp_path, tool, src):
    from kvbench.lab.planfile import load_lab_plan

    plan, lab = load_lab_plan(str(EXAMPLE))
    sweep = Sweep(plan, lab, tmp_path, "/bin/false", tool)
    point = Point("warm", "disaggregated", 2.0, 1)
    folder = point.folder(tmp_path)
    result = client_run(tool, "x", RUN, folder).result
    shutil.copytree(CLIENTS / src, result if tool == "aiperf" else result.parent)
    out = sweep.convert(point, folder, result)
    assert out == folder / "records.jsonl", (folder / "convert.log").read_text()
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 20 and {(r["deployment"], r["cache_state"], r["offered_rate_rps"]) for r in recs} == \
        {("disaggregated", "warm", 2.0)}
    out.unlink()
    bad = Sweep(plan, lab, tmp_path, "/bin/false", tool).convert(Point("warm", "aggregated", 4.0, 1), folder,
                                                                 result)
    assert bad is None and "differs from" in (folder / "convert.log").read_text()  # 4 rps claimed, 2 run
    why = conversion_failure(folder)  # the point's reason names the converter's own words
    assert why.startswith("conversion failed: ") and "differs from" in why, why


def test_each_client_gets_the_same_open_loop_workload(tmp_path):
    a = client_run("aiperf", "aiperf", RUN, tmp_path).cmd
    g = client_run("guidellm", "guidellm", RUN, tmp_path).cmd
    v = client_run("vllm", "vllm", RUN, tmp_path).cmd

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert (flag(a, "--request-rate"), flag(a, "--arrival-pattern"), flag(a, "--request-count")) == \
        ("2.5", "poisson", "17")
    assert (flag(a, "--isl"), flag(a, "--osl"), flag(a, "--random-seed")) == ("256", "32", "7")
    assert "--use-server-token-count" in a and flag(a, "--extra-inputs") == "ignore_eos:true"
    assert flag(g, "--profile") == "kind=poisson,rate=2.5" and flag(g, "--constraint") == "kind=max_requests,count=17"
    assert flag(g, "--data") == "kind=synthetic_text,prompt_tokens=256,output_tokens=32"
    assert "extras.body.ignore_eos=true" in flag(g, "--backend") and flag(g, "--seed") == "kind=static,value=7"
    assert (flag(v, "--request-rate"), flag(v, "--num-prompts"), flag(v, "--seed")) == ("2.5", "17", "7")
    warm_a = client_run("aiperf", "aiperf", RUN, tmp_path, prepass=True)
    warm_g = client_run("guidellm", "guidellm", RUN, tmp_path, prepass=True)
    assert flag(warm_a.cmd, "--concurrency") == "4" and "--request-rate" not in warm_a.cmd
    assert flag(warm_g.cmd, "--profile") == "kind=concurrent,streams=4"
    assert warm_a.result != client_run("aiperf", "aiperf", RUN, tmp_path).result


def test_start_up_allowance_delays_the_stall_watch(tmp_path):
    """A client silent through its start-up is not a stalled deployment; without the allowance
    the same silence is killed as a stall (the fault the lab test met with GuideLLM)."""
    cmd = ["sh", "-c", "sleep 3"]

    def flat():
        return (0,)

    ok, why = bench.run_bounded(cmd, tmp_path / "a.log", 600, flat, 0.5, {}, startup_s=600)
    assert (ok, why) == (True, "")
    ok, why = bench.run_bounded(cmd, tmp_path / "b.log", 600, flat, 0.5, {})
    assert not ok and "no token generated" in why
    ok, why = bench.run_bounded(["sh", "-c", "exit 3"], tmp_path / "c.log", 600, env_extra={})
    assert not ok and why == "sh exited 3 (see c.log)"


def test_sweep_without_the_client_installed_is_one_line(tmp_path, monkeypatch):
    import kvbench.lab.sweep.main
    from tests.helpers import run

    monkeypatch.setenv("KVBENCH_CLIENTS_HOME", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setattr(kvbench.lab.sweep.main.labenv, "missing_reason", lambda: None)  # CI may lack the lab venv
    rc, _, err = run(kvbench.lab.sweep.main.cli, EXAMPLE, "--client", "guidellm", "--out", tmp_path / "s")
    assert rc == 2 and err.count("\n") == 1 and "pip install guidellm==0.8.1" in err, err
    assert not (tmp_path / "s").exists()
    rc, _, err = run(kvbench.lab.sweep.main.cli, EXAMPLE, "--client", "locust")
    assert rc == 2 and "invalid choice: 'locust'" in err


def test_report_provenance_names_the_load_generator(tmp_path):
    from kvbench.lab.sweep.report import provenance

    for client, label in (("aiperf", "aiperf 0.13.0"), ("guidellm", "guidellm 0.8.1"), ("vllm", "vllm bench serve")):
        out = tmp_path / client
        open_out(out, str(EXAMPLE), [], client)
        assert provenance(out)["client"] == label
