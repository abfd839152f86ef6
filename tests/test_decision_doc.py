"""docs/decision.md runs as written, and the tutorial's values are labelled as assumptions.

Every command in the doc's ```console blocks (a line starting `$ `) is run from a scratch
folder that sees the clone's `results/` and `examples/` (so what a command writes stays out
of the tree), in order, as a subprocess; it must exit 0 and print every output line the doc
shows under it. Commands under MPI (`mpirun`, `srun`) are not run here (tests/p2p runs p2p
under mpirun). The lab's commands (`kvbench sweep`, `kvbench faults`) need a real vLLM and
minutes per point: here their arguments are parsed by their own parsers and their plan is
loaded by the lab's loader (equal budget, the `lab:` section); `make test-lab`
(tests/lab/test_lab.py) runs both commands for real. The checker is proven on planted docs.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOC = ROOT / "docs" / "decision.md"
BLOCK = re.compile(r"(?ms)^```console\n(.*?)^```")
MPI = ("mpirun", "srun")
LAB = ("sweep", "faults", "lab")


@dataclass
class Step:
    command: str
    shown: list[str] = field(default_factory=list)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command)

    @property
    def kind(self) -> str:
        argv = self.argv
        if argv[0] in MPI:
            return "mpi"
        if argv[0] == "kvbench" and argv[1] in LAB:
            return "lab"
        return "run"


def steps(text: str) -> list[Step]:
    """The `$ ` commands of every console block (a trailing `\\` continues a line), each
    with the output lines shown under it."""
    out: list[Step] = []
    for block in BLOCK.findall(text):
        pending = ""
        for line in block.splitlines():
            if pending or line.startswith("$ "):
                pending += line.removeprefix("$ ")
                if pending.endswith("\\"):
                    pending = pending[:-1]
                    continue
                out.append(Step(pending.strip()))
                pending = ""
            elif line.strip() and out:
                out[-1].shown.append(line.strip())
    return out


def executable(argv: list[str]) -> list[str]:
    """`kvbench X` and `python -m ...` with the interpreter running the tests."""
    if argv[0] == "kvbench":
        return [sys.executable, "-m", "kvbench", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return argv


def workdir(tmp: Path, root: Path = ROOT) -> Path:
    for name in ("results", "examples"):
        (tmp / name).symlink_to(root / name, target_is_directory=True)
    return tmp


def run_step(step: Step, cwd: Path) -> list[str]:
    """What is wrong with one command as the doc writes it (empty: nothing)."""
    try:
        res = subprocess.run(executable(step.argv), cwd=cwd, capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"{step.command}: {e}"]
    if res.returncode != 0:
        return [f"{step.command}: exit {res.returncode}: {res.stderr.strip()[-500:]}"]
    return [f"{step.command}: shown but not printed: {line!r}"
            for line in step.shown if line != "..." and line not in res.stdout]


def check_lab_step(step: Step) -> list[str]:
    """A lab command's flags through its own parser, its plan through the lab's loader."""
    import importlib

    from kvbench.__main__ import COMMANDS
    from kvbench.lab.planfile import load_lab_plan

    argv = step.argv
    module = importlib.import_module(COMMANDS[argv[1]][0])
    try:
        args = module.build_parser().parse_args(argv[2:])
    except SystemExit:
        return [f"{step.command}: its parser refuses it"]
    plan = ROOT / getattr(args, "plan", argv[2])
    _, lab = load_lab_plan(plan)
    return [] if lab is not None else [f"{step.command}: {plan} has no lab: section"]


def doc_problems(text: str, cwd: Path) -> list[str]:
    bad = []
    for step in steps(text):
        if step.kind == "run":
            bad += run_step(step, cwd)
        elif step.kind == "lab":
            bad += check_lab_step(step)
    return bad


@pytest.mark.slow  # about ten commands as subprocesses: 27 s on the busy 2-core VM
def test_every_command_of_the_decision_doc_runs_as_written(tmp_path):
    all_steps = steps(DOC.read_text())
    kinds = [s.kind for s in all_steps]
    assert kinds.count("run") >= 8 and "mpi" in kinds and kinds.count("lab") == 2
    assert doc_problems(DOC.read_text(), workdir(tmp_path)) == []


def test_the_doc_runner_catches_what_is_planted(tmp_path):
    """A command that fails, one whose shown output it does not print, a lab command its
    parser refuses: each is named; MPI lines are not run."""
    planted = "\n".join([
        "```console",
        "$ kvbench model --format table",
        "seed-70b-gqa bf16: 2000 tokens x 327,680 B/token",
        "  a line kvbench never prints",
        "$ kvbench plan --gbps 0 --setup-ms 1",
        "$ kvbench sweep examples/lab-plan.yaml --no-such-flag",
        "$ mpirun -n 2 python -m kvbench.p2p \\",
        "    --sizes 300",
        "```",
    ])
    got = steps(planted)
    assert [s.kind for s in got] == ["run", "run", "lab", "mpi"]
    assert got[3].command == "mpirun -n 2 python -m kvbench.p2p     --sizes 300"
    bad = doc_problems(planted, workdir(tmp_path))
    assert len(bad) == 3, bad
    assert "shown but not printed: 'a line kvbench never prints'" in bad[0]
    assert bad[1].startswith("kvbench plan --gbps 0 --setup-ms 1: exit 2")
    assert "its parser refuses it" in bad[2]


def test_the_readme_links_the_decision_doc_and_the_doc_keeps_its_sources():
    assert "(docs/decision.md)" in (ROOT / "README.md").read_text()
    text = DOC.read_text()
    for needed in ("https://docs.vllm.ai/en/latest/features/disagg_prefill/", "experimental",
                   "DOES NOT improve throughput", "chunked prefill", "OSDI 2024", "7.4x",
                   "DeepSpeed-MII", "over 90%", "ISCA 2024", "FAST 2025",
                   "single-request lower bound", "What kvbench cannot tell you"):
        assert needed in text, needed
    assert not re.search(r"20\d\d-\d\d-\d\d", text), "a dated run belongs in docs/findings.md"


# ---------------------------------------------------------------------------
# the labels


def kvbench_out(*argv: str) -> str:
    res = subprocess.run([sys.executable, "-m", "kvbench", *argv], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return res.stdout


ASSUMED = "the tutorial's assumption, not a measurement"


def test_kvbench_model_labels_the_tutorials_values_as_assumptions():
    doc = json.loads(kvbench_out("model", "--format", "json"))
    labels = doc["not_measured"]
    for what in ("model seed-70b-gqa", "link rate(s) 100, 25, 10 GB/s", "setup 1 ms",
                 "budget 20 ms", "short prompt 300 tokens"):
        assert any(x.startswith(what) and x.endswith(ASSUMED) for x in labels), (what, labels)
    table = kvbench_out("model", "--format", "table")
    assert f"  not measured: link rate(s) 100, 25, 10 GB/s: {ASSUMED}" in table.splitlines()
    # a real model and the user's own link are not the tutorial's, and say so
    mine = json.loads(kvbench_out("model", "--model", "llama-3.1-8b", "--links-gbps", "40",
                                  "--setup-ms", "0.5", "--format", "json"))["not_measured"]
    assert not any("seed-70b-gqa" in x for x in mine)
    assert "link rate(s) 40 GB/s: given (--links-gbps), not measured" in mine


ROUTE_EXAMPLE = ("plan", "route", "--gbps", "10", "--setup-ms", "1", "--prompt-tokens", "300",
                 "--local-interference-ms", "2", "--itl-p95-ms", "35", "--itl-target-ms", "50")


def test_plan_routes_worked_example_labels_every_assumed_input():
    doc = json.loads(kvbench_out(*ROUTE_EXAMPLE, "--format", "json"))
    labels = doc["not_measured"]
    for what in ("model seed-70b-gqa", "link rate(s) 10 GB/s", "setup 1 ms",
                 "local prefill interference 2 ms", "baseline ITL P95 35 ms",
                 "ITL target 50 ms"):
        assert any(x.startswith(what) and x.endswith(ASSUMED) for x in labels), (what, labels)
    table = kvbench_out(*ROUTE_EXAMPLE, "--format", "table").splitlines()
    assert f"  not measured: link rate(s) 10 GB/s: {ASSUMED}" in table
    assert f"  not measured: local prefill interference 2 ms: {ASSUMED}" in table


def test_a_fitted_link_is_not_labelled_but_the_plans_inputs_are(tmp_path):
    """With --fit the link is measured: no link label; the budget given stays labelled."""
    fit = ROOT / "tests" / "data" / "runs"
    fits = sorted(fit.rglob("*.fit.json"))
    if not fits:
        pytest.skip("no committed fit under tests/data/runs")
    doc = json.loads(kvbench_out("plan", "--fit", str(fits[0]), "--prompt-tokens", "300",
                                 "--budget-ms", "50", "--format", "json"))
    assert not any(x.startswith("link rate") for x in doc["not_measured"])
    assert "budget 50 ms: given (--budget-ms), not measured" in doc["not_measured"]


def test_a_given_link_is_labelled_given_not_the_tutorials():
    doc = json.loads(kvbench_out("plan", "--gbps", "8", "--setup-ms", "0.2", "--us-per-desc", "0.5",
                                 "--prompt-tokens", "300", "--block-size", "16", "--format", "json"))
    assert doc["not_measured"][1:4] == [
        "link rate(s) 8 GB/s: given (--gbps), not measured",
        "setup 0.2 ms: given (--setup-ms), not measured",
        "0.5 us per descriptor: given (--us-per-desc), not measured"]
