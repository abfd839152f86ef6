"""Why a KV's bytes did not take the link they should have, and what to set: the known causes.

kvbench.links.linkpath finds the path of a record's KV (the UCX rows between the KV's own
memory, NCCL's channels, the ipc transport's mapping); when that path is UCX's software
emulation, or not the link `--expect-link` names, this module names the causes the record's
own evidence supports (UCX rows and variables, the ranks' environment, GPU UUIDs, PIDs) and
the setting that fixes each. A cause is named only from evidence; what was not recorded is
not guessed. docs/nixl.md, "When the path is not the link", is the one table of them
(a test keeps the table and `CAUSES` the same).

Pure and small: no torch, no MPI, no kvbench import (it belongs to the link vocabulary that
issue 41 moves to kvbench/links/).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TRUTHY = ("y", "yes", "on", "1", "true")


@dataclass(frozen=True)
class Cause:
    code: str
    why: str  # the cause, with the evidence that names it
    fix: str  # what to set

    def line(self) -> str:
        return f"cause ({self.code}): {self.why}; fix: {self.fix}"


@dataclass(frozen=True)
class Evidence:
    """What a record says about where its KV went and why (built by kvbench.links.linkpath)."""

    transport: str
    device: str | None  # "cuda", "cpu", "cpu-async"
    kinds: frozenset[str]  # the KV path's link kinds
    emulated: bool = False  # UCX's "software emulation" carried the KV
    op: str | None = None  # NIXL: "write" / "read"
    kv_lanes: tuple[str, ...] = ()  # UCX transports of the KV rows ("cuda_ipc", "tcp")
    endpoints: tuple[str, ...] = ()  # UCX endpoint kinds seen: intra-node, inter-node, self
    ucx_env: Mapping[str, str] = field(default_factory=dict)
    rank_vars: tuple[Mapping[str, str], ...] = ()  # each rank's recorded variables
    same_host: bool | None = None
    same_gpu: str | None = None  # how both ranks are known to share one GPU, None if not
    pids: tuple[int | None, ...] = ()  # the pair's process ids, where recorded
    pid_namespaces: tuple[str | None, ...] = ()  # the pair's /proc/self/ns/pid, where recorded


# code -> (cause, evidence kvbench reads, fix): the table docs/nixl.md prints
CAUSES: dict[str, tuple[str, str, str]] = {
    "cuda-ipc-get-off": (
        "UCX's cuda_ipc READ (GET) is off: with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto (UCX's "
        "default) UCX enables it only when NVML reports an active NVLink, so a READ between "
        "GPUs on PCIe, or on one GPU, falls back to software emulation over TCP",
        "a NIXL READ on cuda, KV row not on cuda_ipc, endpoint intra-node, "
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY not y in ucx_env",
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (kvbench sets it on --device cuda unless the user "
        "set it; --no-nixl-cuda-ipc-get turns that off)"),
    "pid-namespace": (
        "the ranks run in different PID namespaces (containers): UCX's intra-node transports "
        "(cuda_ipc, cma) need to see the peer process",
        "same host, KV not on an intra-node transport, the ranks' env.pid_namespace differ",
        "run both in one PID namespace (docker --pid=host, Kubernetes hostPID or "
        "shareProcessNamespace)"),
    "not-ipc-capable": (
        "the KV's CUDA memory cannot be exported over CUDA IPC: PyTorch's expandable segments "
        "allocate it with the VMM API (cuMemCreate) without a shareable handle",
        "cuda, same host, KV row not on cuda_ipc, expandable_segments:True in a rank's "
        "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF",
        "allocate the KV without expandable segments (PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:False, or a separate cudaMalloc pool for the KV)"),
    "ucx-tls": (
        "UCX_TLS leaves out the transport the link needs",
        "UCX_TLS in ucx_env (or a rank's variables) does not allow the transport of the "
        "expected link (cuda_ipc, rc/dc/ud, cma/posix/sysv, tcp)",
        "add the transport to UCX_TLS (e.g. UCX_TLS=cuda_ipc,cuda_copy,rc,tcp) or unset it"),
    "one-process": (
        "one process holds both NIXL agents: UCX connects them over its loopback (self) "
        "transport and no link between processes is used",
        "UCX rows on a 'self' endpoint, or both ranks' recorded PIDs equal on one host",
        "run prefill and decode as separate processes (mpirun -n 2, one agent per rank)"),
    "shared-gpu": (
        "both ranks use one GPU: the bytes never leave the device, no link between GPUs is "
        "measured",
        "the ranks' GPU UUIDs are equal (older records: same host, device index and name)",
        "give each rank its own GPU (one GPU per rank; without --allow-shared-gpu kvbench "
        "refuses a shared one)"),
    "no-gpudirect": (
        "the network does not read the GPU's memory directly: the bytes are staged through "
        "host memory (NCCL without /GDRDMA, UCX rows through cuda_copy)",
        "NCCL NET/IB without /GDRDMA, or a UCX RDMA row on cuda memory with cuda_copy or a "
        "copy-in protocol",
        "load nvidia_peermem (or use a driver with dma-buf: NCCL_DMABUF_ENABLE=1), and check "
        "NCCL_NET_GDR_LEVEL / UCX_IB_GPU_DIRECT_RDMA"),
}

_SM = ("cma", "knem", "xpmem", "posix", "sysv")
_RDMA = ("rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5", "ib")
_TLS_ALIASES = {"sm": _SM, "shm": _SM, "mm": ("posix", "sysv", "xpmem"), "all": (),
                "cuda": ("cuda_copy", "cuda_ipc", "gdr_copy"), "ib": _RDMA, "rc": _RDMA[:3],
                "rc_x": ("rc_mlx5",), "dc": _RDMA[3:5], "dc_x": ("dc_mlx5",),
                "ud": _RDMA[5:8], "ud_x": ("ud_mlx5",)}
WANTED_TLS = {"nvlink": ("cuda_ipc",), "pcie": ("cuda_ipc",), "same-device": ("cuda_ipc",),
              "rdma": _RDMA, "shm": _SM, "tcp": ("tcp",)}


def tls_allows(ucx_tls: str | None, tl: str) -> bool:
    """Whether UCX_TLS (comma list, '^' negates, aliases sm/cuda/ib/rc_x/...) lets `tl` in."""
    if not ucx_tls or not ucx_tls.strip():
        return True
    text = ucx_tls.strip()
    negate = text.startswith("^")
    names = [n.strip() for n in text.lstrip("^").split(",") if n.strip()]
    listed = any(n == tl or n == "all" or tl in _TLS_ALIASES.get(n, ()) for n in names)
    return not listed if negate else listed


def _ucx_tls(ev: Evidence) -> str | None:
    tls = ev.ucx_env.get("UCX_TLS")
    return tls if tls is not None else next((v["UCX_TLS"] for v in ev.rank_vars
                                             if "UCX_TLS" in v), None)


def _intra_transport(ev: Evidence) -> tuple[str, ...]:
    return ("cuda_ipc",) if ev.device == "cuda" else _SM


def _off_intra(ev: Evidence) -> bool:
    """Same host, UCX carried the KV, but not over an intra-node transport."""
    return (ev.transport == "nixl" and ev.same_host is not False and bool(ev.kv_lanes)
            and not any(t in _intra_transport(ev) for t in ev.kv_lanes))


def _cuda_ipc_get_off(ev: Evidence) -> Cause | None:
    if not (ev.device == "cuda" and ev.op == "read" and "intra-node" in ev.endpoints
            and _off_intra(ev)):
        return None
    setting = ev.ucx_env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    if setting is not None and setting.strip().lower() in TRUTHY:
        return None
    if not tls_allows(_ucx_tls(ev), "cuda_ipc"):
        return None  # UCX_TLS is the cause then
    said = f"={setting}" if setting is not None else " unset (UCX's default auto)"
    return Cause("cuda-ipc-get-off",
                 f"a READ of cuda memory within one node went over {', '.join(ev.kv_lanes)}"
                 f"{' (software emulation)' if ev.emulated else ''}, not cuda_ipc, with "
                 f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY{said}: UCX enables cuda_ipc's GET only when "
                 "NVML reports an active NVLink", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y")


def _pid_namespace(ev: Evidence) -> Cause | None:
    ns = [n for n in ev.pid_namespaces if n]
    if len(ns) < 2 or len(set(ns)) < 2 or not _off_intra(ev):
        return None
    return Cause("pid-namespace", f"the ranks run in different PID namespaces ({' vs '.join(ns)}"
                 f"): UCX cannot use {'/'.join(_intra_transport(ev))} to a process it cannot see",
                 CAUSES["pid-namespace"][2])


def _not_ipc_capable(ev: Evidence) -> Cause | None:
    if ev.device != "cuda" or not _off_intra(ev):
        return None
    for v in ev.rank_vars:
        for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            conf = v.get(key, "").replace(" ", "").lower()
            if "expandable_segments:true" in conf:
                return Cause("not-ipc-capable", f"{key}={v[key]}: PyTorch allocates the KV with "
                             "the VMM API (expandable segments), which cuda_ipc cannot export",
                             CAUSES["not-ipc-capable"][2])
    return None


def _ucx_tls_cause(ev: Evidence, expect: str | None) -> Cause | None:
    tls = _ucx_tls(ev)
    if ev.transport != "nixl" or tls is None:
        return None
    want = WANTED_TLS.get(expect or "") if expect else (
        _intra_transport(ev) if ev.same_host and _off_intra(ev) else None)
    if not want or any(tls_allows(tls, t) for t in want):
        return None
    return Cause("ucx-tls", f"UCX_TLS={tls} allows none of {', '.join(want)}",
                 f"add {want[0]} to UCX_TLS (or unset UCX_TLS)")


def _one_process(ev: Evidence) -> Cause | None:
    pids = [p for p in ev.pids if p is not None]
    same_pid = len(pids) == 2 and pids[0] == pids[1] and ev.same_host
    if "self" not in ev.endpoints and not same_pid:
        return None
    how = "UCX connected the agents over its 'self' endpoint" if "self" in ev.endpoints else \
        f"both ranks recorded PID {pids[0]} on one host"
    return Cause("one-process", f"one process holds both agents ({how})",
                 CAUSES["one-process"][2])


def _shared_gpu(ev: Evidence) -> Cause | None:
    if not ev.same_gpu or "same-device" not in ev.kinds:
        return None  # (a path that left the device for another reason has that reason)
    return Cause("shared-gpu", f"both ranks use one GPU ({ev.same_gpu}): no link between GPUs "
                 "is measured", CAUSES["shared-gpu"][2])


def _no_gpudirect(ev: Evidence) -> Cause | None:
    if "rdma-host-staged" not in ev.kinds:
        return None
    return Cause("no-gpudirect", "the RDMA path stages the GPU's bytes through host memory "
                 "(no GPUDirect RDMA)", CAUSES["no-gpudirect"][2])


def diagnose(ev: Evidence, expect: str | None = None) -> tuple[Cause, ...]:
    """The causes the evidence names, most specific first (none: kvbench cannot tell)."""
    found = [_one_process(ev), _ucx_tls_cause(ev, expect), _pid_namespace(ev),
             _not_ipc_capable(ev), _cuda_ipc_get_off(ev), _no_gpudirect(ev), _shared_gpu(ev)]
    return tuple(c for c in found if c is not None)


def explain(causes: Sequence[Cause]) -> str:
    """'cause (x): ...; fix: ...' for each, or the line saying none was recognised."""
    if not causes:
        return ("cause: not recognised from the record (see docs/nixl.md, 'When the path is "
                "not the link')")
    return " | ".join(c.line() for c in causes)
