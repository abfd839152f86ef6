"""The record writer's fast paths keep its results (a matrix job's rank 0 writes millions of
records, each with the job's host list): Measurement.summary's one np.percentile call gives
each property's bits, and the contract's text check and key ordering skip flat lists without
changing what is written (a lone surrogate in a host name is still written as \\xNN)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict

from kvbench.records.stats import Measurement
from kvbench.records.write import contract_dump


class _Rec(BaseModel):
    """A record shape with what the fast paths meet: flat lists of strings and numbers, and
    dicts inside a list (whose keys the writer keeps in its own order)."""

    model_config = ConfigDict(extra="allow")
    hosts: list[str]
    samples_ms: list[float | int | bool | None]
    items: list[dict] = []


@pytest.mark.parametrize("n", [0, 1, 2, 3, 19, 20, 101, 1000])
def test_the_summary_is_each_propertys_value_to_the_bit(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        m = Measurement([float(x) for x in rng.lognormal(0, 2, n) * 10 ** rng.uniform(-3, 3)])
        want = {"p50_ms": m.p50, "p95_ms": m.p95, "p99_ms": m.p99, "mean_ms": m.mean,
                "min_ms": m.min, "max_ms": m.max, "iqr_ms": m.iqr}
        got = m.summary()
        assert list(got) == list(want)
        for k, v in want.items():
            assert (math.isnan(v) and math.isnan(got[k])) or got[k] == v, (k, got[k], v)


def test_a_lone_surrogate_in_a_host_list_is_still_escaped():
    bad = "node\udcff7"  # a non-UTF-8 byte Python kept as a lone surrogate
    out = contract_dump(_Rec, {"hosts": ["a", bad, "b"], "samples_ms": [1.0, 2, None, True]}, "t")
    assert out["hosts"] == ["a", "node\\xff7", "b"]
    assert out["samples_ms"] == [1.0, 2, None, True]
    clean = {"hosts": ["h1", "h2"], "samples_ms": [0.5]}
    assert contract_dump(_Rec, clean, "t") == clean


def test_key_order_still_reaches_dicts_inside_lists():
    src = {"samples_ms": [1.0], "items": [{"y": 1, "x": 2}], "hosts": ["n1", "n2"]}
    got = contract_dump(_Rec, src, "t")
    assert list(got) == ["samples_ms", "items", "hosts"] and list(got["items"][0]) == ["y", "x"]
