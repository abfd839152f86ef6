"""Helpers for the tests of scripts/gpu-check and scripts/gpu-wheels: load a script as a module
(its functions are then tested in-process), make small real wheels, run the check as a user
would, and the environment of a machine shaped like the GPU image (no mpirun on PATH)."""

from __future__ import annotations

import base64
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import PY, ROOT

CHECK = ROOT / "scripts" / "gpu-check"
WHEELS = ROOT / "scripts" / "gpu-wheels"


def load(script: Path):
    """The script as a module (registered, so that its dataclasses resolve their types)."""
    name = "script_" + script.name.replace("-", "_")
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.SourceFileLoader(name, str(script))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    sys.modules[name] = module
    loader.exec_module(module)
    return module


def sha256_field(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes | str],
               tag: str = "py3-none-any") -> Path:
    """A real wheel (installable by pip): the files, METADATA, WHEEL and a RECORD."""
    info = f"{dist}-{version}.dist-info"
    body = {**files,
            f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
            f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: kvbench-tests\n"
                             f"Root-Is-Purelib: true\nTag: {tag}\n"}
    path = folder / f"{dist}-{version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in body.items():
            data = data.encode() if isinstance(data, str) else data
            z.writestr(name, data)
            record.append(f"{name},{sha256_field(data)},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def image_path() -> str:
    """PATH without any folder that holds an mpirun (the GPU image has none) nor this venv."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not (Path(d) / "mpirun").exists() and Path(d) != Path(sys.executable).parent]
    return os.pathsep.join(keep)


def check_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment a user's shell gives the check: no PYTHON/PYTHONPATH/OUT from the test
    run, temporary files (the private prefix) under `tmp`, and `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "PYTHONPATH", "OUT", "MPI4PY_LIBMPI", "VIRTUAL_ENV", "MPIRUN")}
    env.update(TMPDIR=str(tmp), **extra)
    return env


def run_check(python: str, *args: str, env: dict[str, str], timeout: float = 300
              ) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(CHECK), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def prefixes(tmp: Path) -> list[Path]:
    """Private prefixes (and probe folders) the check left under `tmp`."""
    return sorted(tmp.glob("kvbench-gpu-*"))


def pip_python_venv(where: Path) -> str:
    """A bare venv (no pip, no packages of its own) from this interpreter's base."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    return str(where / "bin" / "python")


def system_python_with_pip() -> str | None:
    """Debian's /usr/bin/python3 when it has pip (its install scheme is posix_local)."""
    py = shutil.which("python3", path="/usr/bin")
    if not py:
        return None
    res = subprocess.run([py, "-m", "pip", "--version"], capture_output=True, timeout=60)
    return py if res.returncode == 0 else None


# gpu-check as a module, and its execute() with harmless steps (shared by its tests)
gc = load(CHECK)


def execute(tmp_path: Path, steps, out: Path, archive: Path | None = None, facts=None) -> int:
    """gc.execute with harmless steps (steps(the new folder) -> [Step])."""
    return gc.execute(steps, out, gc.Setup(PY, gc.base_env()),
                      {"python": "test"} if facts is None else facts, ["--one-gpu"], "one", archive)
