"""The transfer model and KV geometry, through the CLI a user runs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.model import DTYPES, PRESETS, KVSizing, ModelSpec, handoff_floor, load_hf_config
from tests.conftest import run_cli


def model_json(*args: str):
    res = run_cli("kvbench.model", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_tutorial_artifact_exact():
    out = model_json()
    assert out["bytes_per_token"] == 327680
    assert out["prompt_tokens"] == 2000
    assert out["kv_bytes"] == 655_360_000
    assert out["kv_mib"] == 625
    assert "scope" in out
    links = {link["effective_bandwidth_gb_s"]: link for link in out["links"]}
    expect = {100: (7.5536, True), 25: (27.2144, False), 10: (66.5360, False)}
    for gbs, (ms, ok) in expect.items():
        assert round(links[gbs]["handoff_floor_ms"], 4) == ms
        assert links[gbs]["floor_within_20ms_budget"] is ok
        assert round(links[gbs]["handoff_floor_ms"] - links[gbs]["bandwidth_floor_ms"], 4) == 1.0
    short = out["broken_short_prompt_case"]
    assert short["prompt_tokens"] == 300
    assert short["effective_bandwidth_gb_s"] == 10
    assert round(short["handoff_floor_ms"], 4) == 10.8304


def test_opt66b_512_tokens():
    out = model_json("--model", "opt-66b", "--dtype", "fp16", "--prompt-tokens", "512")
    assert out[0]["kv_bytes"] == 1_207_959_552
    gbit_per_s_for_ten = out[0]["kv_bytes"] * 10 * 8 / 1e9
    assert round(gbit_per_s_for_ten, 2) == 96.64


def test_prompt_list_budget_key_and_table():
    out = model_json("--prompt-tokens", "300,2000,8192", "--budget-ms", "30",
                     "--links-gbps", "50", "--setup-ms", "0.5")
    assert [o["prompt_tokens"] for o in out] == [300, 2000, 8192]
    assert out[2]["kv_bytes"] == 8192 * 327680
    assert "floor_within_30ms_budget" in out[0]["links"][0]
    assert out[0]["links"][0]["floor_within_30ms_budget"] is True
    res = run_cli("kvbench.model", "--format", "table")
    assert res.returncode == 0 and "handoff ms" in res.stdout and "7.5536" in res.stdout


def test_fp8_halves_payload_and_lists_needs():
    bf16 = model_json("--prompt-tokens", "2000")[0]
    fp8 = model_json("--prompt-tokens", "2000", "--dtype", "fp8_e4m3",
                     "--scale-mode", "per-token-per-head", "--scale-dtype", "fp16")[0]
    assert fp8["sizing"]["payload_bytes"] * 2 == bf16["kv_bytes"]
    q = fp8["quantized_kv"]
    assert q["payload_vs_bf16"] == 0.5
    # 2 (K,V) x 80 layers x 8 heads x 2000 tokens x 2 bytes of fp16 scale
    assert q["scale_bytes_added"] == 2 * 80 * 8 * 2000 * 2
    assert fp8["kv_bytes"] == fp8["sizing"]["payload_bytes"] + q["scale_bytes_added"]
    assert any("accuracy" in s for s in q["a_real_fp8_kv_needs"])


@pytest.mark.parametrize("args,needle", [
    (("--prompt-tokens", "0"), "positive"),
    (("--prompt-tokens", "12.5"), "positive integers"),
    (("--model", "gpt-9"), "unknown model"),
    (("--dtype", "fp4"), "unknown dtype"),
    (("--links-gbps", "0"), "positive"),
    (("--links-gbps", "-5"), "positive"),
    (("--setup-ms", "-1"), "negative"),
    (("--model-config", "/nonexistent/config.json"), "not found"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    res = run_cli("kvbench.model", *args)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert needle in res.stderr


def test_malformed_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    res = run_cli("kvbench.model", "--model-config", str(bad))
    assert res.returncode == 2 and "not valid JSON" in res.stderr
    bad.write_text(json.dumps({"num_attention_heads": 8}))
    res = run_cli("kvbench.model", "--model-config", str(bad))
    assert res.returncode == 2 and "num_hidden_layers" in res.stderr


def test_hf_config_defaults_and_mla_and_sliding(tmp_path):
    cfg = tmp_path / "config.json"
    # OPT-style: no num_key_value_heads, no head_dim -> MHA, hidden / heads
    cfg.write_text(json.dumps({"num_hidden_layers": 64, "num_attention_heads": 72,
                               "hidden_size": 9216}))
    m = load_hf_config(cfg)
    assert (m.kv_heads, m.head_dim, m.attention) == (72, 128, "mha")
    # DeepSeek-V3-style MLA: no factor 2
    cfg.write_text(json.dumps({"num_hidden_layers": 61, "num_attention_heads": 128,
                               "num_key_value_heads": 128, "hidden_size": 7168,
                               "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    m = load_hf_config(cfg)
    assert m.bytes_per_token(DTYPES["bf16"]) == 61 * 576 * 2 == PRESETS["deepseek-v3"].bytes_per_token(DTYPES["bf16"])
    # Mistral-style sliding window on every layer caps the KV at the window
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "hidden_size": 4096,
                               "sliding_window": 4096}))
    m = load_hf_config(cfg)
    assert m.kv_bytes(8192, DTYPES["bf16"]) == m.kv_bytes(4096, DTYPES["bf16"])
    # Qwen2 style: sliding window declared but switched off
    cfg.write_text(json.dumps({"num_hidden_layers": 80, "num_attention_heads": 64,
                               "num_key_value_heads": 8, "hidden_size": 8192,
                               "sliding_window": 131072, "use_sliding_window": False,
                               "max_window_layers": 70}))
    m = load_hf_config(cfg)
    assert m.sliding_layers == 0 and m.kv_bytes(2000, DTYPES["bf16"]) == 2000 * 327680
    res = run_cli("kvbench.model", "--model-config", str(cfg))
    assert res.returncode == 0 and json.loads(res.stdout)["kv_bytes"] == 655_360_000


def test_presets_match_public_configs():
    bf16 = DTYPES["bf16"]
    assert PRESETS["seed-70b-gqa"].bytes_per_token(bf16) == 327680
    assert PRESETS["llama-3.1-8b"].bytes_per_token(bf16) == 2 * 32 * 8 * 128 * 2
    assert PRESETS["llama-3.1-70b"].bytes_per_token(bf16) == 327680
    assert PRESETS["qwen2.5-72b"].bytes_per_token(bf16) == 327680
    assert PRESETS["opt-66b"].bytes_per_token(DTYPES["fp16"]) == 2 * 64 * 72 * 128 * 2
    assert PRESETS["deepseek-v3"].bytes_per_token(bf16) == 61 * 576 * 2


def test_per_rank_layer_block_bytes():
    s = KVSizing(PRESETS["seed-70b-gqa"], DTYPES["bf16"], 2000, block_size=16, tp=2)
    assert s.stored_tokens == 2000
    assert s.bytes_per_layer == 2 * 8 * 128 * 2 * 2000
    assert s.bytes_per_block == 2 * 8 * 128 * 2 * 16
    assert s.tp_shard()["bytes_per_rank"] == s.kv_bytes // 2
    s = KVSizing(PRESETS["seed-70b-gqa"], DTYPES["bf16"], 2001, block_size=16, tp=16)
    assert s.stored_tokens == 2016
    shard = s.tp_shard()
    assert shard["replicated"] and shard["heads_per_rank"] == 1 and "replicated" in shard["note"]


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 128), kv_heads=st.integers(1, 128), head_dim=st.integers(1, 512),
       tokens=st.integers(1, 1 << 20), dtype=st.sampled_from(sorted(DTYPES)),
       window=st.one_of(st.none(), st.integers(1, 1 << 16)))
def test_kv_bytes_formula_properties(layers, kv_heads, head_dim, tokens, dtype, window):
    dt = DTYPES[dtype]
    m = ModelSpec("h", layers, kv_heads, head_dim, sliding_window=window,
                  sliding_layers=layers if window else 0)
    held = min(tokens, window) if window else tokens
    assert m.kv_bytes(tokens, dt) == 2 * layers * kv_heads * head_dim * dt.bytes * held
    assert m.kv_bytes(tokens + 1, dt) >= m.kv_bytes(tokens, dt)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(1, 1 << 40), gbs=st.floats(0.01, 1e4), setup=st.floats(0, 1e3))
def test_floor_is_setup_plus_bytes_over_rate(nbytes, gbs, setup):
    bw, total = handoff_floor(nbytes, gbs, setup)
    assert bw == pytest.approx(nbytes / (gbs * 1e9) * 1e3)
    assert total == pytest.approx(setup + bw)
    assert handoff_floor(nbytes, gbs * 2, setup)[0] == pytest.approx(bw / 2)
