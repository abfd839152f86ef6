"""Which link carried the bytes: NCCL's debug log parsed (samples of NCCL 2.18 to current in
tests/data/nccl, each saying where its format comes from), every transport's reported path
classified, and `kvbench fit --expect-link` flagging a group whose path disagrees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.links import linkpath, nccl_log
from kvbench.p2p import transports
from tests.conftest import run_cli

DATA = Path(__file__).parents[1] / "data" / "nccl"

# sample -> (version, network, gpu_link, path, link kinds)
EXPECTED = {
    "nccl-2.18-p2p-ipc-nvlink.log": ("2.18.5+cuda12.2", "Socket", "NVL", "P2P/IPC/read", "nvlink"),
    "nccl-2.19-p2p-cumem-pcie.log": ("2.19.3+cuda12.3", "Socket", "PXB", "P2P/CUMEM/read", "pcie"),
    "nccl-2.21-net-ib-gdrdma.log": ("2.21.5+cuda12.4", "IB", "LOC",
                                    "NET/IB/0/GDRDMA (mlx5_0:1/IB)", "rdma"),
    "nccl-2.22-p2p-direct-pointer.log": ("2.22.3+cuda12.5", "IB", "NVL",
                                         "P2P/direct pointer/read", "nvlink"),
    "nccl-2.23-net-socket.log": ("2.23.4+cuda12.6", "Socket", None,
                                 "NET/Socket/0, NET/Socket/1 (eth0:10.0.0.2<0>, eth1:10.0.1.2<0>)",
                                 "tcp"),
    "nccl-2.26-shm.log": ("2.26.2+cuda12.8", "Socket", "SYS", "SHM/direct/direct", "shm"),
    "nccl-current-net-ib-pxn.log": (
        "2.27.7+cuda12.9", "IB", "NVL",
        # NET/IB/0 has no /GDRDMA: NCCL stages that NIC's bytes through host memory
        "NET/IB/1/GDRDMA(PCI)/Shared, NET/IB/0/Shared (mlx5_1:1/RoCE, mlx5_0:1/RoCE)",
        "rdma|rdma-host-staged"),
}


def test_every_sample_is_tested_and_says_where_its_format_comes_from():
    samples = sorted(p.name for p in DATA.glob("*.log"))
    assert samples == sorted(EXPECTED)
    for name in samples:
        head = (DATA / name).read_text().split("\n# Formats:")[0]
        assert "not captured" in head, name  # honest about being written, not captured
        assert "Formats:" in (DATA / name).read_text(), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_parses_to_the_path_nccl_logged(name):
    version, network, gpu_link, path, kinds = EXPECTED[name]
    log = nccl_log.parse((DATA / name).read_text())
    assert (log.version, log.network, log.gpu_link, log.path()) == (version, network, gpu_link, path)
    info = {"path": log.path(), "nccl": log.as_dict()}
    assert transports.classify("nccl", info).label == kinds


def test_channel_lines_in_every_format():
    lines = [
        "h:1:2 [0] NCCL INFO Channel 00 : 0[1b000] -> 1[1c000] via P2P/IPC/read",  # before 2.12
        "h:1:2 [0] NCCL INFO Channel 03/1 : 0[1b000] -> 1[1c000] via P2P/IPC",  # 2.12-2.18
        "h:1:2 [0] NCCL INFO Channel 07/0 : 2[2] -> 3[3] via P2P/CUMEM/read/CE",  # 2.19+, copy engine
        "h:1:2 [0] NCCL INFO Channel 01/0 : 3[1] -> 1[1] [send] via NET/IB/2(0)/GDRDMA",
        "h:1:2 [0] NCCL INFO Channel 01/0 : 3[1] -> 1[1] [receive] via NET/IBext_v8/2",
        "h:1:2 [0] NCCL INFO Channel 00/1 : 0[0] -> 1[1] via P2P/indirect/2[2]/read",
        "h:1:2 [0] NCCL INFO Channel 00/1 : 0[0] -> 4[4] via P2P/MNNVL/read",
    ]
    log = nccl_log.parse("\n".join(lines))
    got = [(c.channel, c.conn_index, c.src, c.dst, c.direction, c.transport) for c in log.connections]
    assert got == [
        (0, None, 0, 1, None, "P2P/IPC/read"), (3, 1, 0, 1, None, "P2P/IPC"),
        (7, 0, 2, 3, None, "P2P/CUMEM/read/CE"), (1, 0, 3, 1, "send", "NET/IB/2(0)/GDRDMA"),
        (1, 0, 3, 1, "receive", "NET/IBext_v8/2"), (0, 1, 0, 1, None, "P2P/indirect/2[2]/read"),
        (0, 1, 0, 4, None, "P2P/MNNVL/read")]
    # the PXN proxy rank is not part of the path
    assert "NET/IB/2/GDRDMA" in log.transports()


def test_lines_it_does_not_know_are_ignored_and_an_empty_log_has_no_path():
    log = nccl_log.parse("NCCL INFO Channel 00/02 :    0   1\nrandom text\nNCCL INFO Ring 00 : 0 1\n")
    assert log.connections == [] and log.path() is None and log.version is None


def test_merge_joins_both_sides_of_a_connection():
    send = nccl_log.parse((DATA / "nccl-2.21-net-ib-gdrdma.log").read_text())
    recv = nccl_log.parse((DATA / "nccl-2.23-net-socket.log").read_text())
    both = nccl_log.merge([send, recv])
    assert both.version == "2.21.5+cuda12.4"
    assert both.transports() == ["NET/IB/0/GDRDMA", "NET/Socket/0", "NET/Socket/1"]
    assert len(both.connections) == len(send.connections) + len(recv.connections)
    assert transports.classify("nccl", {"nccl": both.as_dict()}).kinds == {"rdma", "tcp"}


# --------------------------------------------------------------------------- linkpath

@pytest.mark.parametrize("transport, info, kinds", [
    ("gloo", {"path": "TCP sockets (Gloo)"}, "tcp"),
    ("mpi", {"path": "host"}, "host"),
    ("mpi", {"path": "host-staged"}, "host"),
    ("mpi", {"path": "device-direct"}, "unknown"),
    ("nixl", {"path": "UCX RMA write: cma/memory (zero-copy); notifications (AM): tcp/lo"}, "shm"),
    ("nixl", {"path": "UCX RMA write: rc_mlx5/mlx5_0:1 (zero-copy); notifications (AM): "
                      "rc_mlx5/mlx5_0:1"}, "rdma"),
    ("nixl", {"path": "UCX RMA read: tcp/eth0 (zero-copy)"}, "tcp"),
    ("nixl", {"path": "UCX RMA write: cuda_ipc/cuda (zero-copy)"}, "nvlink|pcie"),
    ("nixl", {"path": "unknown (UCX reported no protocol selection)"}, "unknown"),
    # an older nccl record without the parsed detail: the joined path string
    ("nccl", {"path": "NET/Socket/0"}, "tcp"),
    ("nccl", {"path": "P2P/CUMEM/read"}, "nvlink|pcie"),  # no topology line: cannot tell
    ("nccl", {"path": "unknown (NCCL_DEBUG set by the user: see the job log)"}, "unknown"),
    ("nccl", None, "unknown"),
])
def test_classify_every_transport(transport, info, kinds):
    assert transports.classify(transport, info).label == kinds


def rec(transport: str, path: str, nbytes: int, samples: list[float]) -> dict:
    """A p2p record with the fields the fit reads (raw layout, as `--bytes` writes)."""
    s = sorted(samples)
    return {"schema": "kvbench.p2p/1", "transport": transport, "pattern": "sequential",
            "granularity": "whole", "layout": "raw", "dtype": None, "device": "cpu",
            "model": None, "prompt_tokens": None, "bytes": nbytes, "world_size": 2,
            "hosts": ["a", "b"], "iters": len(s), "samples_ms": samples, "p50_ms": s[len(s) // 2],
            "p95_ms": s[-1], "p99_ms": s[-1], "min_ms": s[0], "max_ms": s[-1],
            "gbps": nbytes / 1e9 / (s[len(s) // 2] / 1e3), "cold_ms": 1.0, "wrong": 0,
            "transport_info": {"path": path}, "argv": [], "env": {}, "timestamp": "2026-01-01T00:00:00Z"}


def write_run(tmp_path: Path, transport: str, path: str) -> Path:
    out = tmp_path / f"{transport}.jsonl"
    lines = []
    for i, nbytes in enumerate((1 << 20, 4 << 20, 16 << 20, 64 << 20)):
        base = 0.5 + nbytes / 2e9 * 1e3  # 0.5 ms + 2 GB/s
        lines.append(json.dumps(rec(transport, path, nbytes,
                                    [base * (1 + 0.01 * ((k * 7 + i) % 5 - 2)) for k in range(10)])))
    out.write_text("\n".join(lines) + "\n")
    return out


def link_warnings(doc: dict) -> list[str]:
    groups = doc.get("groups") or doc.get("fits") or []
    return [w["message"] for g in groups for w in g.get("warnings", []) if w["code"] == "link_mismatch"]


def test_fit_flags_a_group_whose_path_is_not_the_expected_link(tmp_path):
    # Planted fault: the "NVLink" job whose bytes NCCL sent over TCP sockets.
    run = write_run(tmp_path, "nccl", "NET/Socket/0 (eth0:10.0.0.2<0>)")
    r = run_cli("kvbench.fit", str(run), "--out", str(tmp_path / "f.json"), "--expect-link", "nvlink",
                "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    msgs = link_warnings(json.loads((tmp_path / "f.json").read_text()))
    assert len(msgs) == 1 and "expected the bytes on nvlink" in msgs[0] and "NET/Socket/0" in msgs[0]
    assert "link_mismatch" in r.stdout


def test_fit_is_quiet_when_the_path_is_the_expected_link_or_none_is_declared(tmp_path):
    run = write_run(tmp_path, "nccl", "NET/Socket/0 (eth0:10.0.0.2<0>)")
    for i, extra in enumerate((["--expect-link", "tcp"], [])):
        out = tmp_path / f"f{i}.json"
        r = run_cli("kvbench.fit", str(run), "--out", str(out), "--bootstrap", "100", *extra)
        assert r.returncode == 0, r.stderr
        assert link_warnings(json.loads(out.read_text())) == []


def test_fit_rejects_an_unknown_expected_link_in_one_line(tmp_path):
    run = write_run(tmp_path, "gloo", "TCP sockets (Gloo)")
    r = run_cli("kvbench.fit", str(run), "--expect-link", "carrier-pigeon")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--expect-link" in r.stderr


def test_declared_links_give_kind_and_line_rate():
    assert linkpath.declared("ib-ndr") == ("rdma", 50.0)
    assert linkpath.declared("eth-100g") == ("tcp", 12.5)
    r = run_cli("kvbench.links.linkpath", "declared", "nvlink4")
    assert (r.returncode, r.stdout.strip()) == (0, "nvlink 450")
    r = run_cli("kvbench.links.linkpath", "declared", "token-ring")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "ib-ndr" in r.stderr
    listed = run_cli("kvbench.links.linkpath", "links").stdout
    assert all(name in listed for name in linkpath.DECLARED_LINKS)
    for kind, _, _ in linkpath.DECLARED_LINKS.values():
        assert kind in linkpath.EXPECTABLE
