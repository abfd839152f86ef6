"""kvbench plan export of a store-layerwise fit (kvbench p2p --pattern store-layerwise: decode
gets layer l while prefill puts l+1). Its put and get overlap, so it is not two hops in series:
the one fitted line is the transfer, and every planner's notes say the hops overlap and what of
the store (capacity, evictions and misses, shared bandwidth) it cannot hold; before, such a fit
was exported as any direct link, with no word of the store."""

from __future__ import annotations

import json

import pytest

from kvbench.fit.data import spec_id
from tests.plan.helpers import POOL, export_text, kv_records, make_fit

TOKENS = [300, 1000, 2000, 4000]
LINE = (1.1, 2.5)  # setup ms, GB/s of the overlapped handoff


def _layerwise(recs, pool=POOL):
    for r in recs:
        r["pattern"], r["variant"] = "store-layerwise", None
        r["spec"] = {**r["spec"], "transport": "mooncake", "pattern": "store-layerwise",
                     "variant": None}
        r["spec_id"] = spec_id(r["spec"])
        r["store_pool_bytes"] = pool
    return recs


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    return make_fit(tmp_path_factory.mktemp("slw"), _layerwise(kv_records(TOKENS, *LINE, seed=4)),
                    "slw")




def test_the_json_model_is_the_one_line_with_the_store_beside_it(fit):
    doc = json.loads(export_text(fit, "--to", "json"))
    (group,) = json.loads(open(fit).read())["groups"]
    assert doc["effective_gb_s"] == pytest.approx(group["effective_gb_s"])
    th = doc["context"]["two_hop"]
    assert th["layered"] is True and th["put"] is None and th["series"] is None
    assert th["capacity_requests_at_fold"] == POOL // (2000 * 131_072)


@pytest.mark.parametrize("tool", ["blis", "dynamo", "aisimulate", "splitwise"])
def test_each_tool_says_the_hops_overlap_and_what_of_the_store_it_cannot_hold(fit, tool):
    text = export_text(fit, "--to", tool)
    assert "# cannot represent: the two hops of a store's handoff apart, here overlapped layer by layer" in text
    assert "not two hops in series" in text and "in series 1" not in text
    held = "exact in BLIS's two terms" if tool == "blis" else "its setup is folded"
    assert held in text
    assert f"the store's capacity ({POOL // (2000 * 131_072):,} requests of 2000 tokens in 2 GiB)" in text
