"""Finding Mooncake and the system libraries its binaries need, without changing the system.

The wheel (`mooncake-transfer-engine-non-cuda`) links `libibverbs.so.1` and `libnuma.so.1`
(Debian's libibverbs1, libnuma1; libibverbs1 pulls libnl-3-200 and libnl-route-3-200). An
RDMA node has them. Elsewhere, installing libibverbs1 system-wide breaks another stack on
the same machine: NIXL's CUDA-13 build (nixl-cu13 1.5.1 and its bundled UCX) crashes at
interpreter exit (SIGSEGV) once it finds libibverbs and no RDMA device (docs/mooncake.md).

So kvbench keeps a private copy: `fetch()` downloads the Debian packages with `apt-get
download` (no install) and unpacks them with `dpkg-deb -x` into a cache folder of its own;
`preload()` loads them by absolute path with RTLD_GLOBAL before `mooncake` is imported, so
the dynamic loader satisfies Mooncake's DT_NEEDED entries by soname from libraries already
in this process, and no other process on the machine sees them. Mooncake's executables
(`mooncake_master`, `transfer_engine_bench`) get LD_LIBRARY_PATH for their own process only
(`exe_env`). A library the system already has is used from the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

DIST = "mooncake-transfer-engine-non-cuda"
INSTALL_HINT = f"pip install 'kvbench[mooncake]' ({DIST}; CUDA: mooncake-transfer-engine)"
# soname -> (the name ctypes.util.find_library knows it by, the Debian package); in load order
# (each after the libraries it needs)
SONAMES: dict[str, tuple[str, str]] = {
    "libnl-3.so.200": ("nl-3", "libnl-3-200"),
    "libnl-route-3.so.200": ("nl-route-3", "libnl-route-3-200"),
    "libnuma.so.1": ("numa", "libnuma1"),
    "libibverbs.so.1": ("ibverbs", "libibverbs1"),
}
FETCH_CMD = "python -m kvbench.p2p.transports.mooncake fetch-libs"
ALLOW = "KVBENCH_ALLOW_SYSTEM_INSTALL"


def cache_dir() -> Path:
    """Where the private copy lives: $KVBENCH_MOONCAKE_LIBS, else ~/.cache/kvbench/mooncake-libs."""
    env = os.environ.get("KVBENCH_MOONCAKE_LIBS")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvbench" / "mooncake-libs"


def on_system(soname: str) -> bool:
    """The dynamic loader's cache (ldconfig -p) lists this library."""
    found = ctypes.util.find_library(SONAMES[soname][0])
    return found == soname


def private_copy(root: Path | None = None) -> dict[str, Path]:
    """soname -> path of each library in the private copy (symlinks resolved later by dlopen)."""
    root = root or cache_dir()
    out: dict[str, Path] = {}
    for soname in SONAMES:
        for sub in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "lib64"):
            p = root / sub / soname
            if p.exists():
                out[soname] = p
                break
    return out


def missing(root: Path | None = None) -> list[str]:
    """Libraries neither the system nor the private copy has."""
    have = private_copy(root)
    return [s for s in SONAMES if not on_system(s) and s not in have]


def lib_dirs(root: Path | None = None) -> list[str]:
    """The private copy's folders that hold a library the system lacks (for LD_LIBRARY_PATH)."""
    have = private_copy(root)
    return sorted({str(p.parent) for s, p in have.items() if not on_system(s)})


def exe_env(root: Path | None = None, environ=None) -> dict[str, str]:
    """An environment for one of Mooncake's executables: the private folders first on its own
    LD_LIBRARY_PATH (nothing else on the machine sees them)."""
    env = dict(os.environ if environ is None else environ)
    dirs = lib_dirs(root)
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            dirs + [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d])
    return env


_preloaded: list[str] = []


def preload(root: Path | None = None) -> list[str]:
    """Load the private copy of each library the system lacks, by absolute path, RTLD_GLOBAL,
    in dependency order; returns what was loaded (this process only)."""
    have = private_copy(root)
    for soname in SONAMES:
        if soname in have and not on_system(soname) and soname not in _preloaded:
            ctypes.CDLL(str(have[soname]), mode=ctypes.RTLD_GLOBAL)
            _preloaded.append(soname)
    return list(_preloaded)


def version() -> str | None:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def libs_hint(gone: list[str]) -> str:
    debs = " ".join(SONAMES[s][1] for s in gone)
    return (f"Mooncake needs {', '.join(gone)} (Debian: {debs}): run `{FETCH_CMD}` for a "
            f"private copy only Mooncake's processes load, or apt-get install {debs} on a "
            "machine where no NIXL CUDA-13 build runs (docs/mooncake.md)")


def import_module(name: str = "mooncake.engine"):
    """(module, None) or (None, one line saying what to install). Preloads the private copy."""
    if _spec() is None:
        return None, f"Mooncake is not installed: {INSTALL_HINT}"
    gone = missing()
    if gone:
        return None, libs_hint(gone)
    preload()
    # glog reads its flags when the library loads: its INFO/WARNING lines (one per engine
    # event) would bury kvbench's table on stderr. A user's own setting wins.
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake sets glog's level from this
    try:
        return importlib.import_module(name), None
    except (ImportError, OSError) as exc:
        return None, f"Mooncake is installed but {name} does not import ({exc}): reinstall with {INSTALL_HINT}"


def die_with_parent() -> None:
    """preexec_fn for a service this rank starts: SIGTERM to it when the rank dies (an
    MPI_Abort kills the rank before any finally runs), so no service outlives its job."""
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spec():
    """The `mooncake` package's spec without importing it (None: not installed)."""
    try:
        return importlib.util.find_spec("mooncake")
    except (ModuleNotFoundError, ValueError):
        return None


def executable(name: str) -> Path | None:
    """One of the executables the wheel ships inside the `mooncake` package."""
    spec = _spec()
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / name
    return p if p.exists() else None


def fetch(root: Path | None = None, update: bool = True) -> Path:
    """Download the Debian packages (apt-get download: nothing is installed) and unpack them
    into the private folder. Raises RuntimeError with the failing command's last line."""
    root = root or cache_dir()
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError("fetch-libs needs Debian's apt-get and dpkg-deb")
    debs = [deb for _, deb in SONAMES.values()]
    with tempfile.TemporaryDirectory(prefix="kvbench-mooncake-debs-") as tmp:
        os.chmod(tmp, 0o755)  # apt's sandbox user must be able to write there
        got = _run(["apt-get", "download", *debs], tmp)
        if got.returncode != 0 and update:
            _run(["apt-get", "update"], tmp)
            got = _run(["apt-get", "download", *debs], tmp)
        if got.returncode != 0:
            last = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"apt-get download {' '.join(debs)} failed: {last[0]}")
        root.mkdir(parents=True, exist_ok=True)
        for deb in sorted(Path(tmp).glob("*.deb")):
            x = _run(["dpkg-deb", "-x", str(deb), str(root)], tmp)
            if x.returncode != 0:
                raise RuntimeError(f"dpkg-deb -x {deb.name} failed: {x.stderr.strip()}")
    return root


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
