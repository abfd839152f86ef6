"""`kvbench lab agree`'s arithmetic without a lab: histogram deltas from two /metrics readings,
step-time draws, and the agreement table from a synthetic document."""

from __future__ import annotations

import json

import pytest

from kvbench.lab.agree import engine as ae
from kvbench.lab.agree import report as ar
from kvbench.lab.agree.p2p import FEATURES, factorial_cells

INF = float("inf")


def reading(post_sum: float, n: int, buckets: dict) -> dict:
    return {"post": (buckets, post_sum, n), "xfer": (buckets, post_sum * 2, n)}


def test_delta_gives_exact_means_and_bucket_fractions():
    before = reading(1.0, 10, {0.001: 5, 0.005: 10, INF: 10})
    after = reading(1.0 + 0.012, 14, {0.001: 6, 0.005: 12, INF: 14})  # 4 more: 1, 1, 2 beyond
    d = ae.delta(before, after)
    assert d["post"]["count"] == 4
    assert d["post"]["mean"] == pytest.approx(3.0)  # 12 ms over 4 transfers, exact
    assert d["xfer"]["mean"] == pytest.approx(6.0)
    assert d["post"]["buckets"] == [[1.0, 0.25], [5.0, 0.25], ["+Inf", 0.5]]
    assert ae.delta(None, after) == {}
    assert ae.delta(after, after)["post"]["count"] == 0


def test_step_draws_keep_finite_buckets_as_cumulative_counts():
    itl = {"count": 10, "buckets": [[5.0, 0.2], [10.0, 0.7], ["+Inf", 0.1]]}
    assert ae.step_draws(itl)["le_ms"] == [5.0, 10.0]
    assert ae.step_draws(itl)["count"] == [2, 9]
    assert ae.step_draws({"count": 0, "buckets": []}) is None


def _cell_post(off: tuple) -> float:
    """A known model over the factorial: +-1 coding, x = +1 when the feature is on."""
    x = {f: -1 if f in off else 1 for f in FEATURES}
    return 5 + 0.5 * x["threads"] + 1.0 * x["progress-thread"] + 0.25 * x["threads"] * x["progress-thread"]


def _doc(engine_post: list[float], pred_post: list[float]) -> dict:
    runs = [{"status": "done", "metrics": {
        "post": {"count": 5, "mean": p, "buckets": [[1.0, 1.0]]},
        "xfer": {"count": 5, "mean": 2 * p, "buckets": [[5.0, 1.0]]},
        "bytes": {"count": 5, "mean": 524288.0, "buckets": []}}} for p in engine_post]
    cells = factorial_cells()
    reps = []
    for p in pred_post:
        got = {name: {"post_mean_ms": _cell_post(off),
                      "xfer_mean_ms": 2 * _cell_post(off)} for name, off in cells.items()}
        got["engine"] = {"post_mean_ms": p, "xfer_mean_ms": 2 * p}  # the cell with all on
        got["kv-split"] = {"post_mean_ms": p - 1, "xfer_mean_ms": 2 * p}
        got["unpinned"] = {"post_mean_ms": p - 0.5, "xfer_mean_ms": 2 * p}
        reps.append({"configs": got})
    names = {**{n: "" for n in cells}, "kv-split": "--kv-pages split", "unpinned": ""}
    return {"rates_rps": [1.0], "engine": {"1": runs}, "plain_fit": None,
            "p2p": {"repeats": reps, "configs": names}}


def test_agreement_ratios_targets_and_one_step_costs():
    a = ar.analyse(_doc([2.0, 2.2], [2.0, 2.0]))
    row = a["rates"][0]
    assert row["engine_shaped"]["ratio"]["post"]["mean"] == pytest.approx(1.05)
    assert a["target_at_lowest_rate"]["post"]["met"] is True
    bad = ar.analyse(_doc([3.0, 3.0], [2.0, 2.0]))  # planted: the engine pays 1.5x
    assert bad["target_at_lowest_rate"]["post"]["met"] is False
    assert bad["target_at_lowest_rate"]["xfer"]["met"] is False
    cost = {c["config"]: c for c in a["factor_costs"]}
    assert cost["kv-split"]["post_feature_cost_ms"] == pytest.approx(1.0)
    assert cost["unpinned"]["post_feature_cost_ms"] == pytest.approx(0.5)
    assert "not one core each" in cost["unpinned"]["what"]
    assert "off:threads+progress-thread" not in cost  # two steps away: in the effects instead
    assert row["plain"]["predicted_mean_ms"] is None
    doc = _doc([2.0, 2.2], [2.0, 2.0])
    doc.update(agreement=a, command=["kvbench", "lab", "agree"], finished="now", host="h",
               cpu_count=2, loadavg_end=(1.0, 1.0, 1.0))
    doc["p2p"].update(tokens=256, tokens_why="x", block_size=128, cores=[0, 1], ucx_env={})
    md = ar.markdown(doc)
    assert "| 1 | 2/2 |" in md and "kv-split" in md and "main effects of the 2^4 factorial" in md
    assert "1.05 (no interval)" in md and "2 engine run(s): an interval needs at least 3" in md


def test_the_target_is_judged_on_the_paced_prediction_when_there_is_one():
    doc = _doc([2.0, 2.2], [4.0, 4.0])  # back to back: engine-shaped predicts 2x the engine
    assert ar.analyse(doc)["target_at_lowest_rate"]["post"]["prediction"] == "engine_shaped"
    for rep in doc["p2p"]["repeats"]:
        rep["configs"]["paced@1"] = {"post_mean_ms": 2.0, "xfer_mean_ms": 4.0}
    doc["p2p"]["configs"]["paced@1"] = "--nixl-engine-profile :gap_ms=1000"
    t = ar.analyse(doc)["target_at_lowest_rate"]
    assert t["post"]["prediction"] == "paced" and t["post"]["ratio"] == pytest.approx(1.05)
    assert t["post"]["met"] and t["xfer"]["met"]


def test_the_factorial_recovers_a_known_model():
    doc = _doc([2.0, 2.0, 2.0], [5 + 0.5 + 1.0 + 0.25] * 3)  # engine = the all-on cell
    fx = ar.feature_effects(doc)
    main = {e["feature"]: e for e in fx["main"]}
    assert main["threads"]["post"]["mean"] == pytest.approx(1.0)  # 2 x 0.5: on minus off
    assert main["progress-thread"]["post"]["mean"] == pytest.approx(2.0)
    assert main["per-request"]["post"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert main["threads"]["post"]["n"] == 3
    inter = {tuple(e["features"]): e for e in fx["interactions"]}
    assert inter[("threads", "progress-thread")]["post"]["mean"] == pytest.approx(0.25)
    assert inter[("threads", "per-request")]["post"]["mean"] == pytest.approx(0.0, abs=1e-12)
    del doc["p2p"]["configs"]["off:threads"]  # a run without the whole factorial: no effects
    assert ar.feature_effects(doc) == {"main": [], "interactions": []}


def test_engine_shaped_prediction_interpolates_and_never_extrapolates():
    from kvbench.lab.load.handoff import engine_shaped_at

    pts = [(1000, 0.1, 2.0), (3000, 0.3, 4.0)]
    assert engine_shaped_at(pts, 2000) == {"post_ms": pytest.approx(0.2), "xfer_ms": pytest.approx(3.0)}
    assert engine_shaped_at(pts, 1000)["xfer_ms"] == 2.0
    assert engine_shaped_at(pts, 3001) is None and engine_shaped_at(pts, 10) is None


class _FakeAgent:
    """Stands in for nixl_agent: a READ is PROC for `late` looks, then DONE."""

    def __init__(self, late: dict):
        self.late, self.released = dict(late), []

    def transfer(self, handle):
        return "DONE" if self.late[handle] == 0 else "PROC"

    def check_xfer_state(self, handle):
        if self.late[handle] > 0:
            self.late[handle] -= 1
            return "PROC"
        return "DONE"

    def get_xfer_telemetry(self, handle):
        from types import SimpleNamespace

        return SimpleNamespace(postDuration=150, xferDuration=4150 if handle == "b" else 160,
                               totalBytes=524288, descCount=4)

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def send_notif(self, agent, notif_msg=b""):
        return None


def test_the_engine_trace_records_each_transfer_as_the_engine_sees_it(tmp_path, monkeypatch):
    from kvbench.lab.venv import nixltrace

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(nixltrace.ENV, str(path))
    agent = _FakeAgent({"a": 0, "b": 1})
    worker = type("W", (), {"nixl_wrapper": agent})()
    assert nixltrace.install(worker) is not None
    w = worker.nixl_wrapper
    for h in ("a", "b"):  # the engine's order: post, the same step's look, later looks
        w.transfer(h)
        if h == "b":
            w.send_notif("peer", notif_msg=b"HB:x")  # a heartbeat between post and look
        while w.check_xfer_state(h) != "DONE":
            pass
        w.get_xfer_telemetry(h)
        w.release_xfer_handle(h)
    assert agent.released == ["a", "b"]  # the real calls still happen
    recs = ae.read_trace(path)
    assert [r["post_state"] for r in recs] == ["DONE", "PROC"]
    assert [len(r["looks"]) for r in recs] == [1, 2] and recs[1]["looks"][0][1] == "PROC"
    tr = ae.trace_transfers(recs)
    assert tr["late"] == [0, 1] and tr["post_done"] == [1, 0] and tr["notif_between"] == [0, 1]
    assert tr["xfer_ms"] == [0.16, 4.15]
    monkeypatch.delenv(nixltrace.ENV)
    assert nixltrace.install(type("W", (), {"nixl_wrapper": _FakeAgent({})})()) is None
    path.write_text(path.read_text() + '{"torn')  # a line the engine is still writing
    assert len(ae.read_trace(path)) == 2 and ae.read_trace(tmp_path / "none") == []


def _transfers(post: list, xfer: list, late: list, done: list) -> dict:
    return {"post_ms": post, "xfer_ms": xfer, "late": late, "post_done": done}


def test_the_remainder_is_the_in_flight_share_times_the_wait():
    from kvbench.lab.agree.remainder import decompose, remainder

    # planted: 10 transfers a run, 2 of them late by 10 ms, on fast posts that were not done
    eng = _transfers([0.2] * 5 + [4.0] * 5, [0.25, 0.25, 0.25, 10.2, 10.2] + [4.0] * 5,
                     [0, 0, 0, 1, 1] + [0] * 5, [1, 1, 1, 0, 0] + [1] * 5)
    kvb = _transfers([0.2] * 5 + [4.0] * 5, [0.25] * 5 + [4.0] * 5, [0] * 10, [1] * 10)
    d = decompose([eng, eng])
    assert d["n"] == 20 and d["in_flight_share"] == pytest.approx(0.2)
    assert d["late_wait_mean_ms"] == pytest.approx(10.0)
    assert d["in_flight_term_ms"] == pytest.approx(2.0)
    assert d["remainder_ms"] == pytest.approx(2.0 + 3 * 0.05 / 10)  # + the on-time look gaps
    assert d["fast_post_share"] == pytest.approx(0.5) and d["fast_posts_not_done_share"] == pytest.approx(0.4)
    assert decompose([None]) is None
    doc = {"engine": {"1": [{"transfers": eng}]}, "engine_warmup": {"transfers": _transfers(
        [0.3, 0.2], [30.0, 2.0], [1, 0], [0, 1])},
        "p2p": {"repeats": [{"configs": {"paced@1": {"transfers": kvb}}}]}}
    r = remainder(doc, "1", "paced@1")
    assert r["remainder_gap_ms"] == pytest.approx(2.015 - 0.025)
    assert r["cold"]["first_xfer_ms"] == 30.0 and r["cold"]["then_xfer_ms"] == [2.0]
    # kvbench's post with the engine's own remainder gives the engine's xfer back
    assert r["xfer_ratio_with_engine_in_flight_term"] == pytest.approx(1.0)


def test_posts_are_split_by_what_the_worker_did_before_them(tmp_path):
    import json

    from kvbench.lab.agree.remainder import posts_by_worker_state

    events = tmp_path / "events.jsonl"
    rows = [("a", "decode_sent", 10.00), ("a", "decode_done", 10.40),
            ("b", "decode_sent", 10.60), ("b", "decode_done", 11.00),
            ("c", "decode_sent", 13.00), ("c", "decode_done", 13.30)]
    events.write_text("".join(json.dumps({"id": i, "step": s, "t": t}) + "\n" for i, s, t in rows))
    # a's own post (nothing before), b's 0.21 s after a finished, one while b decodes, c's
    # 2 s after b finished
    idle = ae.decode_idle([10.01, 10.61, 10.80, 13.01], events)
    assert idle[0] is None and idle[1] == pytest.approx(0.21) and idle[2] == 0.0
    assert idle[3] == pytest.approx(2.01)
    assert ae.decode_idle([1.0], tmp_path / "missing.jsonl") == [None]
    ws = posts_by_worker_state([{"post_ms": [9.0, 4.0, 2.0, 0.2], "decode_idle_s": idle}])
    assert ws["within_busy_loop"] == {"n": 2, "post_mean_ms": 3.0, "fast_share": 0.0}
    assert ws["after_idle"]["n"] == 1 and ws["after_idle"]["fast_share"] == 1.0


def test_the_target_says_whether_the_xfer_remainder_is_reproduced():
    doc = _doc([2.0, 2.2], [2.0, 2.0])
    tr = _transfers([2.0] * 4, [2.1] * 4, [0] * 4, [1] * 4)  # xfer - post = 0.1 ms
    for run in doc["engine"]["1"]:
        run["transfers"] = tr
    for rep in doc["p2p"]["repeats"]:
        rep["configs"]["paced@1"] = {"post_mean_ms": 1.6, "xfer_mean_ms": 1.7, "transfers": tr}
    doc["p2p"]["configs"]["paced@1"] = ""
    t = ar.analyse(doc)["target_at_lowest_rate"]["xfer"]
    assert t["remainder_only_ratio"] == pytest.approx(1.0) and t["remainder_reproduced"]
    late = _transfers([2.0] * 4, [2.1, 2.1, 2.1, 12.1], [0, 0, 0, 1], [1, 1, 1, 0])  # planted
    for run in doc["engine"]["1"]:
        run["transfers"] = late
    t = ar.analyse(doc)["target_at_lowest_rate"]["xfer"]
    assert t["remainder_only_ratio"] > 1.15 and not t["remainder_reproduced"]


def test_the_target_is_judged_on_the_replica_when_there_is_one():
    doc = _doc([2.0, 2.2], [4.0, 4.0])
    for rep in doc["p2p"]["repeats"]:
        rep["configs"]["paced@1"] = {"post_mean_ms": 1.0, "xfer_mean_ms": 2.0}
        rep["configs"]["replica@1"] = {"post_mean_ms": 2.0, "xfer_mean_ms": 4.2}
    doc["p2p"]["configs"] |= {"paced@1": "--nixl-engine-profile :gap_ms=1000",
                                  "replica@1": "--nixl-engine-profile replica"}
    a = ar.analyse(doc)
    t = a["target_at_lowest_rate"]
    assert t["post"]["prediction"] == "replica" and t["post"]["ratio"] == pytest.approx(1.05)
    assert a["rates"][0]["judged_on"] == "replica" and a["rates"][0]["remainder"]["config"] == "replica@1"
    del doc["p2p"]["repeats"][0]["configs"]["replica@1"], doc["p2p"]["repeats"][1]["configs"]["replica@1"]
    assert ar.analyse(doc)["target_at_lowest_rate"]["post"]["prediction"] == "paced"


def test_look_intervals_come_from_the_trace():
    recs = [{"looks": [[200.0, "PROC"], [2200.0, "PROC"], [4700.0, "DONE"]]},
            {"looks": [[150.0, "DONE"]]}, {}]
    assert ae.look_intervals(recs) == [2.0, 2.5]


def test_the_replica_takes_its_inputs_from_the_engines_runs(tmp_path):
    from kvbench.lab.agree.main import MIN_LOOKS, replica_inputs
    from kvbench.lab.agree.p2p import configs, replica_flags, seeded

    def run(itl, looks):
        return {"metrics": {"itl": {"mean": itl}}, "look_intervals_ms": looks}

    engine = {"1": [run(3.0, [2.0] * 4), run(5.0, [2.0] * 4)],  # 8 looks: too few alone
              "4": [run(6.0, [4.0] * MIN_LOOKS)], "8": [run(8.0, [])]}
    draws = {"8": tmp_path / "steps-8rps.json"}
    got, why = replica_inputs(engine, draws, tmp_path, output_len=32)
    assert got["1"][1] == pytest.approx(31 * 4.0)  # (output_len - 1) x the mean ITL
    assert "pooled" in why["1"]["poll"]  # 8 of its own: all rates' looks instead
    assert len(json.loads(got["1"][0].read_text())) == 8 + MIN_LOOKS
    assert "pooled" not in why["4"]["poll"] and got["4"][1] == pytest.approx(31 * 6.0)
    engine["4"][0]["look_intervals_ms"] = []
    got, why = replica_inputs(engine, draws, tmp_path, output_len=32)
    assert got["8"][0] == draws["8"] and "inter-token" in why["8"]["poll"]
    assert "4" not in got  # neither traced looks nor ITL draws: no replica at that rate
    flags = replica_flags(4.0, tmp_path / "l.json", 186.0)
    assert "--nixl-engine-profile replica:gap_ms=250,busy_ms=186.000,poll=draw:" in flags
    cfgs = configs({}, False, {"4": (tmp_path / "l.json", 186.0)})
    s1, s2 = seeded(cfgs, 1), seeded(cfgs, 2)
    assert s1["replica@4"].endswith(":gap_seed=1") and s2["replica@4"].endswith(":gap_seed=2")
    assert s1["engine"] == cfgs["engine"] == ""  # fixed configurations are not reseeded


def test_kvbench_posts_are_split_by_decodes_idle_time_as_the_engines_are():
    from kvbench.lab.agree.p2p import summary
    from kvbench.lab.agree.remainder import posts_by_worker_state

    tel = {"post_ms": [4.0, 2.0, 0.2, 0.3], "xfer_ms": [4.0, 2.0, 0.2, 0.3],
           "post_done": [1, 1, 1, 1], "looks": [0, 0, 0, 0],
           "idle_ms": [0.5, 400.0, 1500.0, 2500.0], "gap_ms": [50.0, 500.0, 1600.0, 2600.0]}
    rec = {"nixl_post_mean_ms": 1.625, "nixl_xfer_mean_ms": 1.625, "p50_ms": 1.0, "n_samples": 4,
           "bytes": 1, "nixl_desc_count": 4, "spec_id": "x", "nixl_telemetry": tel,
           "spec": {"transport_options": {"waits": "engine"}}}
    tr = summary(rec)["transfers"]
    assert tr["decode_idle_s"] == [0.0005, 0.4, 1.5, 2.5] and tr["gap_ms"] == tel["gap_ms"]
    ws = posts_by_worker_state([tr])
    assert ws["within_busy_loop"] == {"n": 2, "post_mean_ms": 3.0, "fast_share": 0.0}
    assert ws["decoding"] == {"n": 1, "post_mean_ms": 4.0, "fast_share": 0.0}
    assert ws["after_idle"]["n"] == 2 and ws["after_idle"]["fast_share"] == 1.0
