"""Where the torch.distributed store listens: an address every rank can reach.

Rank 0 picks the address and port and sends `tcp://addr:port` to every rank over MPI, so no
launcher variables are needed. The address:

1. `MASTER_ADDR` if set (and `MASTER_PORT` for the port);
2. 127.0.0.1 when every rank runs on rank 0's host;
3. otherwise a non-loopback IPv4 address of rank 0's host: its name's own addresses first
   (what the other hosts most likely resolve it to), then its interfaces'; the interface named
   by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME first when one is set. `gethostbyname(hostname)`
   alone is 127.0.1.1 on many Debian/Ubuntu hosts: a store there is unreachable from a second
   node, so a loopback address is never chosen for a job that spans hosts.

With no such address the run stops with one line naming MASTER_ADDR.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence

from kvbench.errors import UsageError, bounded_int

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_addresses() -> dict[str, str]:
    """{interface name: IPv4 address} of this host's interfaces that have one (Linux)."""
    import fcntl
    import struct

    out: dict[str, str] = {}
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def name_addresses(hostname: str) -> list[str]:
    """The IPv4 addresses this host's name resolves to (empty when it does not resolve)."""
    try:
        return socket.gethostbyname_ex(hostname)[2]
    except OSError:
        return []


def reachable(addr: str) -> bool:
    """Not loopback (127/8), not link-local, not unspecified: another host may reach it."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def preferred(interfaces: Mapping[str, str], env: Mapping[str, str]) -> list[tuple[str, str]]:
    """Interfaces the *_SOCKET_IFNAME variables ask for, in their order: `eth` is a prefix,
    `=eth0` an exact name; a `^...` list excludes and picks nothing."""
    out: list[tuple[str, str]] = []
    for var in IFNAME_VARS:
        spec = env.get(var, "")
        if not spec or spec.startswith("^"):
            continue
        exact = spec.startswith("=")
        for want in spec.lstrip("=").split(","):
            out += [(n, a) for n, a in interfaces.items()
                    if want and (n == want if exact else n.startswith(want))]
    return out


def choose_address(hosts: Sequence[str], interfaces: Mapping[str, str], resolved: Sequence[str],
                   env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(address, error) for rank 0's store. `hosts` are the ranks' host names (rank 0 first),
    `interfaces` rank 0's {name: IPv4}, `resolved` what rank 0's host name resolves to."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"], None
    if len(set(hosts)) <= 1:
        return "127.0.0.1", None
    for _name, addr in preferred(interfaces, env):
        if reachable(addr):
            return addr, None
    mine = set(interfaces.values())
    for addr in resolved:
        if reachable(addr) and (not mine or addr in mine):
            return addr, None
    for addr in interfaces.values():
        if reachable(addr):
            return addr, None
    seen = sorted(set(resolved) | mine) or ["none"]
    return None, (f"no address of rank 0's host {hosts[0]} that the other hosts can reach "
                  f"(found only {', '.join(seen)}: loopback or link-local); set MASTER_ADDR to "
                  "an address of that host every rank can reach")


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rendezvous_address(comm, hosts: list[str]) -> tuple[str | None, str | None]:
    """(tcp://addr:port, error) agreed over MPI: the same on every rank (collective)."""
    if comm.Get_rank() == 0:
        env = os.environ
        addr, error = choose_address(hosts, interface_addresses() if len(set(hosts)) > 1 else {},
                                     name_addresses(socket.gethostname()), env)
        url = None
        if addr is not None and env.get("MASTER_PORT"):
            try:  # rank 0 alone reads it: its refusal reaches every rank as the error
                url = f"tcp://{addr}:{bounded_int(env['MASTER_PORT'], 'MASTER_PORT', 1, 65_535)}"
            except UsageError as exc:
                url, error = None, str(exc)
        elif addr is not None:
            url = f"tcp://{addr}:{_free_port('' if addr != '127.0.0.1' else addr)}"
        answer = (url, error)
    else:
        answer = None
    return comm.bcast(answer, root=0)
