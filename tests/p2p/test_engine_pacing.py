"""The engine shape's pacing: how its threads wait (engine profile key waits=engine), the gaps
between requests (gaps=exp) and decode's work inside them (busy_ms), on a fake clock.

vLLM 0.32's worker yield-spins on its step queue for 1 s after its last step and sleeps after
that (shm_broadcast.py:195-208); which of the two a post comes from decides how often it loses
the core to NIXL's progress thread. Each check below is also run against a planted no-op (a
mode that only sleeps, gaps that are all the mean, work that is skipped) and must fail it.
"""

from __future__ import annotations

import statistics
from argparse import Namespace

import pytest

from kvbench.p2p.transports.nixl import engine_shape as es
from tests.p2p.helpers import Clock as _Clock


def check_engine_waits(waits_cls) -> None:
    """Inside the window after the last work the thread yields, after it it sleeps: a wait
    that crosses the window's end yields up to it and sleeps the rest in one call."""
    w = waits_cls("engine", 50.0)  # a 50 ms window
    w.worked()
    t0 = w.last_work
    clock = w._clock
    w.until(t0 + 0.2)
    kinds = [k for k, _ in clock.waited]
    assert kinds and set(kinds[:-1]) == {"yield"}, "yields inside the window"
    assert len(kinds) > 100, "a spin of 50 ms is many yields"
    assert kinds[-1] == "sleep" and clock.waited[-1][1] == pytest.approx(0.15, abs=2e-3)
    assert clock.t == pytest.approx(t0 + 0.2, abs=1e-3)
    clock.waited.clear()
    w.pause()  # past the window: a nap
    assert clock.waited == [("sleep", es.REQUEST_WAIT_S)]
    w.worked()
    clock.waited.clear()
    w.pause()  # just worked: a yield
    assert clock.waited == [("yield", None)]


def _waits_on(clock, base=es.Waits):
    class W(base):
        _clock = clock

    return W


def test_engine_waits_yield_in_the_window_then_sleep(monkeypatch):
    check_engine_waits(_waits_on(_Clock(monkeypatch)))


def test_a_planted_sleeping_engine_wait_fails_the_check(monkeypatch):
    class OnlySleeps(es.Waits):
        def _now(self):
            return "sleep"

        def until(self, t):
            es.time.sleep(max(0.0, t - es.time.perf_counter()))

    with pytest.raises(AssertionError):
        check_engine_waits(_waits_on(_Clock(monkeypatch), OnlySleeps))


def test_the_other_waits_keep_their_behaviour(monkeypatch):
    clock = _Clock(monkeypatch)
    for mode, kinds in (("sleep", {"sleep"}), ("yield", {"yield"}), ("spin", set())):
        clock.waited.clear()
        es.Waits(mode).until(clock.t + 0.01)
        assert {k for k, _ in clock.waited} == kinds, mode
    assert es.Waits("sleep").label() == {"nixl_waits": "sleep"}
    assert es.Waits("engine", 250).label() == {"nixl_waits": "engine", "nixl_spin_window_ms": 250.0}
    with pytest.raises(es.UsageError):
        es.Waits("nap")


def check_exponential_gaps(gaps_cls) -> None:
    """Drawn gaps have the mean asked for and the spread of an exponential (sd = mean), are
    the same on every rank (one seed) and differ between seeds."""
    g = gaps_cls(250.0, "exp", 7)
    draws = [g.next_s() for _ in range(4000)]
    mean = statistics.fmean(draws)
    assert mean == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(draws) / mean == pytest.approx(1.0, abs=0.08)
    assert min(draws) < 0.01 < 0.75 < max(draws)
    other_rank = gaps_cls(250.0, "exp", 7)
    assert [other_rank.next_s() for _ in range(4000)] == draws
    assert gaps_cls(250.0, "exp", 8).next_s() != draws[0]


def test_gaps_are_drawn_as_poisson_arrivals_space_them():
    check_exponential_gaps(es.Gaps)
    fixed = es.Gaps(1000.0)
    assert [fixed.next_s() for _ in range(3)] == [1.0] * 3
    assert fixed.label() == {"nixl_gap_ms": 1000.0}  # old records keep their spec
    assert es.Gaps(1000.0, "exp", 3).label() == {"nixl_gap_ms": 1000.0, "nixl_gaps": "exp",
                                                 "nixl_gap_seed": 3}
    assert es.Gaps(0.0, "exp").next_s() == 0.0 and es.Gaps(0.0).label() == {}


def test_planted_constant_gaps_fail_the_check():
    class Constant(es.Gaps):
        def next_s(self):
            return self.mean_s

    with pytest.raises(AssertionError):
        check_exponential_gaps(Constant)


def _decode_channel(monkeypatch, initiator: bool, gap_ms: float, busy_ms: float, window_ms: float,
                    mode: str = "engine"):
    from kvbench.p2p.transports.nixl import engine as ne

    clock = _Clock(monkeypatch)
    ch = object.__new__(ne.EngineChannel)  # only what idle_before() reads
    ch.initiator, ch.gap_ms = initiator, 0.0
    ch.waits = es.Waits(mode, window_ms)
    ch.t = Namespace(gaps=es.Gaps(gap_ms), busy_s=busy_ms / 1e3)
    return ch, clock


def check_gap_is_work_then_idle(ch, clock) -> None:
    """A 500 ms gap with 100 ms of decode work and a 200 ms window: the work spins (no yield,
    no sleep), the window after it yields, the rest is one sleep; the gap is recorded."""
    t0 = clock.t
    ch.idle_before()
    assert ch.gap_ms == 500.0
    assert clock.t == pytest.approx(t0 + 0.5, abs=2e-3)
    yields = [k for k, _ in clock.waited if k == "yield"]
    assert len(yields) == pytest.approx(0.2 / 1.1e-4, rel=0.1), "yield-spins for the window"
    assert clock.waited[-1][0] == "sleep" and clock.waited[-1][1] == pytest.approx(0.2, abs=2e-3)
    assert ch.waits.idle_s() == pytest.approx(0.4, abs=2e-3), "the work ended 100 ms in"


def test_decode_works_then_yields_then_sleeps_in_the_gap(monkeypatch):
    check_gap_is_work_then_idle(*_decode_channel(monkeypatch, True, 500, 100, 200))


def test_a_planted_gap_without_the_work_fails_the_check(monkeypatch):
    ch, clock = _decode_channel(monkeypatch, True, 500, 100, 200)
    ch.t.busy_s = 0.0  # the work skipped: the window starts from the last handoff instead
    with pytest.raises(AssertionError):
        check_gap_is_work_then_idle(ch, clock)


def test_a_gap_shorter_than_the_work_leaves_no_idle(monkeypatch):
    ch, clock = _decode_channel(monkeypatch, True, 50, 100, 200)
    ch.idle_before()
    assert clock.waited == [] and ch.waits.idle_s() < 1e-3  # the post follows the work


def test_prefill_idles_the_whole_gap_and_other_waits_sleep_it(monkeypatch):
    ch, clock = _decode_channel(monkeypatch, False, 500, 100, 200)
    ch.idle_before()
    assert clock.waited[-1] == ("sleep", pytest.approx(0.3, abs=2e-3))  # 200 ms yields, then sleep
    ch, clock = _decode_channel(monkeypatch, True, 500, 0, 200, mode="sleep")
    ch.idle_before()
    assert clock.waited == [("sleep", pytest.approx(0.5, abs=1e-3))]


def _args(**kw) -> Namespace:
    from tests.p2p.helpers import engine_args

    return engine_args(**kw)


@pytest.mark.parametrize("kw,needle", [
    ({"nixl_spin_window_ms": 10.0, "nixl_profile_given": ["spin_window_ms"]}, "waits=engine"),
    ({"nixl_gaps": "exp"}, "gap_ms"),
    ({"nixl_busy_ms": 50.0}, "gap_ms"),
])
def test_pacing_flags_that_do_not_go_together(kw, needle):
    why = es.usage_error(_args(**kw))
    assert why is not None and needle in why


@pytest.mark.parametrize("argv", [
    ["--nixl-gaps", "exp", "--nixl-gap-ms", "100"], ["--nixl-waits", "engine"],
    ["--nixl-announce", "mpi"],
])
def test_pacing_flags_outside_an_engine_profile_are_refused(argv, capsys):
    """Without the engine shape the pacing knobs meant nothing (the link shape refused them);
    now they exist only in an engine profile, and the old flags say so in one line."""
    from kvbench.p2p.args import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser(0).parse_args(["--transport", "nixl", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--nixl-engine-profile" in err


def test_pacing_flags_that_do():
    assert es.usage_error(_args(nixl_waits="engine", nixl_spin_window_ms=500.0, nixl_gaps="exp",
                                nixl_gap_ms=1000.0, nixl_busy_ms=100.0)) is None


class _FakeXc:
    """The MPI exchange between the two sides of one channel (a shared mailbox)."""

    def __init__(self, box):
        self.box = box

    def send(self, obj, tag):
        self.box.append((tag, obj))

    def try_recv(self, tag):
        for i, (t, obj) in enumerate(self.box):
            if t == tag:
                del self.box[i]
                return True, obj
        return False, None


def _side(initiator: bool, announce: str, box: list, calls: list):
    from collections import deque

    from kvbench.p2p.transports.nixl import engine as ne

    ch = object.__new__(ne.EngineChannel)  # what pump() and notify() read
    ch.initiator, ch.is_sender, ch.op, ch.cid, ch.h, ch.in_handoff = initiator, not initiator, "read", 1, 1, True
    ch.units, ch.queue, ch.got, ch.hs_ready, ch.done = [[0]], deque(), set(), True, [False]
    ch.xc = _FakeXc(box)
    ch.t = Namespace(announce=announce, poll_notifs=lambda: calls.append("getNotifs" if initiator else "prefill"),
                     stale=0)
    ch.agent, ch.remote = Namespace(send_notif=lambda remote, msg: calls.append("send_notif")), "peer"
    ch._issue = lambda u: calls.append(("post", u))
    return ch


def check_announced_outside_nixl(announce: str) -> None:
    """Prefill's announcement reaches decode without a NIXL call on decode's side before its
    post: vLLM's decode learns of a request from its engine core, not from NIXL."""
    box, calls = [], []
    prefill, decode = _side(False, announce, box, calls), _side(True, announce, box, calls)
    decode.pump(from_test=True)  # nothing announced yet
    assert calls == [] and box == []
    prefill.queue.append(0)
    prefill.pump(from_test=False)
    assert "send_notif" not in calls and len(box) == 1
    decode.pump(from_test=True)
    assert calls[-1] == ("post", 0) and "getNotifs" not in calls


def test_the_engine_shape_announces_requests_outside_nixl():
    check_announced_outside_nixl("mpi")


def test_a_planted_nixl_announcement_fails_the_check():
    with pytest.raises(AssertionError):
        check_announced_outside_nixl("nixl")
