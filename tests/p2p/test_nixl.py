"""NIXL transport: real `mpirun -n 2` jobs on this CPU machine (DRAM buffers, UCX backend).

Starting torch + NIXL costs several seconds per rank here, so the write/read x whole/layer/
block x reuse/recreate/reregister matrix runs as one MPI job (`kvbench p2p --cases`: one
configuration per line, each writing its own records). A stalled handoff, which must abort
its job at --timeout, runs after it in a job of its own; that --timeout is derived from
readiness, not fixed: twice the slowest healthy configuration of the matrix job (at least
5 s), so every healthy wait before the stall (NIXL's connect, its metadata exchange) fits
inside it however busy the machine is. A failed post and a missing NIXL get their own runs.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from kvbench.p2p.transports import ucx_info
from kvbench.p2p.transports.nixl import binding as nixl_import
from tests.conftest import gpu_share_args, mpi_env, run_cases, run_cli, run_mpi

HAVE_NIXL = nixl_import.import_nixl()[0] is not None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL,
                                reason="NIXL is not importable: pip install 'kvbench[nixl]'")

SMALL = "--sizes 32 --warmup 1 --iters 2 --min-iters 2 --quiet"
FAST = "--no-nixl-progress-thread"  # 2 busy cores: NIXL's progress thread only competes for them
CONFIGS = {
    # name: (extra flags, granularity, layout, op, mode, prep, batch)
    "write-whole": ("", "whole", "contiguous", "write", "reuse", "prepped", "message"),
    "read-whole": ("--nixl-op read", "whole", "contiguous", "read", "reuse", "prepped", "message"),
    "write-layer": (f"{FAST} --granularity layer", "layer", "contiguous", "write", "reuse",
                    "prepped", "message"),
    "read-layer": (f"{FAST} --granularity layer --nixl-op read", "layer", "contiguous", "read",
                   "reuse", "prepped", "message"),
    "write-paged": (f"{FAST} --layout paged --granularity block", "block", "paged", "write",
                    "reuse", "prepped", "handoff"),  # the default for per-block messages
    "write-paged-per-message": (f"{FAST} --layout paged --granularity block --nixl-batch message",
                                "block", "paged", "write", "reuse", "prepped", "message"),
    "read-paged-batched": (f"{FAST} --layout paged --granularity block --nixl-op read "
                           "--nixl-batch handoff", "block", "paged", "read", "reuse", "prepped",
                           "handoff"),
    "write-recreate": (f"{FAST} --granularity layer --nixl-recreate", "layer", "contiguous",
                       "write", "recreate", "prepped", "message"),
    "read-recreate-init": (f"{FAST} --granularity layer --nixl-op read --nixl-recreate "
                           "--nixl-prep initialize", "layer", "contiguous", "read", "recreate",
                           "initialize", "message"),
    "write-reregister-init": (f"{FAST} --granularity layer --nixl-reregister --nixl-prep initialize",
                              "layer", "contiguous", "write", "reregister", "initialize", "message"),
    "read-reregister": (f"{FAST} --layout paged --granularity block --nixl-op read "
                        "--nixl-reregister", "block", "paged", "read", "reregister", "prepped",
                        "handoff"),
}
LAYERWISE = f"{FAST} --nixl-op read --pattern layerwise --layer-compute-ms 0.2 --warmup 0"

def _records(out) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.open()]


FAULT = "--sizes 16 --warmup 0 --iters 2 --min-iters 2 --no-write --quiet"
STALL = f"{FAULT} --nixl-inject stall"  # its --timeout: from the healthy cases (stall_job)


@pytest.fixture(scope="module")
def matrix_job(tmp_path_factory):
    """One MPI job, every configuration (`kvbench p2p --cases`):
    ({name: [records]}, process, {name: (exit status, seconds) or None})."""
    from kvbench.p2p import patterns

    tmp = tmp_path_factory.mktemp("nixl")
    configs = {name: c[0] for name, c in CONFIGS.items()}
    if "layerwise" in patterns.available():
        configs["layerwise"] = LAYERWISE
    lines = [f"--transport nixl {SMALL} {flags} --out {tmp / name}" for name, flags in configs.items()]
    res, done = run_cases(2, lines, tmp, timeout=900)  # 900 s only turns a hang into a failure
    return ({name: _records(tmp / name) for name in configs}, res,
            {name: done.get(str(tmp / name)) for name in configs})


@pytest.fixture(scope="module")
def matrix(matrix_job):
    records, res, done = matrix_job
    assert all(d is not None and d[0] == 0 for d in done.values()), \
        res.stdout[-3000:] + res.stderr[-3000:]
    return records


@pytest.fixture(scope="module")
def stall_job(matrix_job):
    """The stalled handoff in a job of its own; its --timeout from readiness, not fixed: twice
    the slowest healthy configuration of the matrix job (at least 5 s; the first one includes
    NIXL's start), so every healthy wait before the stall (NIXL's connect, its metadata
    exchange) fits inside it however busy the machine is. (process, --timeout in s)"""
    _, res, done = matrix_job
    seconds = [d[1] for d in done.values() if d is not None]
    assert seconds, res.stdout[-3000:] + res.stderr[-3000:]
    timeout = max(5, math.ceil(2 * max(seconds)))
    stall = run_mpi(2, "kvbench.p2p", "--transport", "nixl", *STALL.split(), "--timeout",
                    str(timeout), timeout=timeout + 240)
    return stall, timeout


ONE_OFF = {"reuse": ["nixl_register_prefill_ms", "nixl_register_decode_ms", "nixl_metadata_ms",
                     "nixl_make_xfer_ms"],
           "recreate": ["nixl_register_prefill_ms", "nixl_register_decode_ms", "nixl_metadata_ms"],
           "reregister": ["nixl_metadata_setup_ms"]}
PER_HANDOFF = {"reuse": ["nixl_post_ms", "nixl_transfer_ms"],
               "recreate": ["nixl_make_xfer_ms", "nixl_post_ms", "nixl_transfer_ms",
                            "nixl_release_ms"],
               "reregister": ["nixl_register_prefill_ms", "nixl_register_decode_ms",
                              "nixl_metadata_ms", "nixl_make_xfer_ms", "nixl_post_ms",
                              "nixl_transfer_ms", "nixl_release_ms",
                              "nixl_deregister_prefill_ms", "nixl_deregister_decode_ms"]}


@pytest.mark.mpi
@needs_nixl
@pytest.mark.parametrize("name", list(CONFIGS))
def test_handoff_moves_the_kv_and_splits_setup(matrix, name):
    flags, gran, layout, op, mode, prep, batch = CONFIGS[name]
    (rec,) = matrix[name]
    assert rec["transport"] == "nixl" and rec["pattern"] == "sequential"
    assert rec["wrong"] == 0, "every received element checked"
    assert (rec["granularity"], rec["layout"]) == (gran, layout)
    assert (rec["nixl_op"], rec["nixl_mode"], rec["nixl_prep"], rec["nixl_batch"]) == \
        (op, mode, prep, batch)
    assert rec["nixl_progress_thread"] is (FAST not in flags)
    assert rec["descriptors"] == {"whole": 1, "layer": 160, "block": 320}[gran]  # 80 layers, K+V
    bd = rec["breakdown_ms"]
    one_off = ONE_OFF[mode] + (["nixl_prep_dlist_ms"] if prep == "prepped" and mode != "reregister"
                               else [])
    per = PER_HANDOFF[mode] + (["nixl_prep_dlist_ms"] if prep == "prepped" and mode == "reregister"
                               else [])
    handoffs = 1 + len(rec["warmup_ms"]) + rec["iters"] + 1  # cold, warm-up, timed, data check
    for key in one_off:
        assert len(bd.get(key, [])) == 1, (key, sorted(bd))
    for key in per:
        assert len(bd.get(key, [])) == handoffs, (key, sorted(bd))
    for key in one_off + per:
        assert all(v > 0 for v in bd[key]), (key, bd[key])
    if prep == "initialize":
        assert "nixl_prep_dlist_ms" not in bd
    # the timed handoff contains the per-handoff set-up it measures
    assert rec["p50_ms"] > 0 and min(bd["nixl_transfer_ms"]) >= min(bd["nixl_post_ms"]) * 0.999
    info = rec["transport_info"]
    assert info["backend"] == "UCX" and info["backend_used"] == "UCX"
    assert info["nixl_version"] and isinstance(info["ucx_env"], dict)
    assert info["path"].startswith(f"UCX RMA {op}: "), info["path"]  # what UCX says it selected
    assert info["failed_transfers"] == 0


@pytest.mark.mpi
@pytest.mark.check
@needs_nixl
def test_one_handoff_over_nixl_moves_every_byte(tmp_path):
    """The fast tier's NIXL job (make check): one whole-cache WRITE, every element checked."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "nixl", *SMALL.split(), "--out", str(tmp_path),
                  timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = _records(tmp_path)
    assert rec["transport"] == "nixl" and rec["wrong"] == 0 and rec["nixl_op"] == "write"
    info = rec["transport_info"]
    assert info["backend_used"] == "UCX" and info["failed_transfers"] == 0
    assert info["path"].startswith("UCX RMA write: "), info["path"]


@pytest.mark.mpi
@needs_nixl
def test_layerwise_pattern_runs_over_nixl(matrix):
    if "layerwise" not in matrix:
        pytest.skip("the layerwise pattern is not in kvbench/patterns yet")
    recs = {r.get("variant"): r for r in matrix["layerwise"]}
    assert recs[None]["wrong"] == 0 and recs[None]["nixl_op"] == "read"
    assert recs[None]["breakdown_ms"]["nixl_transfer_ms"]


@pytest.mark.mpi
@needs_nixl
def test_stall_past_timeout_aborts_cleanly(stall_job):
    """The prefill side never posts its WRITE: both ranks give up at --timeout, release their
    NIXL handles and registrations, and the job exits non-zero instead of hanging."""
    res, timeout = stall_job
    assert res.returncode != 0, "the stalled handoff must end the job with an error"
    err = res.stderr
    assert timeout >= 5
    assert "did not complete before the --timeout" in err, err[-2000:]
    assert "aborting the job" in err
    assert "handoff 1 aborted; released" in err and "1 registration(s)" in err, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.mpi
@needs_nixl
def test_failed_post_is_counted_and_reported():
    """Decode (the READ initiator) drops prefill's metadata, so NIXL refuses the post with its
    own error: reported with the count, handles released, the job ends non-zero."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "nixl", "--nixl-op", "read",
                  "--nixl-inject", "error", *FAULT.split(), "--timeout", "20", timeout=150)
    assert res.returncode != 0
    err = res.stderr
    assert "nixl: READ of message 0 (handoff 1) post failed: nixlNotFoundError" in err, err[-2000:]
    assert "1 failed transfer(s) on this channel" in err
    assert "handoff 1 aborted; released" in err
    assert "Traceback" not in err


@pytest.mark.mpi
@pytest.mark.gpu
@needs_nixl
@pytest.mark.parametrize("op", ["write", "read"])
def test_vram_handoff(tmp_path, op):
    """Device buffers registered as VRAM (one GPU per rank where there are two)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible: the VRAM path runs on a GPU machine")
    res = run_mpi(2, "kvbench.p2p", "--transport", "nixl", "--device", "cuda", "--nixl-op", op,
                  "--granularity", "layer", *gpu_share_args("nixl"), *SMALL.split(),
                  "--out", str(tmp_path), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = _records(tmp_path)
    assert rec["device"] == "cuda" and rec["wrong"] == 0 and rec["nixl_op"] == op
    assert all(v > 0 for v in rec["breakdown_ms"]["nixl_transfer_ms"])
    assert rec["transport_info"]["path"].startswith(f"UCX RMA {op}: "), rec["transport_info"]


BLOCKER = textwrap.dedent("""\
    # kvbench test: make every NIXL package look not installed
    import sys

    class _NoNixl:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoNixl())
""")


def test_missing_nixl_is_one_line_and_exit_2(tmp_path):
    """Validation runs before anything starts, on every rank alike: one process shows it."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**mpi_env(), "PYTHONPATH": str(tmp_path)}
    res = run_cli("kvbench.p2p", "--transport", "nixl", "--sizes", "16", "--no-write", env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["kvbench p2p: error: transport nixl: NIXL is not installed: pip install "
                     "'kvbench[nixl]' (nixl-cu12 for CUDA 12; nixl-cu13 or the 'nixl' meta "
                     "package for CUDA 13)"], res.stderr


def test_import_failure_names_the_extra(monkeypatch):
    def broken(name):
        raise ImportError(f"libcuda.so.1: cannot open shared object file ({name})")

    monkeypatch.setattr(nixl_import.importlib, "import_module", broken)
    mod, why = nixl_import.import_nixl()
    assert mod is None and "does not import" in why and "pip install 'kvbench[nixl]'" in why
    assert "\n" not in why


UCX_LOG = """\
[1796232873.424463] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.424463] [vm:10199:0]   | kv-0 self cfg#0                                          |
[1796232873.424463] [vm:10199:0]   | remote memory write by ucp_put* from host memory to host |
[1796232873.424463] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.424463] [vm:10199:0]   | Range  | Description |              Config               |
[1796232873.424463] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.424463] [vm:10199:0]   | 0..inf | zero-copy   | self/memory                       |
[1796232873.424463] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.560214] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.560214] [vm:10199:0]   | kv-0 intra-node cfg#1                                    |
[1796232873.560214] [vm:10199:0]   | remote memory write by ucp_put* from host memory to host |
[1796232873.560214] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.560214] [vm:10199:0]   | Range  | Description |              Config               |
[1796232873.560214] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.560214] [vm:10199:0]   | 0..inf | zero-copy   | cma/memory                        |
[1796232873.560214] [vm:10199:0]   +--------+-------------+-----------------------------------+
[1796232873.575054] [vm:10199:0]   +------------+--------------------+---------------+
[1796232873.575054] [vm:10199:0]   | kv-0 intra-node cfg#1                           |
[1796232873.575054] [vm:10199:0]   | active message by ucp_am_send* from host memory |
[1796232873.575054] [vm:10199:0]   +------------+--------------------+---------------+
[1796232873.575054] [vm:10199:0]   |   Range    |    Description     |    Config     |
[1796232873.575054] [vm:10199:0]   +------------+--------------------+---------------+
[1796232873.575054] [vm:10199:0]   |          0 | short              | tcp/lo        |
[1796232873.575054] [vm:10199:0]   |   1..16515 | zero-copy          | tcp/lo        |
[1796232873.575054] [vm:10199:0]   +------------+--------------------+---------------+
[1796232873.751232] [vm:10199:0]   | kv-0 intra-node cfg#1                                            |
[1796232873.751232] [vm:10199:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796232873.751232] [vm:10199:0]   +--------+-------------+-------------------------------------------+
[1796232873.751232] [vm:10199:0]   | Range  | Description |                  Config                   |
[1796232873.751232] [vm:10199:0]   +--------+-------------+-------------------------------------------+
[1796232873.751232] [vm:10199:0]   | 0..inf | zero-copy   | rc_mlx5/mlx5_0:1                          |
"""


def test_ucx_protocol_tables_name_the_path():
    rows = ucx_info.parse_ucx_proto_info(UCX_LOG)
    assert [(r["endpoint"], r["range"], r["transport"]) for r in rows] == [
        ("kv-0 self cfg#0", "0..inf", "self/memory"),
        ("kv-0 intra-node cfg#1", "0..inf", "cma/memory"),
        ("kv-0 intra-node cfg#1", "0", "tcp/lo"),
        ("kv-0 intra-node cfg#1", "1..16515", "tcp/lo"),
        ("kv-0 intra-node cfg#1", "0..inf", "rc_mlx5/mlx5_0:1"),
    ]
    assert ucx_info.summarize_path(rows, "write") == \
        "RMA write: cma/memory (zero-copy); notifications (AM): tcp/lo"
    assert ucx_info.summarize_path(rows, "read") == \
        "RMA read: rc_mlx5/mlx5_0:1 (zero-copy); notifications (AM): tcp/lo"
    assert ucx_info.summarize_path([], "write") is None
