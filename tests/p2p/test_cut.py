"""How the KV is cut (kvbench.kv.cut) and what the transports count as descriptors.

Without MPI: the declarations of a sweep and their refusals; the pieces a TP pair cuts a
page into; the pure count `kvbench plan` uses equals the messages of the page plan the run
builds; the plan moves every element to its place (a copy of every message in order leaves
nothing wrong; two messages swapped do). A channel's count is what it handed the transport
(an MPI channel over a fake communicator that counts its own Isend calls).

Under MPI (one job, `mpi`): a sweep's records say `descriptors` equal to the Isend calls a
wrapped communicator saw per handoff (MPI), and to NIXL's own telemetry descCount where
nothing merges (NIXL engine shape, scattered ids); contiguous ids merge to the predicted count.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.kv import cut as kc
from kvbench.kv.shards import ShardError
from kvbench.model import PRESETS, get_dtype, resolve_model
from kvbench.p2p import pages
from kvbench.p2p.transports.base import HeldPosts
from kvbench.p2p.transports.nixl import binding as nixl_import
from tests.conftest import ROOT, run_mpi

BF16 = get_dtype("bf16")
TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
HAVE_NIXL = nixl_import.import_nixl()[0] is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("model") / "config.json"
    p.write_text(json.dumps(TINY))
    return resolve_model(None, str(p)), p


# ---------------------------------------------------------------------------
# declarations


def test_a_sweep_is_every_combination_block_size_outermost():
    cuts = kc.declared_cuts([1, 16], "joint,split", "scattered", "1:1,2:1", pages=False)
    assert [c.label for c in cuts[:4]] == ["bs 1 joint scattered", "bs 1 joint scattered tp 2:1",
                                          "bs 1 split scattered", "bs 1 split scattered tp 2:1"]
    assert len(cuts) == 8 and cuts[-1].block_size == 16
    assert kc.declared_cuts([4, 8], None, None, None, pages=False) == [kc.Cut(4), kc.Cut(8)]
    engine = kc.declared_cuts([16], None, None, None, pages=True)  # the engine shape's defaults
    assert engine == [kc.Cut(16, "joint", "contiguous", (1, 1))]
    assert engine[0].spec() == {"kv": "joint", "blocks": "contiguous", "tp": "1:1"}
    assert kc.Cut(16).spec() is None  # the message plan's specs keep their ids


@pytest.mark.parametrize("kv,ids,tp,needle", [
    ("diagonal", None, None, "--kv-pages"), (None, "sorted", None, "--block-ids"),
    (None, None, "2", "PREFILL_TP:DECODE_TP"), (None, None, "0:1", "PREFILL_TP:DECODE_TP"),
    ("joint,joint", None, None, "twice"), (None, "file:/nonexistent/ids.json", None, "block-id file"),
])
def test_bad_declarations_are_refused(kv, ids, tp, needle):
    from kvbench.cli import UsageError

    with pytest.raises((ValueError, UsageError), match=needle):
        kc.declared_cuts([16], kv, ids, tp, pages=True)


# ---------------------------------------------------------------------------
# the pieces of a page


def test_pieces_of_a_page(tiny):
    model, _ = tiny  # 2 KV heads, head_dim 64: one head of one part of a 16-token block = 2 KiB
    head = 16 * 64 * 2
    one = kc.page_layout(model, BF16, kc.Cut(16, "joint", "contiguous", (1, 1)))
    assert one.whole_pages and not one.hnd and one.pieces == (kc.Piece(0, 0, 0, 4 * head),)
    two = kc.page_layout(model, BF16, kc.Cut(16, "joint", "contiguous", (2, 1)))
    assert two.hnd and two.source_heads == ((0,), (1,)) and len(two.pieces) == 4  # 2 parts x 2 ranks
    assert [p.source for p in two.pieces] == [0, 1, 0, 1]
    assert [p.local for p in two.pieces] == [0, head, 2 * head, 3 * head]
    assert [p.remote for p in two.pieces] == [0, 0, head, head]
    half = kc.page_layout(model, BF16, kc.Cut(16, "joint", "contiguous", (1, 2)))
    assert half.decode_heads == (0,) and len(half.pieces) == 2 and not half.whole_pages
    assert [(p.local, p.remote) for p in half.pieces] == [(0, 0), (head, 2 * head)]
    split = kc.page_layout(model, BF16, kc.Cut(16, "split", "contiguous", (2, 1)))
    assert len(split.pieces) == 2 and split.pools_per_layer == 2
    mla = kc.page_layout(PRESETS["deepseek-v3"], BF16, kc.Cut(16, "joint", "scattered", (4, 1)))
    assert mla.whole_pages and len(mla.pieces) == 1  # the latent is not split by heads
    with pytest.raises(ShardError):
        kc.page_layout(model, BF16, kc.Cut(16, "joint", "contiguous", (3, 1)))


CUTS = [kc.Cut(bs, kv, ids, tp) for bs, kv, ids, tp in [
    (4, "joint", "scattered", (1, 1)), (16, "split", "merged", (1, 1)),
    (4, "joint", "merged", (2, 1)), (8, "split", "scattered", (1, 2)),
    (16, "joint", "contiguous", (1, 1)), (5, "joint", "merged", (1, 1))]]


def _plans(model, tokens: int, cut: kc.Cut):
    sides = {}
    for side in ("prefill", "decode"):
        caches, lay = pages.cut_data(model, BF16, tokens, cut, side, "cpu")
        sides[side] = (caches, pages.plan_pages(caches, lay, cut, side))
    return sides


@pytest.mark.parametrize("cut", CUTS, ids=lambda c: c.label)
@pytest.mark.parametrize("tokens", [40, 64])
def test_the_count_is_the_plans_and_every_element_lands(tiny, cut, tokens):
    model, _ = tiny
    sides = _plans(model, tokens, cut)
    (src, sp), (dst, dp) = sides["prefill"], sides["decode"]
    assert kc.count_pieces(model, BF16, tokens, cut) == sp.n == dp.n
    assert [b.numel() for b in sp.buffers] == [b.numel() for b in dp.buffers]
    assert dp.nbytes == dst[0].spec.payload_bytes  # the decode rank's whole KV, once
    for c in src:
        c.fill()
    dst[0].clear()
    for a, b in zip(sp.buffers, dp.buffers, strict=True):  # what a transport does, in order
        b.copy_(a)
    assert dst[0].count_wrong() == 0
    if sp.n > 1:  # planted: two messages delivered to each other's place
        dst[0].clear()
        order = list(range(sp.n))
        order[0], order[1] = order[1], order[0]
        for i, j in enumerate(order):
            dp.buffers[j].copy_(sp.buffers[i])
        assert dst[0].count_wrong() > 0


def test_contiguous_ids_merge_where_the_transport_joins_pages(tiny):
    model, _ = tiny
    cut = kc.Cut(4, "joint", "contiguous", (1, 1))
    assert kc.count_pieces(model, BF16, 64, cut) == 4 * 16
    assert kc.count_pieces(model, BF16, 64, cut, merge_adjacent=True) == 4  # one run per layer
    tp = kc.Cut(4, "joint", "contiguous", (2, 1))  # pieces of a page never join across pages
    assert kc.count_pieces(model, BF16, 64, tp, merge_adjacent=True) == 4 * 16 * 4


# ---------------------------------------------------------------------------
# a channel counts what it posted


class _CountingComm:
    def __init__(self):
        self.isend = 0

    def Isend(self, buf, dest, tag):
        self.isend += 1
        return SimpleNamespace(buf=buf)

    def Irecv(self, buf, source, tag):
        return SimpleNamespace(buf=buf)


def test_an_mpi_channel_counts_the_sends_it_made(monkeypatch):
    import torch

    from kvbench.p2p.devices import make_device
    from kvbench.p2p.transports import mpi

    monkeypatch.setattr(mpi, "_MAX_MSG", 1000)  # messages above it go as several sends
    comm = _CountingComm()
    t = SimpleNamespace(comm=comm, direct=True, ctx=SimpleNamespace(dev=make_device("cpu")),
                        held_for=lambda peer: HeldPosts())
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in (10, 2500, 999, 1001)]
    ch = mpi.MPIChannel(t, 1, bufs, True)
    ch.post_many([0, 1, 2, 3])
    ch.close_count()
    ch.post_many([1])
    ch.close_count()
    assert ch.posted_per_handoff == [1 + 3 + 1 + 2, 3] and comm.isend == 10
    rx = mpi.MPIChannel(t, 0, bufs, False)
    rx.post_many([0, 1])
    rx.close_count()
    assert rx.posted_per_handoff == [0]  # the side that moves the data counts, once


# ---------------------------------------------------------------------------
# under MPI: the records' counts against the transports' own

DRIVER = """\
import json, shlex, sys
from mpi4py import MPI
from kvbench.p2p import cli as p2p
from kvbench.p2p.transports import mpi as kmpi

DATA_TAG = kmpi._DATA_TAG
seen = []  # per MPI channel created on this rank: data sends it made, counted at the comm


class Counting:
    def __init__(self, comm, slot):
        self.comm, self.slot = comm, slot

    def Isend(self, buf, dest, tag):
        if tag == DATA_TAG:
            seen[self.slot] += 1
        return self.comm.Isend(buf, dest=dest, tag=tag)

    def __getattr__(self, name):
        return getattr(self.comm, name)


init = kmpi.MPIChannel.__init__


def counted(self, *a, **kw):
    init(self, *a, **kw)
    seen.append(0)
    self.comm = Counting(self.comm, len(seen) - 1)


kmpi.MPIChannel.__init__ = counted
for line in open(sys.argv[1]):
    seen.clear()
    rc = p2p.cli(shlex.split(line))
    out = line.split("--out ")[1].split()[0]
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RC", rc, out, json.dumps(seen), flush=True)
"""
COMMON = ("--layout paged --granularity block --sizes 40,64 --block-size 4,16 --warmup 1 "
          "--iters 3 --min-iters 3 --quiet")
RUNS = {"mpi": "--transport mpi --block-ids scattered,merged --tp-pair 1:1,2:1 --kv-pages joint,split",
        "nixl": ("--transport nixl --nixl-engine-profile descriptors "
                 "--no-nixl-progress-thread --block-ids scattered,contiguous "
                 "--tp-pair 1:1,2:1")}


@pytest.fixture(scope="module")
def sweep_job(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuts")
    runs = {k: v for k, v in RUNS.items() if k != "nixl" or HAVE_NIXL}
    lines = [f"{COMMON} --model-config {tiny[1]} {flags} --out {tmp / name}"
             for name, flags in runs.items()]
    (tmp / "cases.txt").write_text("\n".join(lines) + "\n")
    (tmp / "driver.py").write_text(DRIVER)
    res = run_mpi(2, "driver", str(tmp / "cases.txt"), cwd=tmp, timeout=400,
                  extra_env={"PYTHONPATH": str(ROOT)})
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("RC "):
            _, rc, path, seen = line.split(" ", 3)
            name = path.rsplit("/", 1)[1]
            recs = [json.loads(x) for f in (tmp / name).glob("*.jsonl") for x in f.open()]
            out[name] = (int(rc), recs, json.loads(seen))
    return out, res


@pytest.mark.mpi
def test_mpi_records_count_the_sends_mpi_saw(sweep_job, tiny):
    out, res = sweep_job
    rc, recs, seen = out["mpi"]
    assert rc == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(recs) == len(seen) == 2 * 2 * 2 * 2 * 2  # sizes x bs x ids x tp x pages
    for rec, sends in zip(recs, seen, strict=True):  # points and channels in the same order
        handoffs = 1 + len(rec["warmup_ms"]) + rec["n_samples"] + 1  # cold, warm, timed, check
        assert rec["wrong"] == 0
        assert sends == rec["descriptors"] * handoffs, (rec["cut"], rec["block_size"])
        c = rec["cut"]
        cut = kc.Cut(rec["block_size"], c["kv"], c["blocks"], tuple(map(int, c["tp"].split(":"))))
        assert rec["descriptors"] == kc.count_pieces(tiny[0], BF16, rec["prompt_tokens"], cut)
    merged = [r for r in recs if r["cut"]["blocks"] == "merged" and r["cut"]["tp"] == "1:1"]
    assert all(r["descriptors"] == 4 * (1 if r["cut"]["kv"] == "joint" else 2) for r in merged)
    assert len({r["spec_id"] for r in recs}) == 16  # every cut its own spec, sizes share one


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable: pip install 'kvbench[nixl]'")
def test_nixl_records_count_what_nixl_counted(sweep_job, tiny):
    out, res = sweep_job
    rc, recs, _ = out["nixl"]
    assert rc == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(recs) == 2 * 2 * 2 * 2 and all(r["wrong"] == 0 for r in recs)
    for rec in recs:
        tel = rec["nixl_telemetry"]["desc_count"]
        assert set(tel) == {rec["descriptors_merged"]}  # NIXL's own count, every handoff
        c = rec["cut"]
        cut = kc.Cut(rec["block_size"], c["kv"], c["blocks"], tuple(map(int, c["tp"].split(":"))))
        if c["blocks"] == "scattered" or c["tp"] != "1:1":  # nothing adjacent: nothing merges
            assert rec["descriptors"] == rec["descriptors_merged"]
        else:
            assert rec["descriptors_merged"] == 4 < rec["descriptors"]  # one run per layer
        assert rec["descriptors_merged"] == kc.count_pieces(tiny[0], BF16, rec["prompt_tokens"],
                                                            cut, merge_adjacent=True)
    assert np.all([r["spec"]["transport_options"]["shape"] == "engine" for r in recs])
