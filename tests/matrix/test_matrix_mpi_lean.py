"""Real `mpirun --oversubscribe` matrix jobs write lean records (issue 44 item 1,
kvbench.records.schema.job): the first record holds the job (every host, every rank's
environment, the schedule's rounds), the later ones only their own pair, so their bytes are
the same at N = 4 and N = 8, and `kvbench fit` and the readers give them back whole. MPI
transport on host memory; the timings are not the subject."""

from __future__ import annotations

import json

import pytest

from kvbench.records.schema.job import JOB_IN, whole_dicts
from tests.conftest import run_cli, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

RUN = ("kvbench.matrix", "--device", "cpu", "--transport", "mpi", "--bytes", "4K,16K",
       "--iters", "3", "--min-iters", "3", "--warmup", "0", "--seconds-per-point", "0.2",
       "--timeout", "120", "--quiet", "--bootstrap", "100")


def _job(n: int, out):
    r = run_mpi(n, *RUN, "--out", str(out), mpi_args=("--oversubscribe",), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (src,) = out.glob("kvbench-p2p-*.jsonl")
    return src


def test_a_real_jobs_later_records_are_lean_and_read_whole(tmp_path):
    sizes = {}
    for n in (4, 8):
        src = _job(n, tmp_path / f"n{n}")
        lines = src.read_bytes().splitlines()
        raw = [json.loads(x) for x in lines]
        assert len(raw) == n * (n - 1) * 2
        first = raw[0]
        assert len(first["hosts"]) == len(first["spec"]["hosts"]) == n
        assert len(first["schedule"]["pairs_by_round"]) == 2 * (n - 1)
        for rec in raw[1:]:
            assert rec["job_in"] == JOB_IN and "hosts" not in rec and "hosts" not in rec["spec"]
            assert "pairs_in_round" not in rec["schedule"] and "ranks" not in rec["env"]
        sizes[n] = sum(len(x) for x in lines[1:]) / (len(lines) - 1)
        whole = list(whole_dicts(src))
        assert all(w["hosts"] is whole[0]["hosts"] and len(w["env"]["ranks"]) == n for w in whole)
        assert all(list(w["pair"]) in w["schedule"]["pairs_in_round"]
                   and len(w["schedule"]["pairs_in_round"]) == n // 2 for w in whole)
        r = run_cli("kvbench.fit", str(src), "--out", str(tmp_path / f"n{n}.fit.json"),
                    "--bootstrap", "100")
        assert r.returncode == 0, r.stderr[-2000:]
        fit = json.loads((tmp_path / f"n{n}.fit.json").read_text())
        assert len(fit["groups"]) == n * (n - 1)  # one group per pair: its spec id, as whole
        assert {g["spec_id"] for g in fit["groups"]} == {x["spec_id"] for x in raw}
    # the later records' bytes do not grow with N
    assert sizes[8] / sizes[4] < 1.1, sizes
