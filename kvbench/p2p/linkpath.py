"""Which kind of link carried a run's bytes, read from what the transport itself reported.

Every transport records `transport_info.path` in its own words: NCCL's channel transports
("P2P/CUMEM/read", "SHM/direct/direct", "NET/IB/0/GDRDMA", "NET/Socket/0", parsed from its
debug log by `kvbench.p2p.nccl_log`), the UCX protocols NIXL selected ("UCX RMA write:
rc_mlx5/mlx5_0:1 (zero-copy); ..."), the MPI transport's "host"/"host-staged"/
"device-direct", Gloo's "TCP sockets". This module maps them onto one vocabulary:

    nvlink | pcie | shm | rdma | tcp | host | unknown

so that `kvbench fit --expect-link nvlink` can flag a group whose bytes went another way
(an "NVLink" job that NCCL ran over NET/Socket or SHM). Some evidence cannot tell two kinds
apart (NCCL P2P without its topology line, UCX cuda_ipc: NVLink or PCIe); the classifier
then returns both, and only a kind outside the set counts as a mismatch.

It also names the links a job can declare (`KVBENCH_LINK=ib-ndr`): the kind to expect and
the line rate in decimal GB/s that arms the fit's "rate above the line rate" check.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

KINDS = ("nvlink", "pcie", "shm", "rdma", "tcp", "host", "unknown")
EXPECTABLE = tuple(k for k in KINDS if k != "unknown")

# Declared links: (kind, one-way line rate in decimal GB/s). The rate is the link's signalling
# rate per direction after line coding, an upper bound no payload rate can exceed.
DECLARED_LINKS: dict[str, tuple[str, float, str]] = {
    "nvlink3": ("nvlink", 300.0, "A100 NVLink 3: 12 links x 25 GB/s per direction"),
    "nvlink4": ("nvlink", 450.0, "H100/H200 NVLink 4: 18 links x 25 GB/s per direction"),
    "nvlink5": ("nvlink", 900.0, "B200/GB200 NVLink 5: 18 links x 50 GB/s per direction"),
    "pcie4": ("pcie", 31.5, "PCIe Gen4 x16: 16 GT/s x 16 lanes, 128b/130b"),
    "pcie5": ("pcie", 63.0, "PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b"),
    "ib-hdr": ("rdma", 25.0, "InfiniBand HDR / 200 GbE RoCE: 200 Gbit/s"),
    "ib-ndr": ("rdma", 50.0, "InfiniBand NDR / 400 GbE RoCE: 400 Gbit/s"),
    "ib-xdr": ("rdma", 100.0, "InfiniBand XDR / 800 GbE RoCE: 800 Gbit/s"),
    "eth-10g": ("tcp", 1.25, "10 GbE, TCP"),
    "eth-25g": ("tcp", 3.125, "25 GbE, TCP"),
    "eth-100g": ("tcp", 12.5, "100 GbE, TCP"),
    "eth-400g": ("tcp", 50.0, "400 GbE, TCP"),
}


@dataclass(frozen=True)
class LinkPath:
    """The kinds of link the evidence allows (one, or several when it cannot tell them apart),
    and the evidence in the transport's own words."""

    kinds: frozenset[str]
    evidence: str

    @property
    def label(self) -> str:
        return "|".join(k for k in KINDS if k in self.kinds)


# ---------------------------------------------------------------------------
# NCCL

# NCCL's graph path types between two GPUs (topoPathTypeStr): NVLink, directly or through
# an NVSwitch/another GPU; everything else between GPUs is PCIe (or the CPU's fabric).
_NCCL_NVLINK_TYPES = {"NVL", "NVB"}
_NCCL_PCIE_TYPES = {"PIX", "PXB", "PXN", "P2C", "PHB", "SYS", "C2C"}


def _nccl_one(t: str, gpu_link: str | None) -> frozenset[str]:
    if t.startswith("P2P/MNNVL"):
        return frozenset({"nvlink"})
    if t.startswith("P2P/"):
        if gpu_link in _NCCL_NVLINK_TYPES:
            return frozenset({"nvlink"})
        if gpu_link in _NCCL_PCIE_TYPES:
            return frozenset({"pcie"})
        return frozenset({"nvlink", "pcie"})
    if t.startswith("SHM"):
        return frozenset({"shm"})
    if t.startswith("NET/Socket"):
        return frozenset({"tcp"})
    if re.match(r"NET/(IB|IBext|RoCE|AWS Libfabric|Libfabric|UCX)", t):
        return frozenset({"rdma"})
    return frozenset({"unknown"})


def classify_nccl(info: dict) -> LinkPath:
    detail = info.get("nccl") or {}
    transports = detail.get("transports")
    if transports is None:  # older records: only the joined path string
        path = str(info.get("path") or "")
        transports = [p.strip() for p in path.split(",") if "/" in p or p.strip() == "SHM"]
    gpu_link = detail.get("gpu_link")
    kinds: set[str] = set()
    for t in transports:
        kinds |= _nccl_one(t, gpu_link)
    if not kinds:
        return LinkPath(frozenset({"unknown"}), f"NCCL: {info.get('path') or 'no path recorded'}")
    ev = "NCCL " + ", ".join(transports) + (f" (GPU path type {gpu_link})" if gpu_link else "")
    return LinkPath(frozenset(kinds), ev)


# ---------------------------------------------------------------------------
# UCX (NIXL), MPI, Gloo

_UCX_KIND = [
    (re.compile(r"^(rc|dc|ud)(_mlx5|_verbs)?$|^ib$"), {"rdma"}),
    (re.compile(r"^(cma|knem|xpmem|posix|sysv)$"), {"shm"}),
    (re.compile(r"^tcp$"), {"tcp"}),
    (re.compile(r"^cuda_ipc$"), {"nvlink", "pcie"}),
    (re.compile(r"^(cuda_copy|gdr_copy|self)$"), {"host"}),
]


def classify_ucx(path: str) -> LinkPath:
    """'UCX RMA write: rc_mlx5/mlx5_0:1 (zero-copy); notifications (AM): tcp/lo': the RMA
    part is the KV's path; the notifications are a few bytes and do not count."""
    rma = ";".join(p for p in path.split(";") if "notifications" not in p)
    tls = re.findall(r"([a-z][a-z0-9_]*)/", rma.removeprefix("UCX"))
    kinds: set[str] = set()
    for tl in tls:
        found = next((k for rx, k in _UCX_KIND if rx.match(tl)), {"unknown"})
        kinds |= found
    return LinkPath(frozenset(kinds or {"unknown"}), path)


def classify(transport: str, info: dict | None) -> LinkPath:
    """The link a record's bytes took, from its transport name and `transport_info`."""
    info = info or {}
    path = str(info.get("path") or "")
    if transport == "nccl":
        return classify_nccl(info)
    if transport == "nixl" or path.startswith("UCX"):
        return classify_ucx(path)
    if transport == "gloo" or path.startswith("TCP"):
        return LinkPath(frozenset({"tcp"}), path or "Gloo TCP")
    if transport == "mpi":
        # On host memory (or staged through it) the MPI library picks shared memory or the
        # network itself and does not say which: 'host'. Device-direct: the library's choice.
        if path in ("host", "host-staged"):
            return LinkPath(frozenset({"host"}), f"MPI {path}")
        return LinkPath(frozenset({"unknown"}), f"MPI {path or 'path not recorded'}")
    return LinkPath(frozenset({"unknown"}), path or "no path recorded")


def classify_record(rec: dict) -> LinkPath:
    return classify(str(rec.get("transport") or ""), rec.get("transport_info"))


def mismatch(records: Iterable[dict], expect: str) -> str | None:
    """One line for the fit's `link_mismatch` warning when some records' bytes did not (or
    cannot be shown to) go over the expected kind of link; None when all agree."""
    return mismatch_of(Counter(classify_record(rec) for rec in records), expect)


def mismatch_of(paths: Mapping[LinkPath, int], expect: str) -> str | None:
    """mismatch() from records already classified: LinkPath -> number of records."""
    bad: dict[str, int] = {}
    for lp, count in paths.items():
        if expect not in lp.kinds:
            key = f"{lp.evidence} ({lp.label})"
            bad[key] = bad.get(key, 0) + count
    if not bad:
        return None
    n = sum(bad.values())
    said = "; ".join(f"{k} in {v}" for k, v in bad.items())
    return (f"expected the bytes on {expect}, but {n} of {sum(paths.values())} record(s) say "
            f"otherwise: {said}")


def declared(name: str) -> tuple[str, float]:
    """(kind, line rate GB/s) of a declared link name; ValueError names the known ones."""
    try:
        kind, gbps, _ = DECLARED_LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; declared links: {', '.join(DECLARED_LINKS)}") from None
    return kind, gbps


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvbench.p2p.linkpath declared NAME` prints 'KIND GBPS' (for the job scripts);
    `python -m kvbench.p2p.linkpath links` lists the declared links."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "kvbench linkpath"
    if argv == ["links"]:
        for name, (kind, gbps, what) in DECLARED_LINKS.items():
            print(f"{name:<10} {kind:<7} {gbps:>7g} GB/s  {what}")
        return 0
    if len(argv) == 2 and argv[0] == "declared":
        try:
            kind, gbps = declared(argv[1])
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        print(f"{kind} {gbps:g}")
        return 0
    print(f"usage: {prog} links | declared NAME", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
