"""Lean matrix records (issue 44 item 1, kvbench.records.schema.job): a job's first record holds
what is per job (hosts, spec.hosts, gpus, every rank's environment, the schedule's rounds), its
later records leave it out, so a record's bytes do not grow with N; every reader makes them
whole again from the first record (the same objects, shared), and a file whose first record
is cut fails in one line. Records: benchmarks/matrix_scale.py's synthetic job (planted slow
pairs and an odd path) taken through rank 0's real writer (kvbench.p2p.report.finish and
kvbench.records.write.write_records). The real mpirun jobs: test_matrix_mpi_lean.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.errors import UsageError
from kvbench.records.schema.job import JOB_IN, whole_dicts
from kvbench.records.write import environment, write_records
from tests.conftest import committed, run_cli
from tests.matrix.helpers import matrix_scale_module

BENCH = matrix_scale_module()
PER_NODE = 4  # ranks per host: pairs within and across hosts


def written(n: int, folder: Path, whole: bool = False) -> Path:
    """One synthetic n-rank job's records through rank 0's writer (finish, then the files);
    `whole`: as jobs wrote them before (every record whole), for the comparisons."""
    from kvbench.p2p.report import finish

    recs = list(BENCH._records(n, PER_NODE, 20, 0))
    envs = [{**environment(), "pid": 1000 + r} for r in range(n)]
    for rec in recs:  # what the pattern hands finish: no env yet, its round's pairs
        rec.pop("env")
    if whole:  # the writer before: every rank's environment in every record, hosts and all
        summary = {k: envs[0][k] for k in ("torch", "mpi4py", "mpi_library", "nccl", "nixl",
                                           "gpu", "cpu")}
        for rec in recs:
            rec.update(env={"ranks": envs, **summary}, timestamp="2026-12-07T00:00:00Z")
    else:
        finish(recs, {"path": "unused"}, envs)
    folder.mkdir(parents=True, exist_ok=True)
    jsonl, _ = write_records(folder, recs, "kvbench-p2p")
    return jsonl


def _later_bytes(path: Path) -> float:
    lines = path.read_bytes().splitlines()
    return sum(len(x) for x in lines[1:]) / (len(lines) - 1)


def test_a_records_bytes_do_not_grow_with_n(tmp_path):
    size = {n: _later_bytes(written(n, tmp_path / f"n{n}")) for n in (4, 8, 64)}
    assert max(size.values()) / min(size.values()) < 1.1, size
    whole = {n: _later_bytes(written(n, tmp_path / f"w{n}", whole=True)) for n in (4, 16)}
    assert whole[16] / whole[4] > 1.5, whole  # (the check can fail: whole records do grow)


def test_the_first_record_holds_the_job_and_the_later_ones_leave_it_out(tmp_path):
    raw = [json.loads(x) for x in written(8, tmp_path).read_text().splitlines()]
    first, later = raw[0], raw[1:]
    assert len(first["hosts"]) == 8 and len(first["env"]["ranks"]) == 8
    assert len(first["schedule"]["pairs_by_round"]) == first["schedule"]["rounds"] == 14
    for rec in later:
        assert rec["job_in"] == JOB_IN and rec["run_id"] == first["run_id"]
        assert "hosts" not in rec and "hosts" not in rec["spec"] and "gpus" not in rec
        assert "pairs_in_round" not in rec["schedule"] and "ranks" not in rec["env"]
        assert rec["sender"]["host"] and rec["receiver"]["host"] and rec["samples_ms"]


def test_readers_make_lean_records_whole_with_shared_objects(tmp_path):
    from kvbench.records.schema.p2p import iter_p2p_records

    src = written(8, tmp_path)
    lean = [json.loads(x) for x in src.read_text().splitlines()]
    plain = list(whole_dicts(src))
    typed = [rec for _, rec in iter_p2p_records([src])]
    for d, t, raw in zip(plain, typed, lean, strict=True):
        assert d["hosts"] == lean[0]["hosts"] and t.hosts == lean[0]["hosts"]
        assert d["spec"]["hosts"] == lean[0]["hosts"] and t.spec.hosts == lean[0]["hosts"]
        k = raw["schedule"]["round"]
        assert d["schedule"]["pairs_in_round"] == lean[0]["schedule"]["pairs_by_round"][k]
        assert list(raw["pair"]) in d["schedule"]["pairs_in_round"]
        assert len(d["env"]["ranks"]) == 8 and t.spec_id == raw["spec_id"]
    # one object per job, not a copy per record
    assert all(d["hosts"] is plain[1]["hosts"] and d["spec"]["hosts"] is plain[1]["hosts"]
               for d in plain[1:])
    assert all(t.hosts is typed[0].hosts and t.spec.hosts is typed[0].hosts for t in typed)
    assert all(t.model_extra["env"]["ranks"] is typed[0].model_extra["env"]["ranks"]
               for t in typed)


def _cut_first(src: Path, dst: Path) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[1:]))
    return dst


def test_a_file_without_its_first_record_fails_in_one_line(tmp_path):
    from kvbench.fit.data import read_groups
    from kvbench.records.schema.p2p import iter_p2p_records

    cut = _cut_first(written(8, tmp_path / "w"), tmp_path / "cut.jsonl")
    for read in (lambda: read_groups([cut]), lambda: list(iter_p2p_records([cut])),
                 lambda: list(whole_dicts(cut))):
        with pytest.raises(UsageError, match="first record .* is missing") as exc:
            read()
        assert "\n" not in str(exc.value) and f"{cut}:1:" in str(exc.value)
    for cmd in (("kvbench.fit", str(cut), "--out", str(tmp_path / "f.json")),
                ("kvbench.matrix", "report", str(cut), "--out", str(tmp_path / "m"),
                 "--bootstrap", "100")):
        r = run_cli(*cmd)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
        assert "first record" in r.stderr and "Traceback" not in r.stderr


def test_a_lean_record_filled_from_another_jobs_hosts_is_refused(tmp_path):
    """Two jobs of the same shape on other hosts, concatenated: each lean record is filled
    from its own run's first record; a lean record moved under the other run fails its
    spec id (it was hashed with its own job's hosts), never silently re-grouped."""
    from kvbench.fit.data import read_groups

    a = written(4, tmp_path / "a").read_text().splitlines(keepends=True)
    b = [json.loads(x) for x in written(4, tmp_path / "b").read_text().splitlines()]
    for rec in b:  # the same job on other hosts, its own run
        rec["run_id"] = "other-run"
        if "hosts" in rec:
            rec["hosts"] = [f"other-{h}" for h in rec["hosts"]]
    both = tmp_path / "both.jsonl"
    both.write_text("".join(a) + "".join(json.dumps(r) + "\n" for r in b))
    with pytest.raises(UsageError, match="spec_id .* is not the hash of spec with its job"):
        read_groups([both])  # b's whole first record names other hosts than b's spec ids


def test_committed_whole_records_read_as_before():
    """A real 3-node job's records (results/matrix-20261206, written whole): the same pairs,
    hosts and spec ids as the records say, every group its records' own spec."""
    from kvbench.fit.data import read_groups
    from kvbench.matrix.analyze import read_run

    src = committed("results/matrix-20261206/kvbench-p2p-20261206T080400Z-c5d75f.jsonl")
    raw = [json.loads(x) for x in src.read_text().splitlines()]
    run = read_run([str(src)])
    assert run.hosts == ["n1", "n2", "n3"] and len(run.pairs) == 6 and run.skipped == 0
    groups, n = read_groups([src])
    assert n == len(raw) == 36
    assert {g.spec_id for g in groups} == {r["spec_id"] for r in raw}
    by_id = {r["spec_id"]: r["spec"] for r in raw}
    assert all(g.spec == by_id[g.spec_id] and list(g.spec) == list(by_id[g.spec_id])
               for g in groups)  # the spec as written, keys in the file's order
    for (s, r), d in run.pairs.items():
        assert d.hosts == (raw[0]["hosts"][s], raw[0]["hosts"][r]) and d.n_records == 6


def _doc_without_sources(path: Path) -> dict:
    doc = json.loads(path.read_text())
    for k in ("inputs", "sources", "created", "written_at", "command"):
        doc.pop(k, None)
    for g in doc.get("groups", []):
        g.pop("sources", None)
    for p in doc.get("pairs", []):
        (p.get("fit") or {}).pop("sources", None)
    return doc


def test_fit_matrix_and_plan_agree_on_a_job_written_lean_and_whole(tmp_path):
    lean, whole = written(8, tmp_path / "lean"), written(8, tmp_path / "whole", whole=True)
    assert lean.stat().st_size < whole.stat().st_size
    fits = {}
    for name, src in (("lean", lean), ("whole", whole)):
        r = run_cli("kvbench.fit", str(src), "--out", str(tmp_path / f"{name}.fit.json"),
                    "--bootstrap", "200")
        assert r.returncode == 0, r.stderr[-2000:]
        fits[name] = _doc_without_sources(tmp_path / f"{name}.fit.json")
        r = run_cli("kvbench.matrix", "report", str(src), "--out", str(tmp_path / f"m-{name}"),
                    "--bootstrap", "200")
        assert r.returncode in (0, 1), r.stderr[-2000:]
    assert fits["lean"]["groups"] == fits["whole"]["groups"] and len(fits["lean"]["groups"]) == 56
    docs = [_doc_without_sources(next((tmp_path / f"m-{k}").glob("kvbench-matrix-*.json")))
            for k in ("lean", "whole")]
    assert docs[0]["pairs"] == docs[1]["pairs"] and docs[0]["verdict"] == docs[1]["verdict"]
    assert {tuple(p["pair"]): [f["code"] for f in p["findings"]] for p in docs[0]["pairs"]
            if p["findings"]} == {p: [c] for p, c in BENCH.planted(8, PER_NODE).items()}
    plans = []
    for k in ("lean", "whole"):
        r = run_cli("kvbench.plan", "--fit", str(tmp_path / f"{k}.fit.json"), "--format", "json",
                    "--where", "variant=1->0")
        assert r.returncode == 0, r.stderr[-2000:]
        plans.append(json.loads(r.stdout)["rows"])
    assert plans[0] == plans[1] and plans[0]


def test_results_load_gives_the_same_table_for_lean_and_whole(tmp_path):
    """kvbench.results.load (the users' facade, kvbench.records.frames): the same rows from a
    job written lean and written whole, from the .jsonl and from its .csv twin."""
    from kvbench.results import load

    lean, whole = written(8, tmp_path / "lean"), written(8, tmp_path / "whole", whole=True)
    drop = ["source", "timestamp"]
    for suffix in (".jsonl", ".csv"):
        a = load(str(lean.with_suffix(suffix)), "p2p").drop(columns=drop)
        b = load(str(whole.with_suffix(suffix)), "p2p").drop(columns=drop)
        assert len(a) == 112 and list(a.columns) == list(b.columns)
        assert a.astype(str).equals(b.astype(str)), suffix
        assert set(a["hosts"].astype(str)) == {",".join(["node-000"] * 4 + ["node-001"] * 4)}
