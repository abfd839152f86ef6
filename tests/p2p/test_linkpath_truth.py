"""Path truth on captured text (issue 40): the path of a record is the path of its KV's bytes.

The captured rows are the committed H100 records themselves (results/gpu-h100-20261206: one
H100 shared by both ranks, NIXL 1.5.1 / UCX 1.23.0): their UCX protocol rows, GPU UUIDs and
variables, read as written. Every check is shown able to fail by planting the fault it must
catch into a copy of the captured record (a merged path, another GPU's UUID, a user's
UCX_CUDA_IPC_ENABLE_GET_ZCOPY, ...). NCCL's GDRDMA-less log is the captured-format sample of
tests/data/nccl with its /GDRDMA taken away.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest

from kvbench.links import linkcauses, linkpath, nccl_log, ucx_rows
from kvbench.p2p import transports
from kvbench.p2p.transports.nixl.transport import CUDA_IPC_GET, kvbench_ucx_env
from tests.conftest import ROOT, run_cli

H100 = ROOT / "results" / "gpu-h100-20261206"
NCCL = ROOT / "tests" / "data" / "nccl"


def records(stem: str) -> list[dict]:
    return [json.loads(line) for line in (H100 / f"kvbench-p2p-{stem}.jsonl").read_text()
            .splitlines() if line.strip()]


IPC = records("20261206T094657Z-ea813c")  # --transport ipc --device cuda, one GPU
WRITE = records("20261206T094726Z-6290d5")  # nixl link WRITE
READ = records("20261206T094906Z-48720d")  # nixl engine READ (descriptor sweep)


# --------------------------------------------------------------------------- the WRITE

def kv_is_cuda_ipc_alone(lp: linkpath.LinkPath) -> bool:
    lanes = re.findall(r"([a-z_]+)/", lp.evidence.split(":", 1)[-1].split(";")[0])
    return lanes == ["cuda_ipc"] and not lp.emulated and "tcp" not in lp.kinds


def test_the_write_kv_row_is_cuda_ipc_alone():
    for rec in WRITE:
        lp = transports.classify_record(rec)
        assert kv_is_cuda_ipc_alone(lp), lp
        assert lp.evidence.startswith("UCX RMA write (cuda->cuda, the KV's memory): "
                                      "cuda_ipc/cuda (zero-copy)")
        assert lp.kinds == {"same-device"} and "GPU-de3a7f2b" in lp.evidence
        assert lp.fails("nvlink") and not lp.fails("same-device")
    rows = WRITE[0]["transport_info"]["ucx_protocols"]
    assert ucx_rows.summarize(rows, "write", "cuda") == (
        "RMA write: cuda_ipc/cuda (zero-copy); other memory (not the KV): cma/memory "
        "(zero-copy, host->host), tcp/lo (software emulation, host->cuda); "
        "notifications (AM): tcp/lo")


def test_planted_merged_path_is_not_cuda_ipc_alone_and_fails_nvlink():
    # the record as written says every RMA row merged; read from that string alone (the old
    # reading), the path is shm+tcp+cuda_ipc, and the check above refuses it
    merged = linkpath.classify_ucx(WRITE[0]["transport_info"]["path"])
    assert merged.kinds == {"shm", "tcp", "nvlink", "pcie"} and merged.emulated
    assert not kv_is_cuda_ipc_alone(merged)
    assert merged.fails("nvlink")  # a tcp part no longer hides behind the cuda_ipc one
    # a planted host-memory record of the same rows: its KV row is cma, not cuda_ipc
    host = copy.deepcopy(WRITE[0])
    host["device"] = "cpu"
    assert not kv_is_cuda_ipc_alone(transports.classify_record(host))


def test_a_cuda_ipc_row_between_two_gpus_is_nvlink_or_pcie_not_same_device():
    rec = copy.deepcopy(WRITE[0])
    rec["gpus"][1]["uuid"] = "GPU-00000000-0000-0000-0000-000000000001"  # planted: another GPU
    lp = transports.classify_record(rec)
    assert lp.kinds == {"nvlink", "pcie"} and not lp.fails("nvlink") and lp.fails("tcp")


# --------------------------------------------------------------------------- ipc

def test_ipc_records_name_one_gpu_shared_by_both_ranks():
    for rec in IPC:
        lp = transports.classify_record(rec)
        assert lp.label == "same-device" and "unknown" not in lp.kinds
        assert "GPU UUID GPU-de3a7f2b-70e3-57a9-d058-a8c38f9a1622 on both ranks" in lp.evidence
        assert [c.code for c in lp.causes] == ["shared-gpu"]


def test_ipc_without_uuids_rests_on_weaker_evidence_and_says_so():
    rec = copy.deepcopy(IPC[0])
    for g in rec["gpus"]:
        g["uuid"] = None
    lp = transports.classify_record(rec)
    assert lp.label == "same-device" and "weaker evidence" in lp.evidence
    assert "device index 0" in lp.evidence
    del rec["gpus"]  # older still: only the ranks' environment
    lp = transports.classify_record(rec)
    assert lp.label == "same-device" and "weaker evidence" in lp.evidence
    rec["env"]["ranks"][1]["gpu_index"] = 1  # planted: another device index
    assert transports.classify_record(rec).label == "nvlink|pcie"


def test_planted_other_gpu_is_not_same_device_and_cpu_ipc_is_shm():
    rec = copy.deepcopy(IPC[0])
    rec["gpus"][1]["uuid"] = "GPU-00000000-0000-0000-0000-000000000001"
    assert transports.classify_record(rec).label == "nvlink|pcie"
    cpu = {"transport": "ipc", "device": "cpu", "hosts": ["a", "a"],
           "transport_info": {"path": "shm", "mode": "read"}}
    assert transports.classify_record(cpu).label == "shm"
    assert transports.classify("ipc", {}).label == "unknown"


# --------------------------------------------------------------------------- the READ

def test_the_read_is_software_emulation_with_its_cause_and_fix():
    for rec in READ:
        lp = transports.classify_record(rec)
        assert lp.emulated and lp.kinds == {"tcp"} and lp.fails("nvlink") and lp.fails("tcp")
        assert [c.code for c in lp.causes] == ["cuda-ipc-get-off"]
        assert lp.causes[0].fix == "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
    note = linkpath.emulation_note(transports.classify_record(r) for r in READ)
    assert note.count("cuda-ipc-get-off") == 1 and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in note


def read_with(**ucx_env) -> dict:
    rec = copy.deepcopy(READ[0])
    rec["transport_info"]["ucx_env"].update(ucx_env)
    return rec


def test_planted_settings_change_the_cause():
    # the user had set GET on: then it is not that cause
    lp = transports.classify_record(read_with(UCX_CUDA_IPC_ENABLE_GET_ZCOPY="y"))
    assert lp.emulated and "cuda-ipc-get-off" not in [c.code for c in lp.causes]
    assert "not recognised" in lp.explain()
    # a UCX_TLS without cuda_ipc: that is the cause, and GET is not blamed
    lp = transports.classify_record(read_with(UCX_TLS="tcp,sm,self"))
    assert [c.code for c in lp.causes] == ["ucx-tls"] and "cuda_ipc" in lp.causes[0].fix
    assert linkcauses.tls_allows("^tcp", "cuda_ipc") and not linkcauses.tls_allows("^cuda", "cuda_ipc")
    assert linkcauses.tls_allows("cuda,tcp", "cuda_ipc") and linkcauses.tls_allows("all", "rc_mlx5")
    assert linkcauses.tls_allows("rc_x,tcp", "rc_mlx5") and not linkcauses.tls_allows("tcp", "rc_mlx5")


def test_pid_namespaces_expandable_segments_and_one_process_are_named_from_the_record():
    base = read_with(UCX_CUDA_IPC_ENABLE_GET_ZCOPY="y")  # so only the planted cause remains
    ranks = base["env"]["ranks"]
    assert transports.classify_record(base).causes == ()
    rec = copy.deepcopy(base)
    rec["env"]["ranks"][0]["pid_namespace"] = "pid:[4026531836]"
    rec["env"]["ranks"][1]["pid_namespace"] = "pid:[4026532999]"
    assert [c.code for c in transports.classify_record(rec).causes] == ["pid-namespace"]
    rec["env"]["ranks"][1]["pid_namespace"] = "pid:[4026531836]"  # planted: the same one
    assert transports.classify_record(rec).causes == ()
    rec = copy.deepcopy(base)
    rec["env"]["ranks"][1]["variables"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    assert [c.code for c in transports.classify_record(rec).causes] == ["not-ipc-capable"]
    rec["env"]["ranks"][1]["variables"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    assert transports.classify_record(rec).causes == ()
    rec = copy.deepcopy(base)
    rec["env"]["ranks"][0]["pid"] = rec["env"]["ranks"][1]["pid"] = 4242
    assert [c.code for c in transports.classify_record(rec).causes] == ["one-process"]
    rec["env"]["ranks"][1]["pid"] = 4243
    assert transports.classify_record(rec).causes == ()
    rec = copy.deepcopy(base)
    for r in rec["transport_info"]["ucx_protocols"]:
        r["endpoint"] = r["endpoint"].replace("intra-node", "self")
    lp = transports.classify_record(rec)  # UCX's loopback rows: no peer's path at all
    assert lp.kinds == {"unknown"} and [c.code for c in lp.causes] == ["one-process"]
    assert transports.classify_record(base).kinds == {"tcp"}  # the same rows to a peer
    assert len(ranks) == 2


# --------------------------------------------------------------------------- not GPUDirect

def test_a_gdrdma_less_nccl_log_is_host_staged_not_gpudirect():
    text = (NCCL / "nccl-2.21-net-ib-gdrdma.log").read_text()
    good = nccl_log.parse(text)
    assert transports.classify("nccl", {"nccl": good.as_dict()}).label == "rdma"
    planted = nccl_log.parse(text.replace("/GDRDMA", ""))
    lp = transports.classify("nccl", {"nccl": planted.as_dict()})
    assert lp.label == "rdma-host-staged" and lp.fails("rdma")
    assert [c.code for c in lp.causes] == ["no-gpudirect"]
    msg = linkpath.mismatch_of({lp: 3}, "rdma")
    assert "rdma-host-staged" in msg and "nvidia_peermem" in msg
    assert linkpath.mismatch_of({transports.classify("nccl", {"nccl": good.as_dict()}): 3},
                                "rdma") is None


STAGED_ROW = {"endpoint": "kv-0 inter-node cfg#1",
              "operation": "remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[0]",
              "range": "0..inf", "protocol": "multi-frag copy-in",
              "transport": "rc_mlx5/mlx5_0:1, cuda_copy/cuda"}


def nixl_record(row: dict, device: str = "cuda") -> dict:
    return {"transport": "nixl", "device": device, "hosts": ["a", "b"],
            "transport_info": {"nixl_op": "write", "ucx_env": {}, "path": "UCX RMA write: ...",
                               "ucx_protocols": [row]}}


def test_a_cuda_copy_staged_ucx_rdma_row_is_not_gpudirect():
    lp = transports.classify_record(nixl_record(STAGED_ROW))
    assert lp.label == "rdma-host-staged" and lp.fails("rdma")
    assert "no-gpudirect" in lp.explain("rdma")
    copy_in = dict(STAGED_ROW, transport="rc_mlx5/mlx5_0:1")  # copy-in alone stages too
    assert transports.classify_record(nixl_record(copy_in)).label == "rdma-host-staged"
    # the fault it must catch, planted the other way: a zero-copy row from VRAM is GPUDirect
    direct = dict(STAGED_ROW, protocol="zero-copy", transport="rc_mlx5/mlx5_0:1")
    assert transports.classify_record(nixl_record(direct)).label == "rdma"
    assert not transports.classify_record(nixl_record(direct)).fails("rdma")
    host = dict(STAGED_ROW, operation="remote memory write by ucp_put* from host memory to host")
    assert transports.classify_record(nixl_record(host, "cpu")).label == "rdma"  # DRAM: no GPU


# --------------------------------------------------------------------------- the CLI

def test_fit_expect_nvlink_over_the_committed_h100_records(tmp_path):
    files = sorted(str(p) for p in H100.glob("kvbench-p2p-*.jsonl"))
    out = tmp_path / "h100.fit.json"
    r = run_cli("kvbench.fit", *files, "--out", str(out), "--expect-link", "nvlink",
                "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    by = {f"{g['group']['transport']}/{g['group'].get('transport_options.op')}": g
          for g in doc["groups"]}
    warn = {k: " ".join(w["message"] for w in g["warnings"] if w["code"] == "link_mismatch")
            for k, g in by.items()}
    assert "(unknown)" not in " ".join(warn.values())
    assert "ipc: cuda_ipc, both ranks on one GPU" in warn["ipc/None"]
    assert "(same-device)" in warn["ipc/None"] and "shared-gpu" in warn["ipc/None"]
    assert ("UCX RMA write (cuda->cuda, the KV's memory): cuda_ipc/cuda (zero-copy); both ranks "
            "on one GPU") in warn["nixl/write"] and "tcp" not in warn["nixl/write"]
    assert "software emulation" in warn["nixl/read"]
    assert "cuda-ipc-get-off" in warn["nixl/read"]
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in warn["nixl/read"]
    assert "cuda-ipc-get-off" in r.stdout  # printed, not only written


# --------------------------------------------------------------------------- item 3 and docs

def test_cuda_ipc_get_is_set_on_cuda_unless_the_user_set_it():
    assert kvbench_ucx_env({}, "cuda", True, False) == {CUDA_IPC_GET: "y"}
    assert kvbench_ucx_env({CUDA_IPC_GET: "n"}, "cuda", True, False) == {}  # the user's
    assert kvbench_ucx_env({CUDA_IPC_GET: "y"}, "cuda", True, False, {CUDA_IPC_GET}) == \
        {CUDA_IPC_GET: "y"}  # set by kvbench earlier in this process: still kvbench's
    assert kvbench_ucx_env({}, "cuda", False, False) == {}  # --no-nixl-cuda-ipc-get
    for dev in ("cpu", "cpu-async"):  # CPU runs unchanged
        assert kvbench_ucx_env({}, dev, True, False) == {}
        assert kvbench_ucx_env({}, dev, True, True) == {"UCX_RCACHE_MAX_UNRELEASED": "1024"}


def test_docs_table_lists_every_cause_once():
    text = (ROOT / "docs" / "nixl.md").read_text()
    section = text.split("## When the path is not the link", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| `")]
    assert [r[0].strip("`") for r in rows] == list(linkcauses.CAUSES)  # each once, in order
    for row in rows:  # the table says what the code says
        assert tuple(row[1:]) == linkcauses.CAUSES[row[0].strip("`")], row[0]


@pytest.mark.parametrize("module", ["kvbench.links.linkcauses", "kvbench.links.ucx_rows",
                                    "kvbench.links.linkpath"])
def test_the_link_vocabulary_stays_torch_free(module):
    r = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in "
                        "('torch', 'mpi4py') if m in sys.modules))"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_p2p_warns_once_at_the_end_of_an_emulated_run(capsys):
    from types import SimpleNamespace

    from kvbench.p2p.report import report

    args = SimpleNamespace(no_write=True, out=".")
    for recs, warned in ((READ, True), (WRITE, False)):
        recs = copy.deepcopy(recs)
        assert report(args, recs, recs[0]["transport_info"], recs[0]["env"]["ranks"], 0.01) == 0
        err = capsys.readouterr().err
        assert err.count("software emulation, not a link") == (1 if warned else 0), err
        assert ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in err) == warned


def test_the_h100_readme_quotes_the_records():
    import statistics

    rec = next(r for r in WRITE if r["prompt_tokens"] == 8192)
    post = statistics.median(rec["breakdown_ms"]["nixl_post_ms"])
    xfer = statistics.median(rec["breakdown_ms"]["nixl_transfer_ms"])
    text = " ".join((H100 / "README.md").read_text().split())
    assert (f"`nixl_post_ms` is {post:.1f} of `nixl_transfer_ms` {xfer:.1f} ms" in text
            and f"{rec['descriptors']:,} descriptors" in text)
    assert f"about {post / rec['descriptors'] * 1e3:.1f} µs per descriptor" in text
    row = next(r for r in READ[0]["transport_info"]["ucx_protocols"]
               if r["operation"].startswith("remote memory read"))
    assert f"{row['protocol']}, {row['transport']}`" in text  # the READ's own row, as quoted
