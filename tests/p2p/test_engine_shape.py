"""The engine-shaped handoff's construction (kvbench.p2p.transports.nixl.engine_shape, transports/nixl/engine.py).

Unit tests need no MPI: region tables and ids, the merge count, block tables, the poll
schedule, the flags' refusals. The merge count is held against NIXL itself: two agents in
this process READ a request's blocks, and the telemetry's descCount (the count after NIXL's
merging, what vLLM's vllm:nixl_num_descriptors reports) must equal what kvbench predicts.
One short MPI job runs the whole path: records carry the telemetry, and a planted corruption
or a planted wrong region order fails the data check.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvbench.cli import UsageError
from kvbench.model import get_dtype, resolve_model
from kvbench.p2p.layout import KVCache, KVSpec
from kvbench.p2p.transports.nixl import binding as nixl_import
from kvbench.p2p.transports.nixl import engine_shape as es
from tests.conftest import run_cases
from tests.p2p.helpers import Clock as _Clock
from tests.p2p.helpers import engine_args as _args

HAVE_NIXL = nixl_import.import_nixl()[0] is not None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable: pip install 'kvbench[nixl]'")
TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("model") / "config.json"
    p.write_text(json.dumps(TINY))
    return p


def cache(tiny, tokens: int, pages: str, table, block_size: int = 16) -> KVCache:
    spec = KVSpec(resolve_model(None, str(tiny)), get_dtype("bf16"), tokens, [], "paged",
                  block_size, pages=pages)
    data = KVCache(spec, "cpu", table=table)
    data.fill()
    return data


# ---------------------------------------------------------------------------
# regions, ids, merging (no NIXL)


@pytest.mark.parametrize("pages,regions", [("joint", 4), ("split", 8)])
def test_regions_and_messages_follow_the_engine(tiny, pages, regions):
    data = cache(tiny, 40, pages, list(range(3)))  # 40 tokens: 3 blocks of 16
    plan = es.plan_engine(data)
    assert len(plan.regions) == regions
    page = 16 * 2 * 64 * 2 * (2 if pages == "joint" else 1)  # bs x heads x dim x bytes (x K,V)
    assert {r.block_len for r in plan.regions} == {page}
    assert {r.stride for r in plan.regions} == {page}
    assert plan.n == regions * 3 and all(b.numel() == page for b in plan.buffers)
    ids = es.desc_ids(plan.regions, plan.blocks)
    pool = plan.regions[0].n_blocks
    assert ids[:3] == [0, 1, 2] and ids[3:6] == [pool, pool + 1, pool + 2]  # region-major
    rows = es.dlist_rows(plan.regions)
    for buf, i in zip(plan.buffers, ids, strict=True):  # every message is its dlist row
        assert rows[i] == (buf.data_ptr(), buf.numel())


def test_a_wrong_region_order_is_refused():
    es.check_region_major([(0, 5), (0, 6), (1, 5), (1, 6)])
    with pytest.raises(ValueError, match="not region-major"):
        es.check_region_major([(1, 5), (1, 6), (0, 5), (0, 6)])  # planted: regions swapped
    with pytest.raises(ValueError, match="not region-major"):
        es.check_region_major([(0, 5), (1, 5), (0, 6), (1, 6)])  # planted: block-major


def test_merged_count_contiguous_vs_scattered(tiny):
    src = es.plan_engine(cache(tiny, 64, "joint", [0, 1, 2, 3]))
    dst = es.plan_engine(cache(tiny, 64, "joint", [0, 1, 2, 3]))
    lr, rr = es.dlist_rows(dst.regions), es.dlist_rows(src.regions)
    li, ri = es.desc_ids(dst.regions, dst.blocks), es.desc_ids(src.regions, src.blocks)
    assert es.merged_count(lr, li, rr, ri) == 4  # one run per layer
    # one side scattered into two runs per layer: [0, 1] and [5, 6]
    src2 = es.plan_engine(cache(tiny, 64, "joint", [0, 1, 5, 6]))
    assert es.merged_count(lr, li, es.dlist_rows(src2.regions),
                           es.desc_ids(src2.regions, src2.blocks)) == 8


def test_block_tables(tmp_path):
    assert es.block_table("contiguous", 4, "prefill") == [0, 1, 2, 3]
    a, b = es.block_table("scattered", 50, "prefill"), es.block_table("scattered", 50, "decode")
    assert len(set(a)) == 50 and a != b and a != sorted(a)
    for n in (2, 3, 50):  # scattered means nothing merges, also for a 2-block request
        t = es.block_table("scattered", n, "prefill")
        assert all(y != x + 1 for x, y in zip(t, t[1:], strict=False)), t
    f = tmp_path / "ids.json"
    f.write_text(json.dumps({"prefill": [7, 3, 9], "decode": [0, 1, 2]}))
    assert es.block_table(f"file:{f}", 2, "prefill") == [7, 3]
    with pytest.raises(UsageError, match="needs 4"):
        es.block_table(f"file:{f}", 4, "decode")
    f.write_text(json.dumps({"prefill": [1, 1], "decode": [0]}))
    with pytest.raises(UsageError, match=r"block id 1 is listed twice \(at \[0\] and \[1\]\)"):
        es.block_table(f"file:{f}", 1, "prefill")
    assert es.block_ids_label(f"file:{f}").startswith("file#")


def test_poll_schedule(tmp_path):
    assert es.PollSchedule("busy").busy
    assert es.PollSchedule("fixed:1.5").next_ms() == 1.5
    f = tmp_path / "steps.json"
    f.write_text(json.dumps({"le_ms": [1, 5, 25], "count": [0, 10, 10]}))  # all in (1, 5]
    draws = [es.PollSchedule(f"draw:{f}", seed=s).next_ms() for s in range(50)]
    assert all(1 <= d <= 5 for d in draws) and len(set(draws)) > 1
    f.write_text(json.dumps([2.0, 3.0]))
    assert {es.PollSchedule(f"draw:{f}", seed=s).next_ms() for s in range(20)} == {2.0, 3.0}
    for bad in ("fixed:0", "fixed:x", "sometimes", f"draw:{tmp_path / 'none.json'}"):
        with pytest.raises(UsageError):
            es.PollSchedule(bad)


def _waiting_channel(monkeypatch, initiator: bool, poll: str, state: int, waits: str):
    from kvbench.p2p.transports.nixl import engine as ne

    clock = _Clock(monkeypatch)
    ch = object.__new__(ne.EngineChannel)  # only what idle() reads
    ch.poll, ch.initiator, ch.state, ch.next_poll = es.PollSchedule(poll), initiator, [state], 0.0
    ch.waits = es.Waits(waits)
    return ch, clock


@pytest.mark.parametrize("waits", ["yield", "sleep", "spin"])
def test_engine_waits_between_looks(monkeypatch, waits):
    """Between two looks the engine-shaped channel waits as the engine's threads do: a harness
    thread that spins without yielding keeps the core from NIXL's progress thread, and posts
    then lose a 4 ms scheduler tick (docs/nixl.md). Prefill looks once per engine step, decode
    waiting for a request pauses once per test, decode with a READ in flight waits in check()."""
    from kvbench.p2p.transports.nixl.channel import IDLE, PROC

    ch, clock = _waiting_channel(monkeypatch, False, "fixed:2", IDLE, waits)
    for _ in range(3):
        ch.idle(0)
    assert clock.t == pytest.approx(100.004, abs=3e-4)  # two steps of 2 ms: the first is due now
    kinds = {k for k, _ in clock.waited}
    assert kinds == {"yield": {"yield"}, "sleep": {"sleep"}, "spin": set()}[waits]
    if waits == "sleep":
        assert [k for k, _ in clock.waited] == ["sleep", "sleep"]
        assert all(v == pytest.approx(2e-3, abs=1e-4) for _, v in clock.waited)
    ch, clock = _waiting_channel(monkeypatch, True, "fixed:2", IDLE, waits)
    ch.idle(0)
    assert clock.waited == {"yield": [("yield", None)], "sleep": [("sleep", es.REQUEST_WAIT_S)],
                            "spin": []}[waits]
    ch, clock = _waiting_channel(monkeypatch, True, "fixed:2", PROC, waits)
    ch.idle(0)
    assert clock.waited == []


def test_idle_waits_sleep_and_busy_waits_spin(monkeypatch):
    """The handoff engine's own waits (start barrier, completion notice) get the transport's
    between_tests here; the records say which (test_engine_shaped_run_records_telemetry)."""
    from kvbench.p2p import harness

    calls = []

    class Req:
        def __init__(self):
            self.n = 0

        def Test(self):
            self.n += 1
            return self.n > 3

    monkeypatch.setattr(harness.time, "sleep", calls.append)
    harness.wait_request(Req(), harness.now() + 60, "x", pause=harness.nap)
    assert calls == [harness.IDLE_POLL_S] * 3
    calls.clear()
    harness.wait_request(Req(), harness.now() + 60, "x", pause=None)
    assert calls == []
    harness.wait_request(Req(), harness.now() + 60, "x", pause=lambda: calls.append("pause"))
    assert calls == ["pause"] * 3


@pytest.mark.parametrize("kw,needle", [
    ({"transport": "mpi"}, "--transport nixl"), ({"layout": "contiguous"}, "--layout paged"),
    ({"nixl_op": "write"}, "--nixl-op read"), ({"nixl_recreate": True}, "per_request=false"),
    ({"pattern": "layerwise"}, "sequential"), ({"bytes": "1M"}, "--sizes"),
    ({"nixl_poll": "fixed:-1"}, "period"),
])
def test_flags_that_cannot_run_the_engine_shape(kw, needle):
    assert es.usage_error(_args()) is None
    assert needle in es.usage_error(_args(**kw))


# ---------------------------------------------------------------------------
# NIXL's own merged count: two agents in this process


def _agent(nixl, name):
    return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False,
                                                        capture_telemetry=True))


def _rows(regions):
    return np.asarray([(a, n, 0) for a, n in es.dlist_rows(regions)], dtype=np.uint64)


def nixl_desc_count(tiny, prefill_table, decode_table, pages="joint") -> tuple[int, int, int]:
    """(NIXL's descCount, kvbench's predicted count, wrong elements after the READ)."""
    nixl = nixl_import.import_nixl()[0]
    tag = f"{time.monotonic_ns()}"
    pa, da = _agent(nixl, f"p-{tag}"), _agent(nixl, f"d-{tag}")
    src = cache(tiny, 64, pages, prefill_table)
    dst = cache(tiny, 64, pages, decode_table)
    dst.clear()
    sp, dp = es.plan_engine(src), es.plan_engine(dst)
    regs = [(pa, src), (da, dst)]
    handles = [a.register_memory([(d.backing.data_ptr(), d.nbytes, 0, "")], "DRAM") for a, d in regs]
    remote = da.add_remote_agent(pa.get_agent_metadata())
    local_dl = da.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(dp.regions), "DRAM")
    remote_dl = da.prep_xfer_dlist(remote, _rows(sp.regions), "DRAM")
    li, ri = es.desc_ids(dp.regions, dp.blocks), es.desc_ids(sp.regions, sp.blocks)
    h = da.make_prepped_xfer("READ", local_dl, li, remote_dl, ri, b"req-1:1")
    st = da.transfer(h)
    deadline = time.monotonic() + 60
    notes: list = []
    while st != "DONE" or not notes:  # prefill's polling progresses its side (one thread here)
        assert st in ("PROC", "DONE") and time.monotonic() < deadline, st
        notes += [m for ms in pa.get_new_notifs().values() for m in ms]
        st = da.check_xfer_state(h) if st != "DONE" else st
    assert notes == [b"req-1:1"]  # the notification rode on the READ
    got = int(da.get_xfer_telemetry(h).descCount)
    want = es.merged_count(es.dlist_rows(dp.regions), li, es.dlist_rows(sp.regions), ri)
    wrong = dst.count_wrong()
    da.release_xfer_handle(h)
    for dl in (local_dl, remote_dl):
        da.release_dlist_handle(dl)
    da.remove_remote_agent(remote)
    for (a, _d), reg in zip(regs, handles, strict=True):
        a.deregister_memory(reg)
    return got, want, wrong


@needs_nixl
@pytest.mark.parametrize("case", ["contiguous", "scattered", "split-scattered", "partly"])
def test_predicted_descriptor_count_is_nixls(tiny, case):
    """Contiguous ids merge to one descriptor per region; scattered ones hardly merge; the
    count is whatever NIXL reports, and the READ moved every element."""
    tables = {"contiguous": ([0, 1, 2, 3], [0, 1, 2, 3], "joint"),
              "scattered": ([4, 0, 2, 3], [1, 3, 0, 2], "joint"),
              "split-scattered": ([4, 0, 2, 3], [1, 3, 0, 2], "split"),
              "partly": ([0, 1, 2, 3], [0, 1, 4, 3], "joint")}[case]
    got, want, wrong = nixl_desc_count(tiny, *tables)
    assert got == want, (case, got, want)
    assert wrong == 0
    if case == "contiguous":
        assert got == 4  # one region per layer, every block run merged
    if case == "split-scattered":
        assert got > 8


# ---------------------------------------------------------------------------
# the whole path under MPI: records, telemetry, planted faults

ENGINE = ("--transport nixl --nixl-engine-profile vllm-0.32:threads=0 --layout paged "
          "--granularity block --block-size 16 --sizes 64 --warmup 1 --iters 3 --min-iters 3 "
          "--quiet --no-nixl-progress-thread")
RUNS = {"telemetry": "--block-ids scattered",
        "busy": "--nixl-engine-profile :poll=busy,waits=spin",
        "corrupt": "--debug-corrupt-elements 5",
        "reversed": "--debug-region-order reversed",
        "paced": "--nixl-engine-profile :waits=engine,spin_window_ms=2,gaps=exp,gap_ms=5,"
                 "gap_seed=3,busy_ms=1",
        "notif": "--nixl-engine-profile announce-nixl"}


@pytest.fixture(scope="module")
def engine_job(tiny, tmp_path_factory):
    """One MPI job (torch + NIXL start once): the telemetry run, then two planted faults."""
    tmp = tmp_path_factory.mktemp("engine")
    lines = [f"{ENGINE} --model-config {tiny} {flags} --out {tmp / name}" for name, flags in RUNS.items()]
    res, done = run_cases(2, lines, tmp, timeout=300)
    rcs = {name: done[str(tmp / name)][0] for name in RUNS if str(tmp / name) in done}
    recs = {name: [json.loads(x) for f in (tmp / name).glob("*.jsonl") for x in f.open()]
            for name in RUNS}
    return rcs, recs, res


@pytest.mark.mpi
@needs_nixl
def test_engine_shaped_run_records_telemetry(engine_job):
    rcs, recs, res = engine_job
    assert rcs.get("telemetry") == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (rec,) = recs["telemetry"]
    assert rec["wrong"] == 0
    opts = rec["spec"]["transport_options"]
    assert (opts["shape"], opts["per_request"], opts["poll"], opts["waits"]) == (
        "engine", True, "fixed:1", "sleep")
    assert rec["spec"]["cut"] == {"kv": "joint", "blocks": "scattered", "tp": "1:1"}
    assert rcs.get("busy") == 0
    (busy,) = recs["busy"]  # polled busily and spinning: the link harness's way, in the spec
    assert busy["wrong"] == 0 and busy["spec"]["transport_options"]["waits"] == "spin"
    assert opts["announce"] == "mpi"  # the request reaches decode outside NIXL, as vLLM's does
    assert rcs.get("notif") == 0
    (notif,) = recs["notif"]  # the link shape's NIXL notification instead: a spec of its own
    assert notif["wrong"] == 0 and notif["spec"]["transport_options"]["announce"] == "nixl"
    tel = rec["nixl_telemetry"]
    n = rec["n_samples"]
    assert all(len(tel[k]) == n for k in ("post_ms", "xfer_ms", "desc_count", "bytes"))
    assert tel["bytes"] == [rec["bytes"]] * n  # NIXL moved exactly the request's pages
    assert rec["descriptors_merged"] == rec["descriptors_merged_expected"] == 16  # 4 layers x 4 blocks
    assert rec["descriptors"] == 16  # scattered ids: NIXL joined nothing
    assert all(x >= p > 0 for x, p in zip(tel["xfer_ms"], tel["post_ms"], strict=True))
    # what the xfer remainder is made of: looks that saw the READ in flight, done in the post
    assert len(tel["looks"]) == len(tel["post_done"]) == n
    assert set(tel["post_done"]) <= {0, 1} and all(k >= 0 for k in tel["looks"])
    assert all(k == 0 for k, d in zip(tel["looks"], tel["post_done"], strict=True) if d)
    # per request: a handle made and released every handoff, timed beside the post
    per = 1 + len(rec["warmup_ms"]) + rec["iters"] + 1
    for key in ("nixl_make_xfer_ms", "nixl_post_ms", "nixl_release_ms", "nixl_transfer_ms"):
        assert len(rec["breakdown_ms"][key]) == per, key


@pytest.mark.mpi
@needs_nixl
def test_paced_run_records_its_gaps_and_waits(engine_job):
    """waits=engine with drawn gaps: the spec names the mode, window, distribution,
    seed and work (records of different pacing never merge), and the record holds each timed
    handoff's drawn gap (the seed's own draws, in order) and decode's idle time at its post."""
    rcs, recs, res = engine_job
    assert rcs.get("paced") == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (rec,) = recs["paced"]
    opts = rec["spec"]["transport_options"]
    assert (opts["waits"], opts["spin_window_ms"], opts["gap_ms"], opts["gaps"], opts["gap_seed"],
            opts["busy_ms"]) == ("engine", 2.0, 5.0, "exp", 3, 1.0)
    (plain,) = recs["telemetry"]
    assert "gaps" not in plain["spec"]["transport_options"] and rec["spec_id"] != plain["spec_id"]
    tel, n, warm = rec["nixl_telemetry"], rec["n_samples"], len(rec["warmup_ms"])
    g = es.Gaps(5.0, "exp", 3)
    drawn = [g.next_s() * 1e3 for _ in range(1 + warm + n)][1 + warm:]  # cold, warm-ups first
    assert tel["gap_ms"] == pytest.approx(drawn)
    assert len(tel["idle_ms"]) == n and all(i >= 0 for i in tel["idle_ms"])
    # a gap longer than the work leaves decode idle for about the rest before it posts
    assert all(i >= gp - 1.0 - 0.5 for i, gp in zip(tel["idle_ms"], tel["gap_ms"], strict=True))


@pytest.mark.mpi
@needs_nixl
@pytest.mark.parametrize("fault", ["corrupt", "reversed"])
def test_planted_faults_fail_the_data_check(engine_job, fault):
    rcs, recs, res = engine_job
    assert rcs.get(fault) == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (rec,) = recs[fault]
    assert rec["wrong"] > 0


def test_progress_delay_reaches_the_binding_for_one_call():
    """The lab's vLLM runs NIXL's progress thread with a 1000 us delay (kvbench.lab.venv.connector);
    the engine-shaped run sets it through the same seam, for its own agent only."""
    import sys
    import types

    from kvbench.p2p.transports.nixl.binding import agent_with_progress_delay

    seen = []
    api = types.ModuleType("fake_nixl_api")
    api.nixlBind = types.SimpleNamespace(nixlAgent=lambda name, cfg: seen.append(cfg.pthrDelay))

    def nixl_agent(name, cfg):
        cfg.pthrDelay = 0  # what nixl_cu12/_api.py does
        return api.nixlBind.nixlAgent(name, cfg)

    nixl_agent.__module__ = api.__name__
    api.nixl_agent = nixl_agent
    sys.modules[api.__name__] = api
    try:
        agent_with_progress_delay(api, "a", types.SimpleNamespace(), 1000)
        agent_with_progress_delay(api, "b", types.SimpleNamespace(), 0)
        nixl_agent("c", types.SimpleNamespace())
    finally:
        del sys.modules[api.__name__]
    assert seen == [1000, 0, 0]


def test_plans_name_the_shape_they_were_fitted_on():
    """'link' and 'engine-shaped' are never confused downstream: plan rows and exports say which."""
    from kvbench.plan.floors import Link

    assert Link("x", "fit", 1.0, 0.1, group={"transport_options.shape": "engine"}).shape == "engine"
    assert Link("x", "fit", 1.0, 0.1, group={"transport": "nixl"}).shape == "link"
    assert Link("x", "user", 1.0, 0.1).shape is None
