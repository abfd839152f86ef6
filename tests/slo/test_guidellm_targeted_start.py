"""GuideLLM documents targeted_start as the Unix time its schedule meant a request to start,
and 0.8.1 has written -0.07 beside Unix-time request_start values (a real lab run in CI: the
conversion was refused). Such a value is not a schedule: that request's is unknown, its send
time is its own, the others keep theirs, and a note says so. Variants of the committed real
report (tests/data/clients/guidellm-0.8.1)."""

from __future__ import annotations

from tests.slo.helpers import convert_guidellm_variant as convert


def _target_of(b: dict, k: int, value) -> None:
    b["requests"]["successful"][k]["info"]["timings"]["targeted_start"] = value


def test_a_negative_target_is_an_unknown_schedule_with_a_note(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rc0, _, err0, before = convert(tmp_path / "a", lambda b: None)
    rc, _, err, recs = convert(tmp_path / "b", lambda b: _target_of(b, 2, -0.06969644446738832))
    assert rc0 == 0 and rc == 0, err
    assert "targeted_start" not in err0
    assert "GuideLLM wrote 1 targeted_start value(s) that are not Unix times" in err
    assert len(recs) == len(before) == 20
    unknown = [r for r in recs if r["scheduled_send_ms"] is None]
    assert len(unknown) == 1 and all(r["scheduled_send_ms"] is not None for r in before)
    # every other request's times are those of the unchanged report (the origin is not moved)
    same = {r["request_id"]: r for r in before}
    for r in recs:
        if r is not unknown[0]:
            assert r == same[r["request_id"]]
    assert unknown[0]["actual_send_ms"] == same[unknown[0]["request_id"]]["actual_send_ms"]


def test_a_target_far_from_its_send_is_unknown_too(tmp_path):
    def far(b):
        t = b["requests"]["successful"][0]["info"]["timings"]
        t["targeted_start"] = t["request_start"] - 2 * 3600

    rc, _, err, recs = convert(tmp_path, far)
    assert rc == 0 and "GuideLLM wrote 1 targeted_start value(s)" in err, err
    assert sum(r["scheduled_send_ms"] is None for r in recs) == 1
