"""The lab's own calls to every internal command line it spawns, built by the lab's own code
with the values it passes, parsed by the same parser the spawned program uses.

Why (issue 39): the lab ran `python -m kvbench.lab.venv.tinymodel ... --seed=0` while that
module's bounded parser took seeds from 1: a machine that had the model cached never reached
the call, so only a fresh machine failed. Nothing here starts a service or builds a model."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.lab.agree import p2p as agree_p2p
from kvbench.lab.faults.main import client_cmd
from kvbench.lab.load import handoff
from kvbench.lab.planfile import load_lab_section
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.sweep.main import Point, convert_cmd, scrape_cmd
from kvbench.lab.sweep.report import analyze_cmd
from kvbench.lab.venv import tinymodel
from kvbench.lab.venv.tinymodel import TinyModelSpec
from kvbench.p2p.args import build_parser as p2p_parser
from kvbench.p2p.args import validate as p2p_validate
from kvbench.slo.cli import build_parser as slo_parser

PLAN = Path(__file__).resolve().parents[2] / "examples" / "lab-plan.yaml"


def _after(cmd: list[str], module: str) -> list[str]:
    """The arguments a spawned `python -m module` receives."""
    return cmd[cmd.index(module) + 1:]


def _tiny_config(tmp_path: Path, spec: TinyModelSpec) -> Path:
    """A config.json with the tiny model's geometry, as the built model folder holds it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": spec.hidden, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.intermediate, "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions, "torch_dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize("spec", [load_lab_section(PLAN).model, TinyModelSpec(),
                                  replace(TinyModelSpec(), seed=(1 << 32) - 1)],
                         ids=["lab-plan", "default", "largest-seed"])
def test_the_lab_builds_its_model_with_flags_the_model_builder_takes(spec):
    args = vars(tinymodel.parser().parse_args(["out", *tinymodel.spec_flags(spec)]))
    assert args.pop("out") == "out" and TinyModelSpec(**args) == spec


def test_the_model_builders_bounds_still_refuse_what_is_no_spec(capsys):
    with pytest.raises(SystemExit) as e:
        tinymodel.parser().parse_args(["out", "--layers=0"])
    assert e.value.code == 2 and "--layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tinymodel.parser().parse_args(["out", "--seed=-1"])


def test_the_labs_p2p_jobs_parse_and_validate_as_kvbench_p2p(tmp_path):
    cfg = _tiny_config(tmp_path, load_lab_section(PLAN).model)
    base = agree_p2p.base_flags(cfg, 16, 64, 40, 0).split()
    poll = tmp_path / "poll.json"
    cases = {name: base + extra.split()
             for name, extra in agree_p2p.configs({"2": poll}, True, {"2": (poll, 3.0)}).items()}
    cases["load.reference"] = _after(handoff.p2p_cmd(cfg, tmp_path), "kvbench.p2p")
    cases["load.engine"] = _after(handoff.engine_cmd(cfg, tmp_path, 500), "kvbench.p2p")
    for name, argv in cases.items():
        args = p2p_parser().parse_args(argv)
        if "draw:" not in " ".join(argv):  # a poll file is read when the job starts
            p2p_validate(args, world_size=2)
        assert args.transport == "nixl", name


def test_the_labs_slo_calls_parse_as_kvbench_slo(tmp_path):
    point = Point(cache_state="cold", deployment="disaggregated", rate_rps=0.5, repeat=1)
    metrics = {"prefill": ["http://127.0.0.1:8101/metrics"], "decode": ["http://127.0.0.1:8102/metrics"]}
    plan = type("Plan", (), {"path": str(PLAN)})()
    runs = [{"folder": tmp_path, "status": "done"}]
    (tmp_path / "scrape.jsonl").write_text("")
    calls = [scrape_cmd(metrics, tmp_path, 60.0, point),
             *(convert_cmd(c, point, tmp_path / "r.json", tmp_path / "o.jsonl")
               for c in ("vllm", "aiperf", "guidellm")),
             analyze_cmd(plan, runs, tmp_path / "f.json", tmp_path / "report")]
    for cmd in calls:
        argv = _after(cmd, "kvbench")
        assert argv[0] == "slo" and slo_parser().parse_args(argv[1:]).command == argv[1]


@pytest.mark.lab
def test_the_labs_proxy_and_client_calls_parse_in_the_lab_venv(tmp_path):
    """proxy and client import aiohttp, which only the lab's venv has: parsed there."""
    if not labenv.is_installed():
        pytest.skip(labenv.missing_reason())
    calls = {
        "kvbench.lab.venv.proxy": deploy.proxy_cmd("pd", 8100, tmp_path / "e.jsonl",
                                                   prefill=["http://127.0.0.1:8101"],
                                                   decode=["http://127.0.0.1:8102"]),
        "kvbench.lab.venv.client": client_cmd(tmp_path / "r.json", "http://127.0.0.1:8100",
                                              tmp_path / "o.jsonl", 120.0),
    }
    for module, cmd in calls.items():
        code = (f"import sys, json; from {module} import parser; "
                "parser().parse_args(json.loads(sys.argv[1]))")
        res = subprocess.run([str(labenv.lab_python()), "-c", code, json.dumps(_after(cmd, module))],
                             capture_output=True, text=True,
                             env={"PYTHONPATH": str(Path(deploy.REPO_ROOT))})
        assert res.returncode == 0, f"{module}: {res.stderr}"
