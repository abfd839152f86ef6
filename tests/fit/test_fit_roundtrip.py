"""kvbench reads every file kvbench writes, degenerate data included (property tests).

The fit round trip: p2p records of a link that is noise-free (every draw equal to the point
estimate), constant, one or two sizes, steady to 1e-12, bent into two exact regimes, at
extreme byte counts and rates, in rounds or in back-to-back blocks, go through the real
`kvbench fit` writer, and the document it writes is read by every reader kvbench has:
the typed model, `kvbench.results.load` (groups, sizes, draws), `plan`, `plan route`,
`plan export --to` each target, what `slo analyze --fit` reads (`links_from_fit`) and
`report` (with and without its refit). The documents come from the writer, never by hand,
so a field a later fit adds is covered the day it is written.

The property: a group with a fitted rate is read by every reader (plan and export exit 0);
a fit with no fitted rate is refused by plan and export in one line that says so, never a
schema refusal of a file kvbench wrote.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbench.fit.cli
import kvbench.plan.cli
import kvbench.report.cli
from tests.helpers import rounds_records, run, synthetic

ROUND_TRIP = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
ROUTE = ("--local-interference-ms", "5", "--itl-p95-ms", "20", "--itl-target-ms", "50")


def _sizes(draw) -> list[int]:
    kind = draw(st.sampled_from(["one", "two", "few", "extreme", "tiny"]))
    if kind == "one":
        return [draw(st.integers(1, 2**40))]
    if kind == "extreme":
        return [1, 2**40, 2**50, 2**53 - 1]
    if kind == "tiny":
        return [1, 2, 3, 4]
    n = 2 if kind == "two" else draw(st.integers(3, 6))
    return sorted(set(draw(st.lists(st.integers(1, 2**34), min_size=n, max_size=n, unique=True))))


@st.composite
def degenerate_runs(draw) -> tuple[list[dict], str]:
    """p2p records with every field kvbench p2p writes (tests/fit/test_fit.py), degenerate data."""
    sizes = _sizes(draw)
    setup = draw(st.sampled_from([0.0, 1e-7, 0.7, 1.1, 2.5]) | st.floats(0.0, 1e3))
    rate = draw(st.sampled_from([7.3, 0.37, 33.3, 123.456, 1e5]) | st.floats(1e-3, 1e5))
    shape = draw(st.sampled_from(["noise-free", "steady", "constant", "two-regimes"]))
    n = draw(st.sampled_from([1, 3, 5, 20]))
    order = draw(st.sampled_from(["rounds", "blocks"]))
    cut = sizes[len(sizes) // 2]

    def time_fn(b: int) -> float:
        if shape == "constant":
            return setup + 1.0
        if shape == "two-regimes" and b >= cut:
            return 3 * setup + 1.0 + b / (2 * rate * 1e9) * 1e3
        return setup + b / (rate * 1e9) * 1e3

    noise = 1e-12 if shape == "steady" else 0.0
    if order == "rounds":
        recs = rounds_records(sizes, setup, rate, rounds=n, noise=noise, round_shift=noise,
                              time_fn=time_fn)
    else:
        recs = synthetic(sizes, setup, rate, n=n, noise=noise, outliers=0.0, time_fn=time_fn)
    return recs, f"{shape} {order} x{n} setup {setup!r} ms, {rate!r} GB/s, sizes {sizes}"


def _written_fit(recs: list[dict]) -> tuple[Path, Path]:
    folder = Path(tempfile.mkdtemp(prefix="kvbench-roundtrip-"))
    (folder / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, _, err = run(kvbench.fit.cli.cli, folder / "r.jsonl", "--out", folder / "r.fit.json",
                     "--bootstrap", "100")
    assert rc == 0, err
    return folder, folder / "r.fit.json"


def _no_rate_or_read(result, has_rate: bool, what: str) -> None:
    rc, _, err = result
    assert "Traceback" not in err, err[-3000:]
    if has_rate:
        assert rc == 0, f"{what}: {err}"
    else:  # a verdict about the fit, in one line; not a refusal of the file
        assert rc == 2 and err.count("\n") == 1 and "with a fitted rate" in err, f"{what}: {err}"


def read_by_every_reader(folder: Path, fit: Path) -> None:
    from kvbench.plan.export import TOOLS
    from kvbench.plan.floors import links_from_fit
    from kvbench.records.schema.fit import load_fit_document
    from kvbench.results import load

    doc = load_fit_document(fit)
    has_rate = any(g.effective_gb_s for g in doc.groups)
    assert len(load(fit, "fit")) == len(doc.groups)
    assert len(load(fit, "fit-sizes")) == sum(len(g.sizes) for g in doc.groups)
    load(fit, "fit", samples=True)
    if has_rate:
        assert links_from_fit(str(fit), {})
    _no_rate_or_read(run(kvbench.plan.cli.cli, "--fit", fit, "--prompt-tokens", "1,1000,100000"),
                     has_rate, "plan")
    _no_rate_or_read(run(kvbench.plan.cli.cli, "route", "--fit", fit, "--prompt-tokens", "1000", *ROUTE),
                     has_rate, "plan route")
    for tool in TOOLS:
        _no_rate_or_read(run(kvbench.plan.cli.export_cli, "--fit", fit, "--to", tool), has_rate, tool)
    for refit in (("--no-refit",), ("--bootstrap", "100")):
        rc, _, err = run(kvbench.report.cli.cli, folder, "--out", folder / f"rep{len(refit)}",
                         "--quiet", *refit)
        assert rc == 0, err


@ROUND_TRIP
@given(degenerate_runs())
def test_what_fit_writes_from_degenerate_data_every_reader_reads(case):
    recs, what = case
    folder, fit = _written_fit(recs)
    try:
        read_by_every_reader(folder, fit)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def test_a_noise_free_fit_is_exported_for_every_planner():
    """The reported case: every draw equals the estimate, and the estimate's slope
    (1000 / 7.3 GB/s) differs from the six-digit draws in the sixth digit."""
    recs = rounds_records([1 << 18, 1 << 20, 1 << 22, 1 << 24], 0.7, 7.3, noise=0.0, round_shift=0.0)
    folder, fit = _written_fit(recs)
    group = json.loads(fit.read_text())["groups"][0]
    assert {tuple(v) for v in group["draws"]["values"]} == {(0.7, 136.986)}  # noise-free indeed
    read_by_every_reader(folder, fit)
