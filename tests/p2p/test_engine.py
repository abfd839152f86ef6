"""The handoff engine's device ordering, checked without a GPU on the asynchronous CPU device.

`--device cpu-async` keeps the KV in CPU memory but queues every fill, wipe, pack, unpack,
staging copy and compute chunk to a worker thread that applies them, in order, only once an
event or a synchronize orders them (kvbench/p2p/devices.py). A protocol that forgets one ordering
then moves stale bytes, and the data check counts them.

The matrix runs every pattern (sequential, layerwise, sharded) x transport (mpi device-direct
and host-staged, gloo, nixl write and read) x layout x granularity in two MPI jobs (2 and 3
ranks). Then each ordering the engine owes the device is planted out in turn (tests/plant.py)
and the check must fail exactly where that ordering protects data, and nowhere else.

What this proves and what not: the protocol's ordering logic. Not CUDA's behaviour, not any
timing; no substitute for a GPU run (scripts/gpu-check).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from kvbench.p2p.devices import AsyncCPUDevice, CPUDevice, make_device
from kvbench.p2p.transports.nixl import binding as nixl_import
from tests.p2p.helpers import LAYOUTS, TINY, run_job

HAVE_NIXL = nixl_import.import_nixl()[0] is not None
LAYERS = 4
NIXL = "--transport nixl --no-nixl-progress-thread"
TRANSPORTS = {
    "mpi-direct": "--transport mpi --mpi-device-direct yes",
    "mpi-staged": "--transport mpi --mpi-device-direct no",
    "gloo": "--transport gloo",
    **({"nixl-write": NIXL, "nixl-read": f"{NIXL} --nixl-op read"} if HAVE_NIXL else {}),
}
DIRECT = {"mpi-direct", "nixl-write", "nixl-read"}  # the transport touches device memory itself
FAST = "--sizes 40 --iters 1 --min-iters 1 --warmup 0 --quiet --device cpu-async"
PATTERNS = {2: "--pattern sequential,layerwise --layer-compute-ms 0.2",
            3: "--pattern sharded --prefill-tp 2 --decode-tp 1"}


def packed(layout: str, gran: str, pattern: str) -> bool:
    """Whether the sender packs and the receiver unpacks (paged KV sent as layers or one
    message; layerwise always sends per layer)."""
    if pattern == "layerwise" and gran == "whole":
        gran = "layer"
    return layout == "paged" and gran != "block"


def matrix_cases(ranks: int) -> dict[str, str]:
    return {f"{t}/{lay}/{gran}": f"{flags} {FAST} {PATTERNS[ranks]} --model-config {{cfg}} "
            f"--layout {lay} --granularity {gran}"
            for t, flags in TRANSPORTS.items() for lay, gran in LAYOUTS}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    p = tmp_path_factory.mktemp("model") / "tiny.json"
    p.write_text(json.dumps(TINY))
    return str(p)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, cfg):
    tmp = tmp_path_factory.mktemp("matrix")
    out, took = {}, 0.0
    for ranks in (2, 3):
        cases = {k: v.format(cfg=cfg) for k, v in matrix_cases(ranks).items()}
        got, secs = run_job(tmp, ranks, "none", cases)
        out.update({(ranks, k): v for k, v in got.items()})
        took += secs
    print(f"async-device matrix: {len(out)} configurations in {took:.0f} s")
    return out


# -- the device itself -------------------------------------------------------------------


def test_async_device_applies_work_only_when_ordered():
    dev = AsyncCPUDevice()
    try:
        t = torch.zeros(4)
        dev.run(lambda: t.fill_(1))
        ev = dev.record()
        dev.run(lambda: t.add_(1))
        time.sleep(0.05)
        assert t.tolist() == [0] * 4 and dev.pending == 2  # nothing applied yet
        ev.wait()
        assert t.tolist() == [1] * 4 and dev.pending == 1  # up to the event, in order
        assert dev.host_waits == 1
        ev.wait()
        assert dev.host_waits == 1  # an event seen complete costs nothing more
        dev.synchronize()
        assert t.tolist() == [2] * 4 and dev.pending == 0
        later = dev.record()
        assert later.query()  # nothing queued after it: done
        dev.run(lambda: t.mul_(3))
        ev3 = dev.record()
        deadline = time.monotonic() + 5
        while not ev3.query():  # query lets the device progress without blocking the host
            assert time.monotonic() < deadline
        assert t.tolist() == [6] * 4
    finally:
        dev.close()


def test_async_device_surfaces_failed_work():
    dev = AsyncCPUDevice()
    try:
        dev.run(lambda: 1 / 0)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            dev.synchronize()
    finally:
        dev.close()


def test_cpu_device_is_synchronous_and_devices_are_named():
    dev = CPUDevice()
    t = torch.zeros(1)
    dev.run(lambda: t.fill_(5))
    assert t.item() == 5 and dev.record().query() and dev.host_visible
    assert make_device("cpu-async").host_visible is False
    with pytest.raises(ValueError, match="unknown device"):
        make_device("tpu")


def test_async_device_is_used_from_many_threads_safely():
    dev = AsyncCPUDevice()
    try:
        t = torch.zeros(1)
        threads = [threading.Thread(target=lambda: [dev.run(lambda: t.add_(1)) for _ in range(50)])
                   for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dev.synchronize()
        assert t.item() == 200
    finally:
        dev.close()


# -- the matrix ------------------------------------------------------------------------------


@pytest.mark.mpi
def test_every_pattern_transport_layout_granularity_moves_every_byte(matrix):
    assert len(matrix) == 2 * len(TRANSPORTS) * len(LAYOUTS)
    for (ranks, name), (status, recs) in matrix.items():
        assert status["rc"] == 0, (ranks, name, status)
        checked = [r for r in recs if r["wrong"] is not None]
        want = {2: {"sequential", "layerwise"}, 3: {"sharded"}}[ranks]
        assert {r["pattern"] for r in checked} == want, (ranks, name)
        assert all(r["wrong"] == 0 and r["device"] == "cpu-async" for r in checked), (ranks, name)
        for r in recs:
            assert r["spec"]["device"] == "cpu-async"
            assert r["n_samples"] == len(r["samples_ms"]) == len(r["sample_rounds"]) >= 1


def _handoffs(recs) -> int:
    """Handoffs the records stand for: cold + warm-up + timed per record, plus one check per
    checked record."""
    return sum(1 + len(r["warmup_ms"]) + r["iters"] + (r["wrong"] is not None) for r in recs)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable: the engine matrix ran without "
                    "its nixl-write and nixl-read rows (pip install 'kvbench[nixl]')")
def test_the_matrix_has_its_nixl_rows(matrix):
    """Said here so that a run without NIXL shows the missing rows as a skip."""
    for t in ("nixl-write", "nixl-read"):
        rows = [k for k in matrix if k[1].startswith(f"{t}/")]
        assert len(rows) == 2 * len(LAYOUTS), (t, rows)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable: pip install 'kvbench[nixl]'")
def test_nixl_waits_once_per_step_not_per_post(matrix, tmp_path, cfg):
    """Finding 3: the prefill rank blocks on the device at most once per handoff (sequential)
    or per layer (layerwise), whatever the message count; planting a sync at every post (the
    old behaviour) multiplies the waits by the messages per step and the bound fails."""
    def bound(recs):
        return _handoffs(recs) * LAYERS + 4  # per-layer steps at most, + set-up syncs

    for lay, gran in [("paged", "layer"), ("paged", "block"), ("contiguous", "block")]:
        status, recs = matrix[(2, f"nixl-write/{lay}/{gran}")]
        seq = [r for r in recs if r["pattern"] == "sequential"][0]
        assert seq["descriptors"] >= 8
        assert status["waits"][0] <= bound(recs), (lay, gran, status["waits"], bound(recs))
    cases = {"paged-block": f"{NIXL} {FAST} {PATTERNS[2]} --model-config {cfg} --layout paged "
                            "--granularity block"}
    got, _ = run_job(tmp_path, 2, "sync-per-post", cases)
    status, recs = got["paged-block"]
    assert status["rc"] == 0
    assert status["waits"][0] > bound(recs), (status["waits"], bound(recs))


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable: pip install 'kvbench[nixl]'")
def test_nixl_batches_a_block_handoff_by_default(matrix):
    _, recs = matrix[(2, "nixl-write/paged/block")]
    for r in recs:  # a layerwise pattern in the run: one request per layer
        assert r["nixl_batch"] == "layer" and r["spec"]["transport_options"]["batch"] == "layer"
    _, recs = matrix[(3, "nixl-write/paged/block")]
    assert {r["nixl_batch"] for r in recs} == {"handoff"}
    _, recs = matrix[(3, "nixl-write/paged/layer")]
    assert {r["nixl_batch"] for r in recs} == {"message"}


# -- planted faults: the check must fail exactly where an ordering protects data ----------------


FAULTS = {
    # fault: which configurations it corrupts (transport, layout, granularity, pattern)
    "no-readiness": lambda t, lay, gran, pat: t in DIRECT and packed(lay, gran, pat),
    "no-order-before-post": lambda t, lay, gran, pat: t in DIRECT,
    "no-device-completion": lambda t, lay, gran, pat: t not in DIRECT or packed(lay, gran, pat),
}


@pytest.mark.mpi
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_missing_ordering_shows_as_wrong_elements(fault, tmp_path, cfg):
    """Finding 2: remove one ordering (readiness wait before a non-stream-ordered post, wipes
    ordered before the first post, the receiver's device completion before its notice) and the
    data check fails wherever it protected the bytes; staged transports are immune to the first
    two because their copies are queued behind the producer on the same stream."""
    combos = [("contiguous", "whole"), ("paged", "layer")]  # unpacked and packed
    chosen = [t for t in ("mpi-direct", "mpi-staged", "gloo", "nixl-read") if t in TRANSPORTS]
    cases = {f"{t}/{lay}/{gran}": f"{TRANSPORTS[t]} {FAST} {PATTERNS[2]} --model-config {cfg} "
             f"--layout {lay} --granularity {gran}" for t in chosen for lay, gran in combos}
    got, _ = run_job(tmp_path, 2, fault, cases)
    for name, (status, recs) in got.items():
        t, lay, gran = name.split("/")
        for r in (r for r in recs if r["wrong"] is not None):
            bites = FAULTS[fault](t, lay, gran, r["pattern"])
            assert (r["wrong"] > 0) == bites, (fault, name, r["pattern"], r["wrong"])
        assert (status["rc"] == 1) == any(FAULTS[fault](t, lay, gran, p)
                                          for p in ("sequential", "layerwise")), (name, status)


HELD = [t for t in ("mpi-direct", "mpi-staged", "gloo", "nixl-write", "nixl-read") if t in TRANSPORTS]


@pytest.mark.mpi
def test_layerwise_posts_never_wait_on_the_host_per_layer(tmp_path, cfg):
    """Issue 40 item 6 for every transport that is not stream-ordered (MPI device-direct and
    host-staged, Gloo, NIXL writing and reading): a layer's post is held until its event is
    done, polled (HeldPosts), never waited on, so the prefill rank's host waits do not grow
    with the layers. Planting the old host wait per step (each held post waits on its event
    first) adds at least one wait per layer of every overlapped handoff: the count can fail."""
    cases = {t: f"{TRANSPORTS[t]} {FAST} --pattern layerwise --layer-compute-ms 0.2 "
                f"--model-config {cfg} --layout contiguous --granularity layer" for t in HELD}
    fixed, _ = run_job(tmp_path, 2, "none", cases)
    planted, _ = run_job(tmp_path, 2, "host-wait-per-step", cases)
    for t in HELD:
        (ok, recs), (old, old_recs) = fixed[t], planted[t]
        assert ok["rc"] == 0 == old["rc"], (t, ok, old)
        assert all(r["wrong"] == 0 for r in recs + old_recs if r["wrong"] is not None), t
        overlapped = _handoffs([r for r in recs if r.get("variant") is None])
        assert old["waits"][0] - ok["waits"][0] >= LAYERS * overlapped, (t, ok, old, overlapped)
