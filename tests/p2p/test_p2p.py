"""The p2p benchmark through real `mpirun -n 2` jobs: records, data check, bad input, faults."""

from __future__ import annotations

import hashlib
import json
from argparse import Namespace
from pathlib import Path

import pandas as pd
import pytest
import torch

from kvbench.model import DTYPES, PRESETS
from kvbench.p2p.layout import KVCache, KVSpec, RawBuffer
from kvbench.p2p.messages import plan_messages
from kvbench.records.write import fresh_stem, write_new_file
from kvbench.units import parse_bytes
from tests.conftest import gpu_share_args, run_cli, run_mpi

FAST = ("--iters", "5", "--warmup", "1", "--quiet")
REQUIRED = {"schema", "transport", "pattern", "granularity", "layout", "dtype", "device", "model",
            "prompt_tokens", "bytes", "world_size", "iters", "samples_ms", "p50_ms", "p95_ms",
            "p99_ms", "mean_ms", "min_ms", "max_ms", "gbps", "cold_ms", "wrong", "argv", "env",
            "timestamp",
            # issue 12 (docs/contracts.md section 1) and the common clock (issue 11)
            "spec", "spec_id", "run_id", "order", "sample_rounds", "fit_as_link",
            "not_link_reason", "n_samples", "clock"}


def p2p(tmp_path: Path, *args: str, n: int = 2, timeout: float = 180):
    res = run_mpi(n, "kvbench.p2p", *args, "--out", str(tmp_path), timeout=timeout)
    files = sorted(tmp_path.glob("kvbench-p2p-*.jsonl"))
    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    return res, records, files


@pytest.mark.mpi
@pytest.mark.parametrize("transport,layout,granularity,dtype", [
    ("mpi", "contiguous", "whole", "bf16"),
    ("mpi", "contiguous", "block", "fp8_e4m3"),
    ("mpi", "paged", "layer", "fp8_e5m2"),
    pytest.param("mpi", "paged", "block", "bf16", marks=pytest.mark.check),  # fast tier: mpi
    pytest.param("gloo", "contiguous", "layer", "fp8_e4m3", marks=pytest.mark.check),  # gloo
    ("gloo", "paged", "whole", "bf16"),
])
def test_sequential_handoff_moves_every_byte(tmp_path, transport, layout, granularity, dtype):
    res, recs, files = p2p(tmp_path, "--transport", transport, "--layout", layout,
                           "--granularity", granularity, "--dtype", dtype,
                           "--sizes", "24,40", "--block-size", "16", *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(recs) == 2 and len(files) == 1
    assert files[0].with_suffix(".csv").exists()
    elem = DTYPES[dtype].bytes
    for rec, tokens in zip(recs, (24, 40), strict=True):
        assert REQUIRED <= set(rec), REQUIRED - set(rec)
        assert rec["schema"] == "kvbench.p2p/1"
        assert (rec["transport"], rec["layout"], rec["granularity"], rec["dtype"]) == \
            (transport, layout, granularity, dtype)
        assert rec["pattern"] == "sequential" and rec["device"] == "cpu" and rec["world_size"] == 2
        assert rec["wrong"] == 0
        stored = tokens if layout == "contiguous" else -(-tokens // 16) * 16
        assert rec["bytes"] == 2 * 80 * 8 * 128 * elem * stored
        assert len(rec["samples_ms"]) == rec["iters"] >= 5
        assert all(s > 0 for s in rec["samples_ms"])
        assert rec["min_ms"] <= rec["p50_ms"] <= rec["p95_ms"] <= rec["p99_ms"] <= rec["max_ms"]
        assert rec["gbps"] == pytest.approx(rec["bytes"] / 1e9 / (rec["p50_ms"] / 1e3))
        assert rec["cold_ms"] > 0 and rec["notice_ms"] > 0
        assert rec["model"]["name"] == "seed-70b-gqa" and rec["model"]["layers"] == 80
        assert rec["env"]["torch"] and rec["env"]["mpi_library"].startswith("Open MPI")
        assert len(rec["hosts"]) == 2
    assert "p50 ms" in res.stdout and "GB/s" in res.stdout
    df = pd.read_json(files[0], lines=True)
    assert list(df["prompt_tokens"]) == [24, 40]
    check_run_fields(recs, "rounds")
    spec = recs[0]["spec"]
    assert (spec["transport"], spec["layout"], spec["granularity"], spec["dtype"]) == \
        (transport, layout, granularity, dtype)
    assert spec["pack_kernel"] == ("torch" if recs[0]["packed"] else None)
    assert spec["world"] == {"size": 2, "prefill_ranks": [0], "decode_ranks": [1]}
    assert spec["model"] == "seed-70b-gqa" and spec["block_size"] == (16 if layout == "paged" else None)


def check_run_fields(recs, order):
    """The fields docs/contracts.md section 1 promises the fit, checked against their definitions."""
    assert len({r["run_id"] for r in recs}) == 1
    for r in recs:
        assert r["order"] == order
        assert r["n_samples"] == len(r["samples_ms"]) == len(r["sample_rounds"])
        canonical = json.dumps(r["spec"], sort_keys=True, separators=(",", ":"))
        assert r["spec_id"] == hashlib.sha256(canonical.encode()).hexdigest()[:12]
        assert r["sample_rounds"] == list(range(r["n_samples"]))
        assert r["fit_as_link"] is True and r["not_link_reason"] is None
        assert r["clock"]["offset_ms"] == [0.0] * r["world_size"]
    # one point per size, same spec: replicates of one configuration
    assert len({r["spec_id"] for r in recs}) == 1
    if order == "rounds":  # every size was measured in the same rounds
        assert len({tuple(r["sample_rounds"]) for r in recs}) == 1


@pytest.mark.mpi
def test_raw_byte_sweep_nccl_tests_style(tmp_path):
    res, recs, _ = p2p(tmp_path, "-b", "64K", "-e", "1M", "-f", "4", *FAST)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [r["bytes"] for r in recs] == [64 << 10, 256 << 10, 1 << 20]
    assert all(r["prompt_tokens"] is None and r["layout"] == "raw" and r["wrong"] == 0 for r in recs)
    res, recs, _ = p2p(tmp_path / "b", "--bytes", "4K,1M", "--baseline", *FAST)
    assert res.returncode == 0, res.stderr[-2000:]
    assert all(r["baseline_bare_mpi_gbps"] > 0 and r["vs_baseline"] > 0 for r in recs)
    assert "kvbench/bare" in res.stdout


@pytest.mark.mpi
def test_blocks_order_and_percentile_marks(tmp_path):
    res, recs, _ = p2p(tmp_path, "--bytes", "4K,64K", "--order", "blocks", "--iters", "20",
                       "--min-iters", "20", "--warmup", "0", "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    check_run_fields(recs, "blocks")
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("sequential"))
    assert " 20 " in row and "n/a (n<100)" in row and "n/a (n<20)" not in row  # p95 ok, p99 not


class _Pat:
    def __init__(self, sizes):
        self.sizes = sizes

    def bytes_per_rank(self, pt):
        return self.sizes[pt]


class _Comm:
    def Get_rank(self):
        return 0

    def allgather(self, x):
        return [x, x]


@pytest.mark.parametrize("free,order,want", [
    (100, "rounds", ("rounds", False, False)),
    (45, "rounds", ("blocks", True, False)),  # 2 x (10 + 20) = 60 > 40.5 >= 2 x 20
    (40, "rounds", (None, False, True)),  # even the largest size alone: 40 > 36
    (50, "rounds", ("blocks", True, False)),
    (30, "rounds", (None, False, True)),
    (30, "blocks", (None, False, True)),
    (50, "blocks", ("blocks", False, False)),
])
def test_rounds_fall_back_to_blocks_when_every_size_at_once_does_not_fit(monkeypatch, free, order,
                                                                         want):
    """Rounds keep every size alive at once: 2 ranks on one host x (10 + 20) GB. When that does
    not fit in 90% of MemAvailable but one size at a time does, measure in blocks and say so."""
    from kvbench.p2p import memory as p2p_mod

    monkeypatch.setattr(p2p_mod, "mem_available_bytes", lambda: free * 1e9)
    got = p2p_mod.choose_order(_Comm(), Namespace(order=order), [_Pat({0: 10e9, 1: 20e9})],
                               [0, 1], ["h", "h"], "cpu")
    assert got[0] == want[0]
    assert (got[1] is not None) == want[1] and (got[2] is not None) == want[2]
    if want[1]:
        assert "--order blocks" in got[1] and "\n" not in got[1]
    if want[2]:
        assert "would not fit in memory" in got[2]


@pytest.mark.parametrize("gpus,free,want", [
    ([{"uuid": "GPU-a"}, {"uuid": "GPU-a"}], 45, "blocks"),  # one shared GPU: 2 x (10 + 20)
    ([{"uuid": "GPU-a"}, {"uuid": "GPU-b"}], 45, "rounds"),  # one each: 10 + 20 per GPU
    ([{"uuid": "GPU-a"}, {"uuid": "GPU-a"}], 30, None),
])
def test_the_memory_check_on_cuda_uses_the_gpus_free_memory(monkeypatch, gpus, free, want):
    """Issue 20, defect 11: on CUDA the KV lives on the GPU; the check used to do nothing
    there. Ranks sharing a GPU (by UUID) share its free memory; host RAM is not consulted."""
    from kvbench.p2p import memory as p2p_mod

    monkeypatch.setattr(p2p_mod, "gpu_free_bytes", lambda: free * 1e9)
    monkeypatch.setattr(p2p_mod, "mem_available_bytes", lambda: 1e15)
    got = p2p_mod.choose_order(_Comm(), Namespace(order="rounds"), [_Pat({0: 10e9, 1: 20e9})],
                               [0, 1], ["h", "h"], "cuda", gpus)
    assert got[0] == want
    if want is None:
        assert "would not fit in GPU memory on h GPU GPU-a" in got[2], got[2]


@pytest.mark.mpi
@pytest.mark.check
def test_corrupted_data_fails_the_run(tmp_path):
    res, recs, _ = p2p(tmp_path, "--sizes", "16", "--debug-corrupt-elements", "3", *FAST)
    assert res.returncode == 1
    assert recs[0]["wrong"] == 3
    assert "data check failed: 3 wrong elements" in res.stderr


@pytest.mark.mpi
def test_corrupted_sharded_data_fails_the_run(tmp_path):
    """The sharded pattern checks its data too (issue 15 F): 3 elements altered on each of
    the two prefill ranks are 6 wrong elements at the decode rank."""
    res, recs, _ = p2p(tmp_path, "--sizes", "16", "--pattern", "sharded", "--prefill-tp", "2",
                       "--decode-tp", "1", "--debug-corrupt-elements", "3", *FAST, n=3)
    assert res.returncode == 1
    checked = [r for r in recs if r["wrong"] is not None]
    assert checked and all(r["wrong"] == 6 for r in checked), [r["wrong"] for r in recs]
    assert "data check failed" in res.stderr


@pytest.mark.mpi
@pytest.mark.check
def test_stalled_peer_aborts_instead_of_hanging(tmp_path):
    res, recs, _ = p2p(tmp_path, "--sizes", "16", "--timeout", "3", "--debug-stall-rank", "1",
                       *FAST, timeout=90)
    assert res.returncode != 0
    assert "stopped answering" in res.stderr and "--timeout" in res.stderr
    assert recs == []  # nothing partial left behind


@pytest.mark.mpi
@pytest.mark.parametrize("n,args,needle", [
    (3, ("--sizes", "16"), "exactly 2 ranks"),
    (2, ("--sizes", "100000000"), "would not fit in memory"),
    (2, ("--transport", "carrier-pigeon"), "unknown transport"),
])
def test_bad_input_under_mpirun_every_rank_exits_2(tmp_path, n, args, needle):
    res, recs, _ = p2p(tmp_path, *args, n=n, timeout=90)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, res.stderr
    assert needle in errors[0]
    assert "Traceback" not in res.stderr
    assert recs == []


@pytest.mark.parametrize("args,needle", [
    (("--transport", "nccl"), "GPU"),
    (("--device", "cuda"), "no CUDA GPU"),
    (("--sizes", "0"), "positive"),
    (("--sizes", "300,-2"), "positive"),
    (("--bytes", "12Q"), "not a byte size"),
    (("--bytes", "1M", "--granularity", "layer"), "granularity whole"),
    (("--dtype", "fp4"), "unknown dtype"),
    (("--pattern", "telepathy"), "unknown pattern"),
    (("--iters", "0"), "--iters"),
    (("--sizes", "16"), "run under MPI with at least 2 ranks"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, needle):
    """Input checks run identically on every rank before any traffic; a single process
    (MPI singleton) shows the same line a job would."""
    if needle == "GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is visible: nccl is valid here")
    res = run_cli("kvbench.p2p", *args, "--out", str(tmp_path))
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_outside_mpirun():
    res = run_cli("kvbench.p2p", "--help")
    assert res.returncode == 0
    for needle in ("--sizes", "--transport", "--granularity", "how it times", "cold_ms"):
        assert needle in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
@pytest.mark.parametrize("transport", ["nccl", "mpi", "gloo"])
def test_gpu_handoff(tmp_path, transport):
    """One GPU per rank where there are two; on one GPU both ranks share it (NCCL skipped)."""
    res, recs, _ = p2p(tmp_path, "--device", "cuda", "--transport", transport, "--sizes", "64",
                       *gpu_share_args(transport), *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    assert recs[0]["device"] == "cuda" and recs[0]["wrong"] == 0


# -- units below the CLI: layout, messages, writers ---------------------------------


@pytest.mark.parametrize("layout,gran", [("contiguous", "whole"), ("contiguous", "layer"),
                                         ("contiguous", "block"), ("paged", "whole"),
                                         ("paged", "layer"), ("paged", "block")])
def test_message_plans_cover_the_payload_and_round_trip(layout, gran):
    spec = KVSpec(PRESETS["llama-3.1-8b"], DTYPES["bf16"], 37, layout=layout, block_size=16)
    src, dst = KVCache(spec, table_seed=0), KVCache(spec, table_seed=1)
    src.fill()
    dst.clear()
    sp, dp = plan_messages(src, gran), plan_messages(dst, gran)
    assert sp.nbytes == dp.nbytes == spec.payload_bytes
    expected_n = {"whole": 1, "layer": 64, "block": 64 * 3}[gran]
    assert sp.n == expected_n
    sp.pack()
    for a, b in zip(sp.buffers, dp.buffers, strict=True):
        b.copy_(a)
    dp.unpack()
    assert dst.count_wrong() == 0
    if layout == "contiguous":
        dst.tensors[3].view(-1)[0] += 1  # a single flipped element is seen
        assert dst.count_wrong() == 1
        return
    # paged: tensor 3 is layer 1's V pool; a flip in a block the request uses is seen, a flip
    # in a pool block it does not use is not (the check reads the request's KV only)
    layer, pool = 1, dst.tensors[3]
    used = {int(b) for b in dst.block_tables[layer]}
    unused = next(b for b in range(dst.pool_blocks) if b not in used)
    pool[unused].view(-1)[0] += 1
    assert dst.count_wrong() == 0
    pool[int(dst.block_tables[layer][0])].view(-1)[0] += 1  # its first block: token 0
    assert dst.count_wrong() == 1


def test_sliding_window_and_mla_layouts():
    spec = KVSpec(PRESETS["mistral-7b-v0.1"], DTYPES["bf16"], 5000)
    assert spec.payload_bytes == PRESETS["mistral-7b-v0.1"].kv_bytes(5000, DTYPES["bf16"])
    mla = KVSpec(PRESETS["deepseek-v3"], DTYPES["bf16"], 10)
    assert mla.parts == 1 and mla.payload_bytes == 61 * 576 * 2 * 10
    c = KVCache(mla)
    c.fill()
    assert c.count_wrong() == 0


def test_raw_buffer_pattern():
    a, b = RawBuffer(1000), RawBuffer(1000)
    a.fill()
    # the tiled fill (one 256-byte period copied) equals the per-byte definition, tail included
    assert torch.equal(a.backing.view(torch.int8), a._expected(0, 1000))
    a.backing.view(torch.int8)[999] += 1
    assert a.count_wrong() == 1
    a.fill()
    b.clear()
    assert b.count_wrong() > 900
    b.backing.copy_(a.backing)
    assert b.count_wrong() == 0


def test_writers_never_overwrite(tmp_path):
    p = write_new_file(tmp_path / "x.json", "1")
    with pytest.raises(Exception, match="refusing to overwrite"):
        write_new_file(p, "2")
    assert p.read_text() == "1"
    assert list(tmp_path.iterdir()) == [p]  # no temp files left behind
    (tmp_path / "run-A.jsonl").write_text("")
    stem = fresh_stem(tmp_path, "run", (".jsonl",))
    assert not stem.with_name(stem.name + ".jsonl").exists()


def test_parse_bytes():
    assert parse_bytes("4K") == 4096 and parse_bytes("1M") == 1 << 20 and parse_bytes("64MiB") == 64 << 20
    with pytest.raises(ValueError):
        parse_bytes("1.5M")
