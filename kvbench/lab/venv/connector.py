"""vLLM's own NixlConnector with two workarounds for small CPU hosts, each switchable off.

Loaded inside the vLLM processes through `kv_connector_module_path=kvbench.lab.venv.connector`
with `kv_connector=NixlConnector` (the class keeps vLLM's name so every check vLLM makes
on the connector name still holds). It only runs in the lab's vLLM environment.

Finding 1, NIXL busy-poll: nixl 1.5.1's Python agent hard-codes the agent config's
`pthrDelay = 0`, so the UCX progress thread spins on a core even when idle (0.5-0.9
of a core per instance measured here). Turning the thread off deadlocks the prefill
side. We set a non-zero delay (`KVBENCH_NIXL_POLL_DELAY_US`, default 1000 us; 0 keeps
NIXL's behaviour) by wrapping the binding's agent constructor in the `nixl._api`
module only.

Finding 2, thread re-pinning: vLLM 0.32's NIXL worker on CPU calls
`os.sched_setaffinity(0, [last core of each NUMA node])` on the model thread, so a
prefill bound to core 0 and a decode bound to core 1 both compute on core 1. We put
the thread's affinity back as it was before the worker was built
(`KVBENCH_KEEP_MODEL_THREAD_AFFINITY=1`, the default; 0 keeps vLLM's re-pinning).

Measurement hook (no behaviour change): with `KVBENCH_NIXL_TRACE=FILE` the worker's NIXL
agent calls are traced per transfer (kvbench.lab.venv.nixltrace; `kvbench lab agree` sets it on
the decode instance).

Versions are pinned: the workarounds reach into private code of exactly these releases,
so any other version refuses to start rather than silently doing something else.
"""

from __future__ import annotations

import os
import sys
import types

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

PINNED = {"vllm": "0.32.0", "nixl": "1.5.1"}


def _check_versions() -> None:
    from importlib.metadata import version

    import vllm

    found = {"vllm": vllm.__version__, "nixl": version("nixl-cu12")}
    for name, want in PINNED.items():
        if found[name].split("+")[0] != want:
            raise RuntimeError(f"kvbench.lab.venv.connector is written for {name} {want}, found "
                               f"{found[name]}; set no workarounds or update the connector")


def poll_delay_us() -> int:
    return int(os.environ.get("KVBENCH_NIXL_POLL_DELAY_US", "1000"))


def keep_affinity() -> bool:
    return os.environ.get("KVBENCH_KEEP_MODEL_THREAD_AFFINITY", "1") == "1"


def _install_poll_delay(delay_us: int) -> None:
    """Make every nixl agent created through nixl._api use pthrDelay=delay_us."""
    import nixl._api as api

    real = api.nixlBind
    if getattr(real, "_kvbench_shim", False):
        return

    def agent(name, config):
        config.pthrDelay = delay_us
        return real.nixlAgent(name, config)

    shim = types.SimpleNamespace(_kvbench_shim=True)
    shim.__dict__.update({k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    shim.nixlAgent = agent
    api.nixlBind = shim
    print(f"kvbench.lab.venv.connector: NIXL progress-thread delay {delay_us} us", file=sys.stderr)


class NixlConnector(_VllmNixlConnector):
    """vLLM's NixlConnector (pull mode), built with the lab's workarounds applied."""

    def __init__(self, vllm_config, role, kv_cache_config):
        _check_versions()
        delay = poll_delay_us()
        if delay > 0:
            _install_poll_delay(delay)
        before = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        after = os.sched_getaffinity(0)
        if after != before:
            action = "restored" if keep_affinity() else "left as vLLM set it"
            if keep_affinity():
                os.sched_setaffinity(0, before)
            print(f"kvbench.lab.venv.connector: NIXL worker re-pinned the model thread from cores "
                  f"{sorted(before)} to {sorted(after)}; {action}", file=sys.stderr)
        if self.connector_worker is not None:
            from kvbench.lab.venv import nixltrace

            if nixltrace.install(self.connector_worker) is not None:
                print(f"kvbench.lab.venv.connector: tracing NIXL transfers to "
                      f"{os.environ[nixltrace.ENV]}", file=sys.stderr)
