"""GuideLLM's metrics.request_totals count the requests inside its measurement window (those
with a known end that overlap it); its file's groups hold every request the run resolved. The
file may therefore hold more than the totals, and the converter takes them all with a note; it
refuses only when the file may hold fewer than were made (fewer than the totals, or a sample as
large as its sample_size). Variants of the committed real report
(tests/data/clients/guidellm-0.8.1)."""

from __future__ import annotations

from tests.slo.helpers import convert_guidellm_variant as convert


def cancelled_outside_the_window(b: dict) -> None:
    """The last successful request becomes an incomplete one the totals leave out (GuideLLM's
    window skips a request without a known end, or one that overlaps none of it)."""
    last = b["requests"]["successful"].pop()
    last["info"]["timings"]["request_end"] = None
    b["requests"]["incomplete"] = [last]
    b["metrics"]["request_totals"].update(successful=19, incomplete=0, total=19)


def test_a_request_the_totals_leave_out_is_converted_with_a_note(tmp_path):
    rc, stdout, err, recs = convert(tmp_path, cancelled_outside_the_window)
    assert rc == 0, err
    assert len(recs) == 20 and sum(r["status"] == "timeout" for r in recs) == 1, stdout
    assert ("GuideLLM's totals count 0 incomplete requests (its measurement window) and its file "
            "holds 1: kvbench converts all 1") in err


def test_fewer_in_the_file_than_the_totals_is_still_refused(tmp_path):
    rc, _, err, recs = convert(tmp_path, lambda b: b["metrics"]["request_totals"].update(errored=2, total=22))
    assert rc == 2 and "errored: 0 requests kept of 2 made" in err and not recs, err


def test_a_full_sample_is_refused_even_when_it_covers_the_totals(tmp_path):
    def sampled(b):
        b["config"]["sample_size"] = 20  # 20 kept of a reservoir of 20: some may have been dropped

    rc, _, err, recs = convert(tmp_path, sampled)
    assert rc == 2 and "successful: 20 requests kept of 20 made (sample_size 20)" in err and not recs, err


def test_a_sample_larger_than_the_run_keeps_everything(tmp_path):
    rc, _, err, recs = convert(tmp_path, lambda b: b["config"].update(sample_size=1000))
    assert rc == 0 and len(recs) == 20, err
