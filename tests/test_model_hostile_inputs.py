"""Hostile Hugging Face config files given to `kvbench model` (and to plan, which reads them too):
malformed values, inconsistent geometry, and a model too large to size, each refused in one line
naming the file and the key; a valid config still sizes the KV cache.
(Found by issue 15, lists A and D.)
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvbench.model
import kvbench.plan.cli
import kvbench.slo.cli
from tests.conftest import run_cli
from tests.fuzzing import (
    FUZZ,
    check,
    mutate,
    mutation,
    workdir,
)
from tests.helpers import (
    HUGE,
    LLAMA,
    deep,
    json_with,
    refused,
    run,
)


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "sliding_window",
                                 "max_window_layers", "num_hidden_layers"])
@pytest.mark.parametrize("raw, fragment", [
    ('"4096"', "must be an integer, got '4096'"),
    ("NaN", "NaN is not a JSON number"),
    (str(HUGE), "integer with 401 digits (kvbench reads at most 20)"),
    ("9" * 5000, "integer with 5000 digits"),
    (deep(200_000), "JSON nested deeper than 64 levels"),
    ("true", "must be an integer, got True"),
])
def test_hf_config_malformed_values(tmp_path, key, raw, fragment):
    cfg = tmp_path / "config.json"
    cfg.write_text(json_with(LLAMA, key, raw))
    err = refused(run(kvbench.model.cli, "--model-config", cfg), str(cfg))
    assert fragment in err


@pytest.mark.parametrize("patch, fragment", [
    ({"sliding_window": -5}, "sliding_window: must be >= 0, got -5"),
    ({"num_key_value_heads": 7}, "num_key_value_heads 7 does not divide num_attention_heads 32"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers: must be <= 10000, got 1000000000"),
    ({"layer_types": ["full_attention"] * 3, "sliding_window": 4096}, "layer_types has 3 entries for 32 layers"),
    ({"hidden_size": 4095, "num_key_value_heads": 32}, "hidden_size 4095 is not a positive multiple"),
])
def test_hf_config_inconsistent_geometry(tmp_path, patch, fragment):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, **patch}))
    refused(run(kvbench.model.cli, "--model-config", cfg), fragment)


def test_hf_config_through_plan_and_as_a_user_runs_it(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json_with(LLAMA, "hidden_size", str(HUGE)))
    refused(run(kvbench.plan.cli.cli, "--model-config", cfg, "--gbps", "10", "--setup-ms", "1",
                "--prompt-tokens", "100"), "integer with 401 digits")
    res = run_cli("kvbench.model", "--model-config", str(cfg))
    refused((res.returncode, res.stdout, res.stderr), "integer with 401 digits")


def test_hf_config_valid_still_sizes_the_kv(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    rc, out, _ = run(kvbench.model.cli, "--model-config", cfg, "--prompt-tokens", "1000")
    assert rc == 0 and json.loads(out)[0]["kv_bytes"] == 2 * 32 * 8 * 128 * 2 * 1000


def test_huge_model_is_refused_before_any_sizing(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, "num_hidden_layers": 10_000, "head_dim": 2**20,
                               "num_key_value_heads": 32}))
    refused(run(kvbench.model.cli, "--model-config", cfg, "--prompt-tokens", "1000000000"),
            "more than 2^53 B")


# the same reader, fuzzed (tests/fuzzing.py)


@FUZZ
@given(st.data())
def test_fuzz_hf_config(data):
    d = workdir()
    text, must = mutate({**LLAMA, "rope_scaling": {"factor": 8.0, "type": "llama3"}},
                        data.draw(mutation(LLAMA)), "json")
    (d / "config.json").write_text(text)
    out = d / "out.json"
    check(run(kvbench.model.cli, "--model-config", d / "config.json", "--out", out), out, must)
