"""Which path NCCL wired up, read from its own debug log (a pure parser: text in, facts out).

With NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,P2P,NET,GRAPH, NCCL logs one line per
channel connection it sets up, in the transport's own words:

    host:pid:tid [0] NCCL INFO Channel 00/1 : 0[0] -> 1[1] via P2P/CUMEM/read
    host:pid:tid [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA
    host:pid:tid [0] NCCL INFO Channel 00 : 0[1b000] -> 1[1c000] via SHM/direct/direct

(`Channel NN/C` carries the connection index since NCCL 2.12; the bracket holds the bus id
up to 2.18 and the NVML device index from 2.19). The transports: P2P/CUMEM, P2P/IPC,
P2P/direct pointer and P2P/MNNVL (GPU peer-to-peer: NVLink or PCIe), P2P/indirect (through
another GPU), SHM (through host memory), NET/<network>/<dev> with /GDRDMA when the NIC reads
GPU memory directly, NET/Socket (TCP). The same log gives the NCCL version
("NCCL version 2.21.5+cuda12.4"), the network ("Using network IB"), the NICs each network
offers ("NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>") and,
with GRAPH, the path type NCCL's topology search found between the node's GPUs
("Pattern 4, crossNic 0, nChannels 2, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1":
NVL is NVLink, PIX/PXB/PHB/SYS are PCIe) -- the one line that tells NVLink from PCIe P2P.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

_CHANNEL = re.compile(
    r"Channel (?P<ch>\d+)(?:/(?P<conn>\d+))? : (?P<src>\d+)\[[0-9a-fA-Fx]+\] -> "
    r"(?P<dst>\d+)\[[0-9a-fA-Fx]+\](?: \[(?P<dir>send|receive)\])? via (?P<via>.+?)"
    r"(?: comm 0x[0-9a-fA-F]+.*)?\s*$")
_VERSION = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+)(?P<suffix>\S*)")
_NETWORK = re.compile(r"NCCL INFO Using network (?P<net>.+?)\s*$")
_NICS = re.compile(r"NCCL INFO NET/(?P<net>[^:]+?) ?: Using (?P<devs>.*?)(?:;\s*OOB (?P<oob>\S+))?\s*$")
_NIC = re.compile(r"\[(?P<i>\d+)\](?P<name>[^\s\[]+)")
_NO_DEVICE = re.compile(r"NCCL INFO NET/(?P<net>\S+) : No device found")
_GRAPH = re.compile(r"Pattern \d+, crossNic \d+, nChannels \d+, (?:bw|speed) [\d.]+/[\d.]+, "
                    r"type (?P<intra>[A-Z0-9]+)/(?P<inter>[A-Z0-9]+)")
_NET_DEV = re.compile(r"^NET/(?P<net>.+?)/(?P<dev>\d+)(?:\((?P<proxy>\d+)\))?(?P<rest>/.*)?$")


@dataclass(frozen=True)
class Connection:
    """One channel connection NCCL set up, as logged."""

    channel: int
    conn_index: int | None
    src: int
    dst: int
    direction: str | None  # "send" / "receive" for NET lines; None for P2P and SHM
    transport: str  # e.g. "P2P/CUMEM/read", "NET/IB/0/GDRDMA"


@dataclass
class NcclLog:
    version: str | None = None  # "2.21.5+cuda12.4"
    network: str | None = None  # "IB", "Socket", a plugin's name
    nics: dict[str, dict[int, str]] = field(default_factory=dict)  # network -> dev -> NIC
    absent_networks: list[str] = field(default_factory=list)  # "NET/IB : No device found"
    gpu_link: str | None = None  # NCCL graph's intra-node path type: NVL, PIX, SYS, ...
    connections: list[Connection] = field(default_factory=list)

    def transports(self) -> list[str]:
        """The distinct transports of the channel connections, the proxy rank of PXN
        ("NET/IB/0(1)/GDRDMA") dropped, in order of first appearance."""
        out: list[str] = []
        for c in self.connections:
            t = _without_proxy(c.transport)
            if t not in out:
                out.append(t)
        return out

    def used_nics(self) -> list[str]:
        """The NICs the NET connections went through, by name where the log listed them."""
        out: list[str] = []
        for t in self.transports():
            m = _NET_DEV.match(t)
            if not m:
                continue
            dev = int(m["dev"])
            name = self.nics.get(m["net"], {}).get(dev, f"{m['net']} dev {dev}")
            if name not in out:
                out.append(name)
        return out

    def path(self) -> str | None:
        """'P2P/CUMEM/read' or 'NET/IB/0/GDRDMA (mlx5_0:1/IB)': what carried the bytes."""
        if not self.connections:
            return None
        nics = self.used_nics()
        return ", ".join(self.transports()) + (f" ({', '.join(nics)})" if nics else "")

    def for_pair(self, src: int, dst: int) -> NcclLog:
        """The same facts with only the connections from rank src to rank dst (the ranks of
        the communicator, which are the job's: kvbench uses the world group)."""
        return NcclLog(self.version, self.network, self.nics, self.absent_networks,
                       self.gpu_link, [c for c in self.connections
                                       if (c.src, c.dst) == (src, dst)])

    def as_dict(self) -> dict:
        return {"version": self.version, "network": self.network, "gpu_link": self.gpu_link,
                "transports": self.transports(), "nics": self.used_nics(),
                "absent_networks": self.absent_networks,
                "connections": len(self.connections)}


def _without_proxy(t: str) -> str:
    m = _NET_DEV.match(t)
    if not m or m["proxy"] is None:
        return t
    return f"NET/{m['net']}/{m['dev']}{m['rest'] or ''}"


def parse(text: str) -> NcclLog:
    """Everything this module reads from one NCCL debug log (one rank's file, or several
    concatenated). Lines it does not know are ignored."""
    log = NcclLog()
    for line in text.splitlines():
        if m := _CHANNEL.search(line):
            conn = None if m["conn"] is None else int(m["conn"])
            log.connections.append(Connection(int(m["ch"]), conn, int(m["src"]), int(m["dst"]),
                                              m["dir"], m["via"].strip()))
        elif m := _VERSION.search(line):
            log.version = log.version or m["v"] + m["suffix"]
        elif m := _NETWORK.search(line):
            log.network = log.network or m["net"]
        elif m := _NO_DEVICE.search(line):
            if m["net"] not in log.absent_networks:
                log.absent_networks.append(m["net"])
        elif m := _NICS.search(line):
            devs = {int(d["i"]): d["name"] for d in _NIC.finditer(m["devs"])}
            if devs:
                log.nics.setdefault(m["net"].strip(), {}).update(devs)
        elif m := _GRAPH.search(line):
            log.gpu_link = log.gpu_link or m["intra"]
    return log


def merge(logs: Iterable[NcclLog]) -> NcclLog:
    """One view of several ranks' logs: all their connections, the first of each fact."""
    out = NcclLog()
    for log in logs:
        out.version = out.version or log.version
        out.network = out.network or log.network
        out.gpu_link = out.gpu_link or log.gpu_link
        for net, devs in log.nics.items():
            out.nics.setdefault(net, {}).update(devs)
        out.absent_networks += [n for n in log.absent_networks if n not in out.absent_networks]
        out.connections += log.connections
    return out
