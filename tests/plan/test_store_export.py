"""kvbench plan export of a store fit (kvbench p2p --pattern store: the handoff, its put and its
get fitted as three groups): every planner gets the whole handoff as its one transfer with a
note saying how the two hops are held and what is not; one hop alone is refused in one line."""

from __future__ import annotations

import json

import pytest

from kvbench.fit.data import spec_id
from kvbench.plan.twohop import in_series
from tests.plan.helpers import POOL, bad, export_text, kv_records, make_fit

TOKENS = [300, 1000, 2000, 4000]
# put and get fitted apart, and the handoff as decode sees it (their series plus a notice)
PUT, GET, WHOLE = (1.0, 2.0), (0.5, 3.0), (1.6, 1.2)


def _variant(recs, variant, pool=POOL):
    for r in recs:
        r["pattern"], r["variant"] = "store", variant
        r["spec"] = {**r["spec"], "transport": "mooncake", "pattern": "store", "variant": variant}
        r["spec_id"] = spec_id(r["spec"])
        r["store_pool_bytes"] = pool
    return recs


@pytest.fixture(scope="module")
def store_fit(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    recs = [*_variant(kv_records(TOKENS, *WHOLE, seed=1), None),
            *_variant(kv_records(TOKENS, *PUT, seed=2), "put"),
            *_variant(kv_records(TOKENS, *GET, seed=3), "get")]
    return make_fit(tmp, recs, "store")




def test_the_json_model_is_the_handoff_with_both_hops_beside_it(store_fit):
    doc = json.loads(export_text(store_fit, "--to", "json"))
    groups = {g["group"]["variant"]: g for g in json.loads(open(store_fit).read())["groups"]}
    assert doc["setup_ms"] == pytest.approx(max(groups[None]["setup_ms"], 0.0))  # the handoff's
    th = doc["context"]["two_hop"]
    assert th["put"]["setup_ms"] == groups["put"]["setup_ms"]
    assert th["get"]["effective_gb_s"] == groups["get"]["effective_gb_s"]
    s = in_series(th["put"], th["get"])
    assert th["series"] == pytest.approx(s)
    assert s["effective_gb_s"] == pytest.approx(1 / (1 / PUT[1] + 1 / GET[1]), rel=0.1)
    assert th["capacity_requests_at_fold"] == POOL // (2000 * 131_072)
    for tool in ("dynamo", "aisimulate", "blis", "splitwise"):
        assert any(m.startswith("the two hops of a store's handoff apart") for m in doc["tools"][tool]["cannot_represent"])


@pytest.mark.parametrize("tool", ["blis", "dynamo", "aisimulate", "splitwise"])
def test_each_tool_says_how_it_holds_the_two_hops(store_fit, tool):
    text = export_text(store_fit, "--to", tool)
    assert "# cannot represent: the two hops of a store's handoff apart (prefill puts" in text
    held = ("exact in BLIS's two terms" if tool == "blis" else
            "the setup of both hops and the notice is folded")
    assert held in text
    assert f"the store's capacity ({POOL // (2000 * 131_072):,} requests of 2000 tokens in 2 GiB)" in text


def test_one_hop_alone_is_refused_in_one_line(store_fit):
    for hop in ("put", "get"):
        line = bad("export", "--fit", store_fit, "--to", "blis", "--where", f"variant={hop}",
                   prog="kvbench plan export")
        assert f"the store's {hop} alone, one hop of a two-hop handoff" in line
        assert f"drop --where variant={hop}" in line


def test_a_direct_fit_exports_as_before(tmp_path):
    fit = make_fit(tmp_path, kv_records(TOKENS, *WHOLE), "direct")
    for tool in ("json", "blis", "dynamo"):
        assert "two hops" not in export_text(fit, "--to", tool)
