"""The one-GPU check's install and preflight rehearsed on CPU, as they run on the GPU machine.

A venv shaped like the GPU image: a plain Python (this machine's) with torch 2.13.0 from
local disk, numpy, scipy, pyyaml and **mpi4py 4.1.2 already installed**; no pydantic, no
kvbench installed (the checkout is the working folder, as there), and no `mpirun` on PATH.
scripts/gpu-wheels --nixl fetches the carried wheels for this Python, and
`scripts/gpu-check --one-gpu --wheels DIR --preflight-only` runs through that venv's
interpreter: the install into a private prefix, each carried distribution imported from
there (NIXL's stripped nixl_cu13 among them, with a UCX agent made), mpirun found in the
prefix, and a 2-rank handoff on --device cpu with its data checked. It must pass; with
pydantic's wheel taken out it must fail within 60 s, in one line naming pydantic, with no
step run and no prefix left. The first GPU lease's failure (pydantic installed but not on
the path, because mpi4py was "already installed") fails the first test.

What it does not prove (docs/gpu.md): anything about CUDA, the GPU image's own libraries
(its torch, CuPy, NCCL), the steps after the preflight, or Python 3.12 wheels (these are
this machine's Python's). Marked `network` (PyPI): where the index cannot be reached the
fetch skips and says so; any other fetch failure fails. The venv is kept under
~/.cache/kvbench (keyed by the versions in it); pip's own cache keeps the wheels."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, pip_failure
from tests.p2p.gpu_script import WHEELS, check_env, image_path, prefixes, run_check

pytestmark = [pytest.mark.network, pytest.mark.mpi, pytest.mark.slow]

PY_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
# what the GPU image holds that the preflight touches (torch from this machine's disk)
IMAGE = ("torch==2.13.0", f"numpy=={importlib.metadata.version('numpy')}",
         f"scipy=={importlib.metadata.version('scipy')}", f"pyyaml=={importlib.metadata.version('pyyaml')}",
         "mpi4py==4.1.2")
PIP_TIMEOUT_S = 900


def pip_or_skip(cmd: list[str], what: str, **kw) -> None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, **kw)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{what} took over {PIP_TIMEOUT_S} s: the package index is too slow here")
    if res.returncode != 0:
        if pip_failure(res.stderr) == "unreachable":
            pytest.skip(f"the package index is unreachable from here ({what}): {res.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"{what} failed (not a network error):\n{res.stderr[-3000:]}{res.stdout[-2000:]}")


def image_ok(py: Path) -> bool:
    if not py.exists():
        return False
    res = subprocess.run([str(py), "-c", "import torch, numpy, scipy, yaml, mpi4py"],
                         capture_output=True, timeout=300)
    return res.returncode == 0


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbench"


@pytest.fixture(scope="module")
def image_python() -> str:
    """The image-shaped venv, built once per set of versions and kept (built aside, then
    renamed into place, so a half-built one is never used)."""
    key = hashlib.sha256(" ".join((PY_VERSION, *IMAGE)).encode()).hexdigest()[:12]
    home = cache_root() / f"gpu-image-py{PY_VERSION}-{key}"
    if image_ok(home / "bin" / "python"):
        return str(home / "bin" / "python")
    home.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
    try:
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(build)], check=True, timeout=300)
        pip_or_skip([str(build / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:",
                     *IMAGE], "building the image-shaped venv")
        shutil.rmtree(home, ignore_errors=True)
        os.rename(build, home)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    assert image_ok(home / "bin" / "python")
    return str(home / "bin" / "python")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("carried") / "whl"
    pip_or_skip([sys.executable, str(WHEELS), "--nixl", str(where)], "scripts/gpu-wheels --nixl",
                env={**os.environ, "PY_VERSION": PY_VERSION})
    return where


def shaped_like_the_image(py: str) -> None:
    """The rehearsal's premise: the venv already holds mpi4py 4.1.2 and lacks pydantic,
    kvbench and mpirun."""
    code = ("import importlib.metadata as m, importlib.util as u\n"
            "print(m.version('mpi4py'), [n for n in ('pydantic', 'kvbench') if u.find_spec(n)])")
    got = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True,
                         cwd="/", timeout=120).stdout.split(maxsplit=1)
    assert got == ["4.1.2", "[]\n"] or got == ["4.1.2", "[]"], got
    assert shutil.which("mpirun", path=image_path()) is None


def test_the_preflight_passes_in_a_venv_shaped_like_the_gpu_image(image_python, wheels, tmp_path):
    shaped_like_the_image(image_python)
    size = sum(p.stat().st_size for p in wheels.iterdir())
    assert size <= 60 * 2**20, size  # a carried tree may hold 64 MiB
    t0 = time.monotonic()
    res = run_check(image_python, "--one-gpu", "--wheels", str(wheels), "--preflight-only",
                    env=check_env(tmp_path, PATH=image_path()))
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr + res.stdout
    out = res.stdout
    assert f"installed {len(list(wheels.glob('*.whl')))} wheels into {tmp_path}/kvbench-gpu-env-" in out
    assert "runs on --device cpu" in out and "preflight passed" in out
    assert "mpi4py 4.1.2" in out and "pydantic 2.14.4" in out  # the carried list, from the prefix
    assert f"mpirun: {tmp_path}/kvbench-gpu-env-" in out
    assert "nixl: module nixl_cu13 1.5.1 (what kvbench's nixl transport imports); an agent " \
           "with the UCX backend was made" in out
    assert "2 ranks, --device cpu, 1 MiB, data checked: ok" in out
    assert not prefixes(tmp_path)
    print(f"preflight with the install: {took:.1f} s", file=sys.stderr)


def test_without_pydantic_the_preflight_fails_fast_naming_it(image_python, wheels, tmp_path):
    shaped_like_the_image(image_python)
    short = tmp_path / "whl"
    short.mkdir()
    for p in wheels.glob("*.whl"):
        if not p.name.startswith("pydantic-"):
            os.link(p, short / p.name)
    t0 = time.monotonic()
    res = run_check(image_python, "--one-gpu", "--wheels", str(short), "--preflight-only",
                    env=check_env(tmp_path, PATH=image_path()), timeout=60)
    err = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in err and "Traceback" not in res.stderr, res.stderr
    assert err.startswith("gpu-check: error: preflight failed, no step run: pydantic")
    assert "No module named 'pydantic'" in err
    assert "[1]" not in res.stdout and not prefixes(tmp_path)
    print(f"refused in {time.monotonic() - t0:.1f} s: {err}", file=sys.stderr)


def test_the_stripped_nixl_wheel_installs_with_a_record_pip_and_python_agree_on(wheels, tmp_path):
    """Installed by pip from the stripped wheel, every file the RECORD names is there with the
    hash and size the RECORD gives (read back by the standard library), and nothing of
    nixl_ep, perftest or the scripts is."""
    nixl = next(wheels.glob("nixl_cu13-*.whl"))
    assert nixl.stat().st_size < 32 * 2**20
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--ignore-installed", "--prefix", str(tmp_path), str(nixl)], check=True,
                   capture_output=True, timeout=600, cwd=ROOT)
    site = next(tmp_path.rglob("nixl_cu13-1.5.1.dist-info")).parent
    dist = next(importlib.metadata.distributions(path=[str(site)]))
    checked = 0
    for f in dist.files:
        if f.hash is None:
            continue
        data = Path(f.locate()).read_bytes()
        assert (hashlib.new(f.hash.mode, data).digest(), len(data)) == \
               (__import__("base64").urlsafe_b64decode(f.hash.value + "=="), f.size), f
        checked += 1
    assert checked > 100
    assert not [f for f in dist.files if "nixl_ep" in str(f) or "perftest" in str(f)
                or ".scripts/" in str(f)]
