"""kvbench fit carries a store run's mounted pool (`store_pool_bytes`) and kvbench plan prints
the store's capacity in requests per prompt length; direct links and old fits print none."""

from __future__ import annotations

import json

from kvbench.fit.data import spec_id
from tests.conftest import run_cli
from tests.plan.helpers import BPT_8B, POOL, kv_records, make_fit, run_json

TOKENS = ["--model", "llama-3.1-8b", "--prompt-tokens", "300,2000"]


def store_records(pool=POOL, **kw):
    recs = kv_records([300, 1000, 2000, 4000], 2.0, 1.5, **kw)
    for r in recs:
        r["pattern"] = "store"
        r["spec"] = {**r["spec"], "transport": "mooncake", "pattern": "store"}
        r["spec_id"] = spec_id(r["spec"])
        r["store_pool_bytes"] = pool
    return recs


def _table(fit: str) -> str:
    res = run_cli("kvbench.plan", "--fit", fit, *TOKENS, "--format", "table")
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_plan_prints_the_stores_capacity_in_requests(tmp_path):
    fit = make_fit(tmp_path, store_records())
    (g,) = json.loads(open(fit).read())["groups"]
    assert g["store_pool_bytes"] == POOL
    rows = {r["prompt_tokens"]: r for r in run_json("--fit", fit, *TOKENS)["rows"]}
    for t in (300, 2000):
        assert rows[t]["kv_bytes"] == t * BPT_8B
        assert rows[t]["store_capacity_requests"] == POOL // (t * BPT_8B)
        assert rows[t]["store_pool_bytes"] == POOL
    table = _table(fit)
    assert f"store holds {POOL // (300 * BPT_8B):,} requests of 300 tokens (pool 2 GiB)" in table
    assert f"store holds {POOL // (2000 * BPT_8B):,} requests of 2000 tokens (pool 2 GiB)" in table


def test_direct_links_and_old_fits_print_no_capacity(tmp_path):
    direct = make_fit(tmp_path, kv_records([300, 1000, 2000, 4000], 2.0, 1.5), "direct")
    assert "store holds" not in _table(direct)
    old = json.loads(open(make_fit(tmp_path, store_records(), "store")).read())
    for g in old["groups"]:
        del g["store_pool_bytes"]  # a fit written before the field: still read
    path = tmp_path / "old.fit.json"
    path.write_text(json.dumps(old))
    assert "store holds" not in _table(str(path))
    assert all("store_capacity_requests" not in r
               for r in run_json("--fit", str(path), *TOKENS)["rows"])


def test_runs_with_different_pools_plan_no_capacity(tmp_path):
    recs = store_records()
    recs[1]["store_pool_bytes"] = POOL // 2  # one record from a run that mounted half
    fit = make_fit(tmp_path, recs)
    (g,) = json.loads(open(fit).read())["groups"]
    assert g["store_pool_bytes"] is None
    assert any(w["code"] == "store_pool_varies" for w in g["warnings"])
    assert "store holds" not in _table(fit)
