"""Sharded (tensor-parallel) handoff: the send plan as a pure function, and real 4- and 6-rank
`mpirun` jobs that check per-rank bytes and every received head."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from kvbench.p2p.patterns.sharded import Edge, ShardError, resolve_tp, shard_plan
from tests.conftest import run_mpi

BPT_HEAD = 2 * 80 * 128 * 2  # seed-70b-gqa: bytes per token per kv head (K+V, 80 layers, bf16)


def p2p(tmp_path: Path, n: int, *args: str, timeout: float = 180):
    out = tmp_path / "out"
    res = run_mpi(n, "kvbench.p2p", "--pattern", "sharded", *args, "--out", str(out),
                  timeout=timeout)
    records = [json.loads(line) for f in sorted(out.glob("kvbench-p2p-*.jsonl"))
               for line in f.read_text().splitlines()]
    return res, records


# -- the send plan ----------------------------------------------------------------------


def test_plan_same_tp_pairs_rank_to_rank():
    p = shard_plan(8, 2, 2)
    assert p.prefill_heads == [[0, 1, 2, 3], [4, 5, 6, 7]] == p.decode_heads
    assert p.edges == [Edge(0, 2, (0, 1, 2, 3)), Edge(1, 3, (4, 5, 6, 7))]
    assert p.replicated == {"prefill": 1, "decode": 1} and p.note == ""


def test_plan_4_to_2_gathers_two_shards_per_decode_rank():
    p = shard_plan(8, 4, 2)
    assert p.edges == [Edge(0, 4, (0, 1)), Edge(1, 4, (2, 3)), Edge(2, 5, (4, 5)),
                       Edge(3, 5, (6, 7))]
    assert [p.role(r) for r in range(6)] == ["prefill"] * 4 + ["decode"] * 2
    assert p.held(4) == [0, 1, 2, 3] and p.held(5) == [4, 5, 6, 7]


def test_plan_2_to_4_splits_each_prefill_shard():
    p = shard_plan(8, 2, 4)
    assert p.edges == [Edge(0, 2, (0, 1)), Edge(0, 3, (2, 3)), Edge(1, 4, (4, 5)),
                       Edge(1, 5, (6, 7))]
    lines = p.describe()
    assert "  prefill rank 0 holds heads 0-3: sends rank 2 heads 0-1; rank 3 heads 2-3" in lines


def test_plan_replicates_heads_when_kv_heads_below_tp():
    p = shard_plan(2, 4, 4)  # each head on two ranks of each side
    assert p.prefill_heads == [[0], [0], [1], [1]] == p.decode_heads
    assert p.replicated == {"prefill": 2, "decode": 2}
    assert "replicated on 2 ranks" in p.note
    # every decode rank gets its head once; the two holders of a head share the sends
    assert p.edges == [Edge(0, 4, (0,)), Edge(1, 5, (0,)), Edge(2, 6, (1,)), Edge(3, 7, (1,))]
    q = shard_plan(1, 2, 2)  # MQA: one kv head on every rank
    assert q.edges == [Edge(0, 2, (0,)), Edge(1, 3, (0,))] and q.replicated["decode"] == 2
    r = shard_plan(2, 4, 2)  # replicated prefill, split decode: least-loaded holder sends
    assert r.edges == [Edge(0, 4, (0,)), Edge(2, 5, (1,))]
    assert "sends nothing" in "\n".join(r.describe())


def test_plan_mla_latent_is_not_split():
    p = shard_plan(1, 2, 4, mla=True)
    assert p.prefill_heads == [[0], [0]] and p.decode_heads == [[0]] * 4
    assert p.kv_heads == 1 and p.mla and "not split by heads" in p.note
    assert sorted(e.src for e in p.edges) == [0, 0, 1, 1]  # spread over the prefill ranks
    assert all(e.heads == (0,) for e in p.edges)
    assert p.as_dict()["edges"][0] == {"src": 0, "dst": 2, "heads": [0]}


@pytest.mark.parametrize("kv,p,d,needle", [
    (8, 3, 3, "--prefill-tp 3 does not divide the model's 8 kv heads"),
    (8, 2, 12, "--decode-tp 12 is more than the model's 8 kv heads but not a multiple"),
    (8, 0, 2, "at least 1"),
])
def test_plan_rejects_layouts_that_cannot_shard(kv, p, d, needle):
    with pytest.raises(ShardError, match=needle.replace("-", "\\-")):
        shard_plan(kv, p, d)


def test_resolve_tp_from_flags_and_world():
    ns = lambda **kw: Namespace(**{"tp": None, "prefill_tp": None, "decode_tp": None, **kw})  # noqa: E731
    assert resolve_tp(ns(), 4) == (2, 2)
    assert resolve_tp(ns(tp=2), 4) == (2, 2)
    assert resolve_tp(ns(prefill_tp=4, decode_tp=2), 6) == (4, 2)
    assert resolve_tp(ns(prefill_tp=4), 6) == (4, 2)
    with pytest.raises(ShardError, match=r"needs 4 ranks \(ranks 0-1 prefill, ranks 2-3 decode\), "
                                         "but the job has 6: use mpirun -n 4"):
        resolve_tp(ns(tp=2), 6)
    with pytest.raises(ShardError, match="on 3 ranks"):
        resolve_tp(ns(), 3)


# -- real mpirun jobs -------------------------------------------------------------------


def check_records(recs, tokens, n_ranks, rank_heads, edges, stored=None):
    """Both records of a point; `stored` tokens (paged: whole blocks) size the bytes."""
    assert [r["variant"] for r in recs] == ["isolated", "contended"]
    iso, con = recs
    stored = stored or tokens
    total = sum(len(h) for _, _, h in edges) * BPT_HEAD * stored
    for r in recs:
        assert r["schema"] == "kvbench.p2p/1" and r["pattern"] == "sharded"
        assert r["world_size"] == n_ranks and r["prompt_tokens"] == tokens
        assert r["bytes"] == total
        assert r["rank_heads"] == rank_heads
        assert [(e["src"], e["dst"], e["heads"]) for e in r["send_plan"]["edges"]] == edges
        for e in r["send_plan"]["edges"]:
            assert e["bytes"] == len(e["heads"]) * BPT_HEAD * stored
            assert e["isolated_p50_ms"] > 0 and len(e["isolated_samples_ms"]) == r["iters"]
        # bytes each rank moved: sent (prefill) or received (decode)
        expect = [sum(len(h) for s, d, h in edges if rank in (s, d)) * BPT_HEAD * stored
                  for rank in range(n_ranks)]
        assert r["rank_bytes"] == expect
        assert r["contention_ratio"] == pytest.approx(con["p50_ms"] / iso["p50_ms"])
        assert r["aggregate_gbps"] == pytest.approx(total / 1e9 / (con["p50_ms"] / 1e3))
    assert con["wrong"] == 0 and con["rank_wrong"] == [0] * n_ranks
    assert iso["fit_as_link"] is False and "never observed" in iso["not_link_reason"]
    assert con["fit_as_link"] is True
    first_decode = min(d for _, d, _ in edges)
    assert con["spec"]["world"] == {"size": n_ranks, "prefill_ranks": list(range(first_decode)),
                                    "decode_ranks": list(range(first_decode, n_ranks))}
    # one clock: each sending rank's start is >= the first one's (0), decode ranks have none
    senders = {s for s, _, _ in edges}
    for r, starts in enumerate(con["rank_start_ms"]):
        assert (starts is not None) == (r in senders)
        if starts:
            assert min(starts) >= 0
    assert [min(col) for col in zip(*[s for s in con["rank_start_ms"] if s], strict=True)] == \
        [0.0] * con["n_samples"]
    # the critical path: max over ranks of (t1 - the first prefill rank's t0)
    cols = zip(*[s for s in con["rank_samples_ms"] if s], strict=True)
    assert con["samples_ms"] == pytest.approx([max(c) for c in cols])
    assert all(len(s) == con["iters"] for s in con["rank_samples_ms"] if s)
    iso_cols = zip(*[e["isolated_samples_ms"] for e in iso["send_plan"]["edges"]], strict=True)
    assert iso["samples_ms"] == pytest.approx([max(c) for c in iso_cols])
    return iso, con


FAST = ("--sizes", "24", "--iters", "3", "--min-iters", "3", "--warmup", "1", "--quiet")


@pytest.mark.mpi
@pytest.mark.check
def test_sharded_tp2_four_ranks(tmp_path):
    res, recs = p2p(tmp_path, 4, "--tp", "2", *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    iso, con = check_records(recs, 24, 4, [[0, 1, 2, 3], [4, 5, 6, 7]] * 2,
                             [(0, 2, [0, 1, 2, 3]), (1, 3, [4, 5, 6, 7])])
    assert con["tp"] == 2 and con["prefill_tp"] == 2 and con["decode_tp"] == 2
    assert con["replicated_heads"] == {"prefill": 1, "decode": 1} and con["shard_note"] is None
    assert con["rank_role"] == ["prefill", "prefill", "decode", "decode"]
    assert "send plan: prefill TP 2 (ranks 0-1) -> decode TP 2 (ranks 2-3)" in res.stdout
    assert "sharded/contended" in res.stdout and "contended/isolated p50" in res.stdout


@pytest.mark.mpi
def test_sharded_reshards_4_to_2_on_six_ranks_over_gloo(tmp_path):
    res, recs = p2p(tmp_path, 6, "--prefill-tp", "4", "--decode-tp", "2", "--transport", "gloo",
                    "--layout", "paged", "--block-size", "16", "--granularity", "whole", *FAST,
                    timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    # paged: 24 tokens are stored as 2 blocks of 16
    iso, con = check_records(recs, 24, 6, [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1, 2, 3],
                                           [4, 5, 6, 7]],
                             [(0, 4, [0, 1]), (1, 4, [2, 3]), (2, 5, [4, 5]), (3, 5, [6, 7])],
                             stored=32)
    assert con["tp"] is None and (con["prefill_tp"], con["decode_tp"]) == (4, 2)
    assert con["rank_bytes"] == [2 * BPT_HEAD * 32] * 4 + [4 * BPT_HEAD * 32] * 2
    assert con["transport"] == "gloo" and con["layout"] == "paged"
    assert con["descriptors"] == 4 and con["packed"]  # one packed message per edge
    assert [e["descriptors"] for e in con["send_plan"]["edges"]] == [1, 1, 1, 1]
    assert "decode rank 4 holds heads 0-3: from rank 0 (0-1), rank 1 (2-3)" in res.stdout


@pytest.mark.mpi
def test_sharded_replicated_heads_are_reported_and_verified(tmp_path):
    """One kv head (MQA), decode TP 2: both decode ranks hold head 0, both get it from rank 0."""
    cfg = tmp_path / "mqa.json"
    cfg.write_text(json.dumps({"model_type": "mqa", "num_hidden_layers": 80,
                               "num_attention_heads": 8, "num_key_value_heads": 1,
                               "head_dim": 128, "hidden_size": 1024}))
    res, recs = p2p(tmp_path, 3, "--prefill-tp", "1", "--decode-tp", "2", "--model-config",
                    str(cfg), *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    iso, con = check_records(recs, 24, 3, [[0]] * 3, [(0, 1, [0]), (0, 2, [0])])
    assert con["replicated_heads"] == {"prefill": 1, "decode": 2}
    assert "decode: kv_heads 1 < TP 2, each head replicated on 2 ranks" in con["shard_note"]
    assert "replicated on 2 ranks" in res.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("args,needle", [
    (("--tp", "1"), "needs 2 ranks (rank 0 prefill, rank 1 decode), but the job has 3"),
    (("--prefill-tp", "2", "--decode-tp", "1", "--model-config", "{cfg}"),
     "--prefill-tp 2 does not divide the model's 3 kv heads"),
])
def test_bad_layouts_end_cleanly(tmp_path, args, needle):
    cfg = tmp_path / "three.json"
    cfg.write_text(json.dumps({"model_type": "three-heads", "num_hidden_layers": 2,
                               "num_attention_heads": 6, "num_key_value_heads": 3,
                               "head_dim": 64}))
    args = [a.format(cfg=cfg) for a in args]
    res = run_mpi(3, "kvbench.p2p", "--pattern", "sharded", *args, "--sizes", "8", "--no-write",
                  timeout=90)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("kvbench p2p: error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
