"""Finding NIXL's Python package: the `nixl` meta package or the wheel for torch's CUDA.

A broken install (the package is there but does not import) is told apart from a missing
one, so the user gets the right one-line fix.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

INSTALL_HINT = ("pip install 'kvbench[nixl]' (nixl-cu12 for CUDA 12; nixl-cu13 or the "
                "'nixl' meta package for CUDA 13)")
_DISTS = {"nixl": "nixl", "nixl_cu12": "nixl-cu12", "nixl_cu13": "nixl-cu13"}


def _candidates() -> list[str]:
    """Module names to try: the meta package first, then the variant matching torch's CUDA."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None) or ""
    variants = ["nixl_cu13", "nixl_cu12"] if cuda.startswith("13") else ["nixl_cu12", "nixl_cu13"]
    return ["nixl", *variants]


def import_nixl():
    """(module exposing nixl_agent, None) or (None, one line saying why not)."""
    broken = []
    for name in _candidates():
        try:
            mod = importlib.import_module(name)
            if not hasattr(mod, "nixl_agent"):
                mod = importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (name, f"{name}._api"):
                broken.append(f"{name}: {exc}")
            continue
        except (ImportError, OSError) as exc:
            broken.append(f"{name}: {exc}")
            continue
        if hasattr(mod, "nixl_agent"):
            mod.__kvbench_name__ = name
            return mod, None
    if broken:
        return None, f"NIXL is installed but does not import ({broken[0]}): reinstall with {INSTALL_HINT}"
    return None, f"NIXL is not installed: {INSTALL_HINT}"


def _version(module_name: str) -> str | None:
    try:
        return importlib.metadata.version(_DISTS.get(module_name, module_name))
    except importlib.metadata.PackageNotFoundError:
        return None


MAX_NIXL_THREADS = 256  # UCX worker threads: NIXL/UCX crash (SIGSEGV) creating 100,000
MAX_PROGRESS_DELAY_US = 10**6  # the progress thread's sleep: 1 s already stalls every transfer


def agent_with_progress_delay(mod, name: str, cfg, delay_us: int):
    """nixl_agent(name, cfg) with the progress thread's delay set to `delay_us`.

    nixl 1.5.1's Python agent hard-codes `agent_config.pthrDelay = 0` (nixl_cu12/_api.py:226).
    The lab's vLLM sets another delay the same way (kvbench.lab.venv.connector wraps the binding's
    agent constructor), so an engine-shaped run that reproduces the lab must too: the
    binding seen by `_api` is swapped for this one call only, then put back."""
    if delay_us <= 0:
        return mod.nixl_agent(name, cfg)
    api = importlib.import_module(mod.nixl_agent.__module__)  # where nixl_agent finds nixlBind
    real = api.nixlBind

    class _Bind:
        def __getattr__(self, key):
            return getattr(real, key)

        @staticmethod
        def nixlAgent(agent_name, config):  # noqa: N802 - the binding's name
            config.pthrDelay = delay_us
            return real.nixlAgent(agent_name, config)

    api.nixlBind = _Bind()
    try:
        return mod.nixl_agent(name, cfg)
    finally:
        api.nixlBind = real
