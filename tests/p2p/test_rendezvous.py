"""The torch.distributed store's address (issue 20, defect 8), with planted interfaces.

`gethostbyname(gethostname())` is 127.0.1.1 on many Debian/Ubuntu hosts: a two-node job would
point the second node at its own loopback. The choice never takes a loopback address unless
every rank shares rank 0's host, and with nothing reachable it names MASTER_ADDR."""

from __future__ import annotations

import pytest

from kvbench.p2p.transports import rendezvous
from kvbench.p2p.transports.rendezvous import choose_address

IFACES = {"lo": "127.0.0.1", "eth0": "10.1.2.3", "ib0": "192.168.7.3"}
TWO_HOSTS = ["node-a", "node-b"]


def test_one_host_stays_on_loopback():
    assert choose_address(["a", "a", "a"], IFACES, ["127.0.1.1"], {}) == ("127.0.0.1", None)


def test_debian_127_0_1_1_is_never_chosen_for_two_hosts():
    addr, error = choose_address(TWO_HOSTS, IFACES, ["127.0.1.1"], {})
    assert (addr, error) == ("10.1.2.3", None)


def test_the_hosts_own_name_address_comes_first_when_it_is_on_an_interface():
    assert choose_address(TWO_HOSTS, IFACES, ["192.168.7.3"], {})[0] == "192.168.7.3"
    # a name that resolves to an address not on this host (stale DNS) is passed over
    assert choose_address(TWO_HOSTS, IFACES, ["172.16.0.9"], {})[0] == "10.1.2.3"


def test_the_socket_ifname_variables_pick_the_interface():
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert choose_address(TWO_HOSTS, IFACES, ["10.1.2.3"], env)[0] == "192.168.7.3"
    assert choose_address(TWO_HOSTS, IFACES, [], {"GLOO_SOCKET_IFNAME": "=eth0"})[0] == "10.1.2.3"
    assert choose_address(TWO_HOSTS, IFACES, [], {"NCCL_SOCKET_IFNAME": "ib"})[0] == "192.168.7.3"
    # an exclusion list picks nothing: the usual order decides
    assert choose_address(TWO_HOSTS, IFACES, [], {"NCCL_SOCKET_IFNAME": "^eth"})[0] == "10.1.2.3"
    assert choose_address(TWO_HOSTS, IFACES, [], {"NCCL_SOCKET_IFNAME": "=ib"})[0] == "10.1.2.3"


def test_master_addr_wins():
    assert choose_address(TWO_HOSTS, IFACES, [], {"MASTER_ADDR": "10.9.9.9"}) == ("10.9.9.9", None)


@pytest.mark.parametrize("ifaces,resolved", [
    ({"lo": "127.0.0.1"}, ["127.0.1.1"]),
    ({"lo": "127.0.0.1", "usb0": "169.254.3.1"}, []),
    ({}, ["127.0.1.1"]),
])
def test_nothing_reachable_names_master_addr(ifaces, resolved):
    addr, error = choose_address(TWO_HOSTS, ifaces, resolved, {})
    assert addr is None
    assert "set MASTER_ADDR" in error and "node-a" in error and "\n" not in error


class _Comm:
    def __init__(self, rank):
        self.rank = rank

    def Get_rank(self):
        return self.rank

    def bcast(self, obj, root=0):
        return obj


def test_rendezvous_over_mpi_uses_this_hosts_interfaces(monkeypatch):
    """The collective: rank 0 reads its interfaces (planted here) and sends the url."""
    monkeypatch.setattr(rendezvous, "interface_addresses", lambda: dict(IFACES))
    monkeypatch.setattr(rendezvous, "name_addresses", lambda host: ["127.0.1.1"])
    monkeypatch.setattr(rendezvous, "_free_port", lambda addr: 29512)
    for var in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    assert rendezvous.rendezvous_address(_Comm(0), TWO_HOSTS) == ("tcp://10.1.2.3:29512", None)
    monkeypatch.setattr(rendezvous, "interface_addresses", lambda: {"lo": "127.0.0.1"})
    url, error = rendezvous.rendezvous_address(_Comm(0), TWO_HOSTS)
    assert url is None and "MASTER_ADDR" in error


def test_this_machines_interfaces_are_read():
    """Linux: the loopback interface is listed with its address (the real ioctl path)."""
    got = rendezvous.interface_addresses()
    assert got.get("lo") == "127.0.0.1", got
