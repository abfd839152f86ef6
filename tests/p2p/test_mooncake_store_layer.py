"""`--pattern store-layerwise`: Mooncake Store layer by layer, real `mpirun -n 2` jobs on this CPU
machine (a mooncake_master the job starts on 127.0.0.1, or the test's own). Gated as
tests/p2p/test_mooncake.py is: the wheel, and Debian's libibverbs1/libnuma1 or kvbench's
private copy of them (made only where CI or KVBENCH_ALLOW_SYSTEM_INSTALL=1 allows).

The data-check run (a 4-layer model, so the per-layer stamps are few) is a job of its own in
the default suite; a planted corruption and a store too small for the working set share one
`kvbench p2p --cases` job (slow), and the master stopped mid-run is a job of its own (slow),
as in tests/p2p/test_mooncake.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvbench.p2p.patterns.store_layerwise import overlap_ms
from tests.conftest import run_cases, run_mpi
from tests.p2p.helpers import TINY, MooncakeJob, masters_left, mooncake_or_skip

LAYERS = TINY["num_hidden_layers"]
BASE = "--transport mooncake --pattern store-layerwise --warmup 1 --iters 3 --min-iters 3 --quiet"
CASES = {  # name: flags (besides BASE and the model)
    "layer": "--layout paged --granularity block --sizes 16,32",
    "corrupt": "--layout paged --granularity block --sizes 16 --debug-corrupt-elements 3",
    # 65,536 tokens of a 4-layer model: 8 objects of 4 MiB per handoff (32 MiB) into a store
    # of 2 x 16 MiB (the least a client mounts); objects stay leased (10 s): later layers and
    # handoffs find no room
    "undersized": "--granularity layer --sizes 65536 --store-segment 16M",
}


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.open()]


@pytest.fixture(scope="module")
def ready():
    mooncake_or_skip()


def _job(tmp: Path, names: list[str]):
    """The cases `names` in one MPI job: ({case: records}, the process, {case: (exit, s)})."""
    cfg = tmp / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    lines = [f"{BASE} --model-config {cfg} {CASES[name]} --out {tmp / name}" for name in names]
    res, done = run_cases(2, lines, tmp, timeout=600)
    return ({n: _records(tmp / n) for n in names}, res, {n: done.get(str(tmp / n)) for n in names})


@pytest.fixture(scope="module")
def job(ready, tmp_path_factory):
    """The data-check run alone (about 17 s here on a busy machine)."""
    return _job(tmp_path_factory.mktemp("store-layer"), ["layer"])


@pytest.fixture(scope="module")
def fault_job(ready, tmp_path_factory):
    """The planted corruption and the store too small, in one job (slow: about 23 s)."""
    return _job(tmp_path_factory.mktemp("store-layer-faults"), ["corrupt", "undersized"])


@pytest.mark.mpi
def test_layer_by_layer_through_the_store_moves_the_bytes(job):
    """0 wrong; one key per page per handoff; per-layer put and get times (L per handoff) and
    the handoff's sums, the store's counters from the master the job started (and stopped)."""
    records, res, done = job
    assert done["layer"] is not None and done["layer"][0] == 0, res.stderr[-3000:]
    recs = records["layer"]
    assert sorted(r["prompt_tokens"] for r in recs) == [16, 32]  # no put/get variants
    for rec in recs:
        assert rec["pattern"] == "store-layerwise" and rec["wrong"] == 0
        assert rec["store_misses"] == 0 and rec["layers"] == LAYERS
        assert rec["descriptors"] == rec["stored_tokens"] // rec["block_size"] * LAYERS * 2
        bd, info = rec["breakdown_ms"], rec["transport_info"]
        handoffs = len(bd["store_put_ms"])  # cold, warm-up, timed, data check
        assert handoffs == 1 + 1 + rec["n_samples"] + 1
        for key in ("store_layer_put_ms", "store_layer_put_end_ms", "store_layer_get_ms",
                    "store_layer_get_start_ms"):
            assert len(bd[key]) == handoffs * LAYERS, key
        for h in range(handoffs):  # the handoff's put and get are its layers' sums
            layer = slice(h * LAYERS, (h + 1) * LAYERS)
            assert bd["store_put_ms"][h] == pytest.approx(sum(bd["store_layer_put_ms"][layer]))
            assert bd["store_get_ms"][h] == pytest.approx(sum(bd["store_layer_get_ms"][layer]))
        assert info["store_master_started"] and info["store_misses"] == 0
        assert info["store_put_rejected"] == 0 and info["store_evicted_objects"] == 0
    assert info["store_objects"] >= sum(r["descriptors"] * len(r["breakdown_ms"]["store_put_ms"])
                                        for r in recs)  # the master's own count, both sizes
    assert masters_left() == []


@pytest.mark.mpi
def test_decode_reads_a_layer_while_prefill_puts_the_next(job):
    """From the recorded stamps (one timeline): each layer's get began after that layer's
    put ended (a get never reads a layer not yet announced), and decode's first get began
    before prefill's last put ended, which the whole store pattern can never show (its get
    waits for every put). Not a timed assertion: an order of recorded events, asked of at
    least one handoff per size (a busy machine may deschedule decode in one)."""
    records, res, done = job
    for rec in records["layer"]:
        bd = rec["breakdown_ms"]
        overlapped = 0
        for h in range(len(bd["store_put_ms"])):
            ends = bd["store_layer_put_end_ms"][h * LAYERS:(h + 1) * LAYERS]
            starts = bd["store_layer_get_start_ms"][h * LAYERS:(h + 1) * LAYERS]
            assert all(s > e for s, e in zip(starts, ends, strict=True)), (h, starts, ends)
            overlapped += starts[0] < ends[-1]
        assert overlapped, bd
        assert rec["store_overlap_ms"] == overlap_ms(bd, LAYERS, 2, rec["n_samples"])
    assert f"{LAYERS} layers: put" in res.stdout  # the table's note under each row


def test_overlap_is_read_from_the_stamps_it_is_given():
    """The overlap's arithmetic on stamps made by hand: pipelined (> 0) and serial (< 0)."""
    bd = {"store_layer_put_end_ms": [1, 2, 3, 1, 2, 3],
          "store_layer_get_start_ms": [1.5, 2.5, 3.5, 3.5, 4, 5]}
    assert overlap_ms(bd, 3, 0, 2) == [3 - 1.5, 3 - 3.5]
    assert overlap_ms(bd, 3, 1, 5) == [-0.5]  # only the handoffs the stamps hold


@pytest.mark.mpi
@pytest.mark.slow
def test_a_planted_corruption_is_caught(fault_job):
    """The sender's bytes altered after the transfer: the data check counts exactly them."""
    records, res, done = fault_job
    assert done["corrupt"] is not None and done["corrupt"][0] == 1, res.stderr[-3000:]
    (rec,) = records["corrupt"]
    assert rec["wrong"] == 3 and rec["store_misses"] == 0


@pytest.mark.mpi
@pytest.mark.slow
def test_a_store_too_small_counts_misses_and_says_so(fault_job):
    """Layers the store has no room for are rejected (counted), decode's gets of them miss
    (counted, named on stderr), and the data check fails the case instead of passing them."""
    records, res, done = fault_job
    assert done["undersized"] is not None and done["undersized"][0] == 1, res.stderr[-3000:]
    (rec,) = records["undersized"]
    info = rec["transport_info"]
    assert info["store_put_rejected"] > 0 and info["store_misses"] > 0, info
    assert info["store_get_codes"].get("-704", 0) > 0  # the store's own word: not found
    assert rec["wrong"] > 0 and rec["store_misses"] == info["store_misses"]
    assert rec["fit_as_link"] is False and "store misses" in rec["not_link_reason"]
    assert "gets missed in handoff" in res.stderr and "data check counts them wrong" in res.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_the_master_stopped_mid_run_ends_the_job_in_one_line(ready, tmp_path):
    """The test's own master (by PID) serves the job (--store-master) and is stopped once the
    store holds objects: one line naming it, exit non-zero, no hang, no process left."""
    from kvbench.p2p.transports.mooncake import store

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    master = store.Master(30)
    try:
        def stop_when_busy() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if store.read_counters("127.0.0.1", master.metrics).get("store_objects"):
                    break
                time.sleep(0.2)
            master.stop()

        job = MooncakeJob(tmp_path, "--pattern", "store-layerwise", "--model-config", str(cfg),
                          "--layout", "paged", "--granularity", "block", "--sizes", "16",
                          "--warmup", "1", "--iters", "100000", "--min-iters", "100000",
                          "--seconds-per-point", "600", "--quiet", "--timeout", "10",
                          "--store-master", master.address, during=stop_when_busy)
    finally:
        master.stop()
    assert job.rc is not None, f"hung\n{job.err[-3000:]}"
    errors = job.errors()
    assert job.rc != 0 and errors, (job.rc, job.err[-3000:])
    assert "mooncake store" in errors[0] and "still running?" in errors[0], errors
    assert "Traceback" not in job.err
    assert job.processes_left() == []


@pytest.mark.mpi
def test_a_segment_the_client_cannot_mount_is_refused_in_one_line(ready, tmp_path):
    """Below 16 MiB Mooncake's setup answers -600 (invalid parameters) and the job aborted
    mid-connect: now one line before anything starts, exit 2, nothing written."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "mooncake", "--pattern", "store-layerwise",
                  "--store-segment", "8M", "--sizes", "16", "--out", str(tmp_path / "out"),
                  timeout=180)
    errors = [line for line in res.stderr.splitlines() if "kvbench p2p: error:" in line]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]
    assert "--store-segment 8M: a store client mounts at least 16M" in errors[0]
    assert not list((tmp_path / "out").glob("*.jsonl"))
