"""Stand up one local deployment (aggregated or disaggregated) of real vLLM instances.

aggregated    = N instances, one per core, behind the round-robin proxy;
disaggregated = P prefill + D decode instances (NixlConnector, kv_producer/kv_consumer)
                behind the P/D proxy, on the same number of cores.
Everything binds 127.0.0.1, uses the lab's port block, is started in its own process
group and is stopped (by PID group) when start-up fails or the caller leaves.

Port layout inside the block (offsets from lab.base_port):
  aggregated:    proxy +0, instances +1..
  disaggregated: proxy +100, prefill +101.., decode +121.., NIXL side channels +150..
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import kvbench
from kvbench.lab.config import LabConfig
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.procs import LabState, Service, spawn, stop_all
from kvbench.lab.venv.tinymodel import ensure_model

SERVED_NAME = "tiny"
REPO_ROOT = Path(kvbench.__file__).resolve().parent.parent
DEPLOYMENTS = ("aggregated", "disaggregated")


def base_env(cfg: LabConfig, core: int) -> dict:
    """Environment of one vLLM instance bound to one core (the issue's recipe)."""
    env = dict(os.environ)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # exposes /reset_prefix_cache for the cold cache state
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    })
    return env


def nixl_env(cfg: LabConfig, side_port: int) -> dict:
    """NIXL/UCX settings: side channel on 127.0.0.1, UCX over loopback TCP + shared memory.

    UCX_TLS must include tcp: with `sm,self` alone NIXL refuses to start ("no peer
    failure handler").
    """
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "UCX_TLS": "tcp,sm,self", "UCX_NET_DEVICES": "lo",
            "KVBENCH_NIXL_POLL_DELAY_US": str(cfg.workarounds.nixl_poll_delay_us),
            "KVBENCH_KEEP_MODEL_THREAD_AFFINITY": "1" if cfg.workarounds.keep_model_thread_affinity else "0"}


def kv_transfer_config(cfg: LabConfig, role: str) -> str:
    return json.dumps({
        "kv_connector": "NixlConnector", "kv_connector_module_path": "kvbench.lab.venv.connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu", "kv_load_failure_policy": cfg.kv_load_failure_policy,
        "kv_connector_extra_config": {"kv_lease_duration": cfg.kv_lease_s}})


def serve_cmd(cfg: LabConfig, model_dir: Path, port: int, core: int, role: str) -> list[str]:
    cmd = ["taskset", "-c", str(core), str(labenv.lab_bin("vllm")), "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--dtype", "bfloat16", "--max-model-len", str(cfg.max_model_len), "--enforce-eager",
           "--seed", "0"]
    if role in ("prefill", "decode"):
        cmd += ["--kv-transfer-config", kv_transfer_config(cfg, role)]
    return cmd


def proxy_cmd(mode: str, port: int, events: Path, **urls: list[str]) -> list[str]:
    cmd = [str(labenv.lab_python()), "-m", "kvbench.lab.venv.proxy", "--mode", mode,
           "--port", str(port), "--events", str(events)]
    for flag, values in urls.items():
        for url in values:
            cmd += [f"--{flag}", url]
    return cmd


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _instance_plan(cfg: LabConfig, deployment: str) -> list[tuple[str, str, int, int, int | None]]:
    """(name, role, port, core, side-channel port) for every instance of a deployment."""
    if deployment == "aggregated":
        return [(f"agg{i}", "aggregated", cfg.port(1 + i), core, None)
                for i, core in enumerate(cfg.cores)]
    out = []
    cores = list(cfg.cores)
    for i in range(cfg.prefill_instances):
        out.append((f"prefill{i}", "prefill", cfg.port(101 + i), cores.pop(0), cfg.port(150 + i)))
    for i in range(cfg.decode_instances):
        out.append((f"decode{i}", "decode", cfg.port(121 + i), cores.pop(0), cfg.port(170 + i)))
    return out


def start_instances(cfg: LabConfig, deployment: str, model_dir: Path, logs: Path,
                    role_env: dict[str, dict] | None = None) -> list[Service]:
    """`role_env`: extra environment per role (e.g. a trace file for decode)."""
    services = []
    for name, role, port, core, side in _instance_plan(cfg, deployment):
        env = base_env(cfg, core)
        if side is not None:
            env.update(nixl_env(cfg, side))
        env.update((role_env or {}).get(role, {}))
        svc = spawn(name, role, serve_cmd(cfg, model_dir, port, core, role), env, port,
                    logs / f"{name}.log", [core], {"side_channel_port": side} if side else {})
        services.append(svc)
    return services


def start_proxy(cfg: LabConfig, deployment: str, instances: list[Service], logs: Path) -> Service:
    env = base_env(cfg, 0)
    env.pop("VLLM_CPU_OMP_THREADS_BIND")
    events = logs / f"{deployment}-proxy-events.jsonl"
    if deployment == "aggregated":
        port = cfg.port(0)
        cmd = proxy_cmd("rr", port, events, backend=[url(s.port) for s in instances])
    else:
        port = cfg.port(100)
        cmd = proxy_cmd("pd", port, events,
                        prefill=[url(s.port) for s in instances if s.role == "prefill"],
                        decode=[url(s.port) for s in instances if s.role == "decode"])
    return spawn(f"{deployment}-proxy", "proxy", cmd, env, port, logs / f"{deployment}-proxy.log",
                 extra={"events": str(events)})


def http_ok(u: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(u, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def log_tail(path: str, lines: int = 8) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln[:200] for ln in text[-lines:])


class StartError(RuntimeError):
    """A service died or never answered /health; the message names it and its log."""


def wait_ready(services: list[Service], timeout_s: float, progress=sys.stderr) -> float:
    """Poll /health of every service; returns the seconds it took. Raises StartError."""
    t0 = time.monotonic()
    pending = list(services)
    while pending:
        for svc in list(pending):
            if not svc.alive() and not svc.group_alive():
                raise StartError(f"{svc.name} exited during start-up; log {svc.log}:\n{log_tail(svc.log)}")
            if http_ok(url(svc.port) + "/health"):
                pending.remove(svc)
                print(f"lab: {svc.name} ready on {url(svc.port)} after "
                      f"{time.monotonic() - t0:.0f} s", file=progress, flush=True)
        if time.monotonic() - t0 > timeout_s:
            names = ", ".join(s.name for s in pending)
            raise StartError(f"{names} not ready after {timeout_s:.0f} s; log {pending[0].log}:\n"
                             f"{log_tail(pending[0].log)}")
        time.sleep(1.0)
    return time.monotonic() - t0


def bring_up(cfg: LabConfig, deployment: str, model_dir: Path, logs: Path,
             started: list[Service], role_env: dict[str, dict] | None = None) -> LabState:
    """Start a deployment, appending each service to `started` as soon as it exists.

    The caller owns `started` (and stops it: procs.stop_on_exit), so nothing leaks when
    start-up fails half way or Ctrl-C arrives while instances load.
    """
    instances = start_instances(cfg, deployment, model_dir, logs, role_env)
    started.extend(instances)
    secs = wait_ready(instances, cfg.start_timeout_s)
    proxy = start_proxy(cfg, deployment, instances, logs)
    started.append(proxy)
    wait_ready([proxy], 30.0)
    metrics = {}
    for s in instances:
        metrics.setdefault(s.role, []).append(url(s.port) + "/metrics")
    return LabState(deployment, [*instances, proxy], url(proxy.port), metrics,
                    {"start_s": round(secs, 1), "model_dir": str(model_dir),
                     "served_model_name": SERVED_NAME, "logs": str(logs)})


def bring_down(state: LabState) -> None:
    stop_all(state.services)


def model_for(cfg) -> Path:
    """The cached tiny model for this config (built on first use, ~10 s)."""
    return ensure_model(cfg.model, labenv.lab_home(), labenv.lab_python(), REPO_ROOT)
