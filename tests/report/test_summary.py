"""`kvbench report RESULTS_DIR`: the summary a person reads, on real result files."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT, committed, run_cli

P2P = ROOT / "tests/data/p2p/kvbench-p2p-20261203T122234Z-b96bb8.jsonl"
SHAPED = committed("tests/data/runs/shaped-link")
SLO = committed("tests/data/runs/lab-sweep/analysis/warm-rep1.json")

pytest.importorskip("matplotlib")


def _folder(tmp_path: Path) -> Path:
    """A results folder of real files: a rounds-order run, a shaped-link experiment (three runs
    and their fit file) and an SLO report."""
    root = tmp_path / "results"
    (root / "rounds").mkdir(parents=True)
    shutil.copy(P2P, root / "rounds")
    shutil.copy(P2P.with_suffix(".csv"), root / "rounds")
    (root / "shaped").mkdir()
    for stamp in ("092334Z", "092355Z", "092419Z"):
        shutil.copy(SHAPED / f"kvbench-p2p-20261203T{stamp}.jsonl", root / "shaped")
    shutil.copy(SHAPED / "kvbench-p2p-20261203T092334Z.fit.json", root / "shaped")
    (root / "slo").mkdir()
    shutil.copy(SLO, root / "slo")
    return root


def _report(root: Path, *args: str) -> tuple[str, str, str]:
    res = run_cli("kvbench", "report", str(root), "--bootstrap", "200", *args, timeout=300)
    assert res.returncode == 0, res.stderr
    out = root / "report"
    return (out / "report.md").read_text(), (out / "report.html").read_text(), res.stderr


def test_report_of_a_folder(tmp_path):
    root = _folder(tmp_path)
    md, html, err = _report(root)
    assert "files read" in err and "fitting" in err  # progress on stderr
    # a table per configuration and size; p99 of 20 samples is refused, p95 is shown
    assert "| 64.0 KiB (65,536 B) | - | 1 | 20 |" in md and "n/a (n<100)" in md
    row = next(line for line in md.splitlines() if line.startswith("| 64.0 KiB"))
    assert "n/a (n<20)" not in row
    # the rounds run is fitted with an interval; the shaped link's three runs are pooled
    assert re.search(r"\| transport=mpi [^|]*transport_options\.path=host \| 3 \| 60 \| "
                     r"[-0-9.e]+ \[[-0-9.e]+, [-0-9.e]+\] \|", md)
    assert "pools 3 runs (files)" in md
    assert "### Fit files in this folder (as written)" in md and "kvbench.fit/2" in md
    assert "| aggregated | - | 2 |" in md  # the SLO report's groups
    assert "transport_info.path" in md and "| host |" in md
    # plots: files beside the Markdown, embedded in the HTML, nothing fetched from a network
    pngs = re.findall(r"!\[[^]]*\]\((plots/[^)]+\.png)\)", md)
    assert pngs and all((root / "report" / p).exists() for p in pngs)
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(embedded) == len(pngs)
    assert all(base64.b64decode(e)[:8] == b"\x89PNG\r\n\x1a\n" for e in embedded)
    assert "http://" not in html and "https://" not in html
    # the records of the CSV twin are not counted twice
    assert "3 p2p records in 1 file(s)" in md


def test_refit_matches_kvbench_fit(tmp_path):
    root = _folder(tmp_path)
    md, _, _ = _report(root)
    res = run_cli("kvbench.fit", str(root / "shaped" / "kvbench-p2p-20261203T092334Z.jsonl"),
                  str(root / "shaped" / "kvbench-p2p-20261203T092355Z.jsonl"),
                  str(root / "shaped" / "kvbench-p2p-20261203T092419Z.jsonl"),
                  "--out", str(tmp_path / "f.json"), "--bootstrap", "200")
    assert res.returncode == 0, res.stderr
    (g,) = json.loads((tmp_path / "f.json").read_text())["groups"]
    lo, hi = g["effective_gb_s_ci95"]
    assert f"{g['effective_gb_s']:.4g} [{lo:.4g}, {hi:.4g}]" in md


def _planted(root: Path, **env) -> None:
    """A copy of the rounds run whose rank 0 says something else about its machine."""
    lines = P2P.read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    for r in recs:
        r["env"]["ranks"][0].update(env)
    (root / "rounds" / "planted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_warnings_busy_machine_and_mixed_configurations(tmp_path):
    root = _folder(tmp_path)
    md, _, _ = _report(root)
    assert "busy machine" not in md and "kvbench differs" not in md
    shutil.rmtree(root / "report")
    _planted(root, load_average=[3.5, 2.0, 1.0], kvbench="0.2.0")
    md, _, _ = _report(root)
    warnings = md.split("## Warnings")[1].split("\n## ")[0]
    assert "busy machine: `" in warnings and "planted.jsonl` started with load average 3.50 on 2 CPUs" in warnings
    assert "mixed configurations in `" in warnings and "kvbench differs between records (0.1.0; 0.2.0)" in warnings
    assert "pools 2 runs (files)" in warnings  # the planted copy shares the spec: pooled


def test_refuses_to_overwrite_and_bad_folders(tmp_path):
    root = _folder(tmp_path)
    _report(root)
    again = run_cli("kvbench", "report", str(root))
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "refusing to overwrite existing file" in again.stderr
    missing = run_cli("kvbench", "report", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not a folder" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    none = run_cli("kvbench", "report", str(empty), "--out", str(tmp_path / "r"))
    assert none.returncode == 2 and "no kvbench results" in none.stderr
    assert not (tmp_path / "r" / "report.md").exists()


def test_a_mixed_folder_says_what_was_skipped_and_why(tmp_path):
    """A record file of a newer schema version was dropped without a word. Every results-looking
    file report does not read is named with its reason, one line each, and counted (on stderr,
    --quiet too, and in the report); the CSV twin of a file read is not a skip."""
    root = tmp_path / "results"
    (root / "runs").mkdir(parents=True)
    shutil.copy(P2P, root / "runs")
    shutil.copy(P2P.with_suffix(".csv"), root / "runs")
    newer = root / "runs" / "newer.jsonl"
    newer.write_text(P2P.read_text().replace('"kvbench.p2p/1"', '"kvbench.p2p/2"'))
    (root / "runs" / "settings.json").write_text('{"not": "kvbench"}\n')
    (root / "runs" / "requests.jsonl").write_text(json.dumps({"schema": "kvbench.slo.request/1"}) + "\n")
    (root / "runs" / "notes.txt").write_text("not a results file: not listed\n")
    (root / "runs" / "gone.jsonl").symlink_to(tmp_path / "moved-away.jsonl")
    (root / "runs" / "two\nlines.json").write_text("{}\n")
    res = run_cli("kvbench", "report", str(root), "--no-refit", "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines == [
        f"kvbench report: skipped {root / 'runs' / 'gone.jsonl'}: a broken link (its target does "
        "not exist)",
        f"kvbench report: skipped {newer}: schema kvbench.p2p/2: this kvbench reads kvbench.p2p/1 "
        "(a newer kvbench wrote it?)",
        f"kvbench report: skipped {root / 'runs' / 'requests.jsonl'}: holds kvbench.slo.request/1, "
        "not kvbench.fit/1 or kvbench.fit/2 or kvbench.p2p/1 or kvbench.slo.report/1",
        f"kvbench report: skipped {root / 'runs' / 'settings.json'}: no kvbench schema (not a "
        "kvbench results file)",
        f"kvbench report: skipped {root / 'runs'}/two\\nlines.json: no kvbench schema (not a "
        "kvbench results file)",
        "kvbench report: 5 file(s) skipped"], lines
    md = (root / "report" / "report.md").read_text()
    assert "5 file(s) under" in md and "## Files not read" in md and f"`{newer}`: schema kvbench.p2p/2" in md


def test_results_load_of_a_folder_warns_about_a_newer_schema(tmp_path):
    from kvbench.results import load

    (tmp_path / "a.jsonl").write_text(P2P.read_text())
    (tmp_path / "b.jsonl").write_text(P2P.read_text().replace('"kvbench.p2p/1"', '"kvbench.p2p/2"'))
    with pytest.warns(UserWarning, match=r"skipped .*b\.jsonl: schema kvbench\.p2p/2"):
        df = load(tmp_path, "p2p")
    assert set(df["source"].astype(str)) == {str(tmp_path / "a.jsonl")}


def test_a_folder_with_nothing_read_is_one_line_naming_what_was_skipped(tmp_path):
    (tmp_path / "newer.jsonl").write_text(P2P.read_text().replace('"kvbench.p2p/1"', '"kvbench.p2p/2"'))
    (tmp_path / "x.json").write_text("{}\n")
    res = run_cli("kvbench", "report", str(tmp_path), "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "no kvbench results" in res.stderr and "skipped 2 file(s), the first" in res.stderr
    assert "newer.jsonl: schema kvbench.p2p/2" in res.stderr
