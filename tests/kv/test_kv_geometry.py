"""kvbench.kv.geometry, the one tokens -> bytes calculator, held to first principles.

Every expected value here is computed in this file from the model's published geometry
(layers x 2 x kv_heads x head_dim x dtype bytes per token for MHA/GQA, layers x
(kv_lora_rank + qk_rope_head_dim) x dtype bytes for MLA), never by calling the calculator,
and a few are literal numbers from the models' configs, so a wrong formula fails here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvbench.errors import UsageError
from kvbench.kv import cut, shards
from kvbench.kv.geometry import DTYPES, KVSizing, ModelSpec, aligned_tokens, tp_split
from kvbench.model import PRESETS

TOKENS = (1, 17, 300, 2000, 4100, 5000, 100_000)
BLOCKS = (None, 1, 16, 1000)
TPS = (1, 2, 3, 4, 8, 16, 64, 72, 144)

# (layers, kv_heads, head_dim or MLA width, sliding layers, window) from each config.json
PUBLISHED = {
    "seed-70b-gqa": (80, 8, 128, 0, None),
    "llama-3.1-8b": (32, 8, 128, 0, None),
    "llama-3.1-70b": (80, 8, 128, 0, None),
    "qwen2.5-72b": (80, 8, 128, 0, None),
    "opt-66b": (64, 72, 128, 0, None),
    "deepseek-v3": (61, 1, 512 + 64, 0, None),
    "mistral-7b-v0.1": (32, 8, 128, 32, 4096),
}


def bytes_per_token(name: str, dbytes: int) -> int:
    layers, kv, width, _, _ = PUBLISHED[name]
    if name == "deepseek-v3":
        return layers * width * dbytes  # one latent per token and layer, no K/V pair
    return layers * 2 * kv * width * dbytes


def sizing_payload(name: str, dbytes: int, tokens: int, block: int | None) -> int:
    """The model/plan rule: the prompt rounded up to whole blocks, then windowed."""
    layers, _, _, sliding, window = PUBLISHED[name]
    stored = math.ceil(tokens / block) * block if block else tokens
    per_layer = bytes_per_token(name, dbytes) // layers
    kept = [min(stored, window) if window and i >= layers - sliding else stored for i in range(layers)]
    return per_layer * sum(kept)


def held_payload(name: str, dbytes: int, tokens: int, block: int | None, heads: int) -> int:
    """The allocation rule (p2p tensors, the page plan): each layer windowed, then rounded
    up to whole blocks; `heads` of the model's heads."""
    layers, kv, width, sliding, window = PUBLISHED[name]
    parts, all_heads = (1, 1) if name == "deepseek-v3" else (2, kv)
    total = 0
    for i in range(layers):
        kept = min(tokens, window) if window and i >= layers - sliding else tokens
        stored = math.ceil(kept / block) * block if block else kept
        total += parts * stored * heads * width * dbytes
    assert heads <= all_heads
    return total


def test_the_published_geometry_is_what_the_presets_hold():
    assert set(PUBLISHED) == set(PRESETS)
    # literal bytes per token in BF16, from the configs by hand
    literal = {"seed-70b-gqa": 327_680, "llama-3.1-8b": 131_072, "opt-66b": 2_359_296,
               "deepseek-v3": 70_272, "mistral-7b-v0.1": 131_072}
    for name, want in literal.items():
        assert PRESETS[name].bytes_per_token(DTYPES["bf16"]) == want == bytes_per_token(name, 2)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sizing_matches_first_principles_for_every_preset_dtype_block_and_tokens(name):
    m = PRESETS[name]
    for dt in DTYPES.values():
        for block in BLOCKS:
            for tokens in TOKENS:
                s = KVSizing(m, dt, tokens, block_size=block)
                assert s.model.bytes_per_token(dt) == bytes_per_token(name, dt.bytes)
                assert s.payload_bytes == s.kv_bytes == sizing_payload(name, dt.bytes, tokens, block)
                assert s.stored_tokens == (math.ceil(tokens / block) * block if block else tokens)
                per_layer = bytes_per_token(name, dt.bytes) // PUBLISHED[name][0]
                assert s.bytes_per_block == (per_layer * block if block else None)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_held_bytes_match_first_principles_for_every_head_subset(name):
    m = PRESETS[name]
    for dt in (DTYPES["bf16"], DTYPES["fp8_e4m3"], DTYPES["fp32"]):
        for block in BLOCKS:
            for tokens in TOKENS:
                for heads in sorted({1, m.n_heads // 2 or 1, m.n_heads}):
                    assert m.held_bytes(tokens, dt, heads, block) == held_payload(
                        name, dt.bytes, tokens, block, heads)


def scale_expected(name: str, mode: str, sb: int, stored: int) -> int:
    layers, kv, _, sliding, window = PUBLISHED[name]
    parts, heads = (1, 1) if name == "deepseek-v3" else (2, kv)
    if mode == "per-tensor":
        return parts * layers * sb
    if mode == "per-layer-per-head":
        return parts * layers * heads * sb
    kept = sum(min(stored, window) if window and i >= layers - sliding else stored for i in range(layers))
    return parts * heads * kept * sb


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_scale_bytes_for_every_mode(name):
    m = PRESETS[name]
    for mode in ("per-tensor", "per-layer-per-head", "per-token-per-head"):
        for sdt, sb in (("fp32", 4), ("bf16", 2)):
            for tokens in (1, 2000, 5000):
                for block in (None, 16):
                    s = KVSizing(m, DTYPES["fp8_e4m3"], tokens, mode, sdt, block)
                    want = scale_expected(name, mode, sb, s.stored_tokens)
                    assert s.scale_bytes == want
                    assert s.kv_bytes == sizing_payload(name, 1, tokens, block) + want


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_bytes_per_tp_rank(name):
    m, (_, kv, _, _, _) = PRESETS[name], PUBLISHED[name]
    for tp in TPS:
        s = KVSizing(m, DTYPES["bf16"], 2000, tp=tp)
        if name == "deepseek-v3":  # the latent is not split: every rank holds all of it
            assert s.tp_shard()["bytes_per_rank"] == s.kv_bytes
            continue
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            with pytest.raises(UsageError, match=f"TP {tp} "):
                s.tp_shard()
            continue
        per_rank = max(1, kv // tp)
        shard = s.tp_shard()
        assert shard["heads_per_rank"] == per_rank
        assert shard["replicated"] == (tp > kv)
        assert shard["bytes_per_rank"] == 2000 * bytes_per_token(name, 2) * per_rank // kv


def test_tp_split_and_the_shard_plan_agree():
    for kv in (1, 2, 3, 8, 72):
        for tp in range(1, 160):
            split = tp_split(kv, tp)
            if split is None:
                with pytest.raises(shards.ShardError):
                    shards.heads_by_rank(tp, kv, False, "prefill")
                continue
            n, copies = split
            held = shards.heads_by_rank(tp, kv, False, "prefill")
            assert [len(h) for h in held] == [n] * tp
            assert sorted(h for hs in held for h in hs) == sorted(list(range(kv)) * copies)


def test_the_two_block_rules_are_both_kept_and_differ_only_where_documented():
    """KVSizing rounds the prompt, then windows; the held bytes window, then round. Mistral's
    4096-token window with 1000-token blocks and a 4100-token prompt: 4096 vs 5000 tokens."""
    m, bf16 = PRESETS["mistral-7b-v0.1"], DTYPES["bf16"]
    assert KVSizing(m, bf16, 4100, block_size=1000).payload_bytes == 32 * 4096 * 4096
    assert m.held_bytes(4100, bf16, block_size=1000) == 32 * 5000 * 4096
    for block in (1, 16, 256, 4096):  # a block size dividing the window: one answer
        for tokens in TOKENS:
            assert KVSizing(m, bf16, tokens, block_size=block).payload_bytes == m.held_bytes(
                tokens, bf16, block_size=block)


def test_the_page_plan_counts_blocks_with_the_calculator():
    m = PRESETS["mistral-7b-v0.1"]
    for tokens in TOKENS:
        for block in (1, 16, 1000):
            for layer in (0, 31):
                want = math.ceil(min(tokens, 4096) / block)
                assert cut.layer_blocks(m, tokens, block, layer) == want == m.layer_blocks(tokens, block, layer)
    assert aligned_tokens(17, 16) == 32 and aligned_tokens(17, None) == 17


def test_the_allocated_tensors_are_the_calculated_bytes():
    """The p2p cache's contiguous backing is exactly the calculator's bytes (a small model
    with a sliding window, so both the full and the windowed layers are allocated)."""
    torch = pytest.importorskip("torch")
    from kvbench.p2p.layout import KVCache, KVSpec

    small = ModelSpec("tiny", 5, 4, 8, "gqa", sliding_window=6, sliding_layers=2)
    mla = ModelSpec("tiny-mla", 3, 1, 0, "mla", kv_lora_rank=12, qk_rope_head_dim=4)
    for m in (small, mla):
        for tokens in (1, 6, 7, 30):
            for heads in ([0], list(range(m.n_heads))):
                spec = KVSpec(m, DTYPES["bf16"], tokens, heads)
                cache = KVCache(spec)
                assert cache.nbytes == spec.payload_bytes == m.held_bytes(tokens, DTYPES["bf16"], len(heads))
                assert sum(t.numel() for t in cache.tensors) * 2 == spec.payload_bytes
    assert torch.cuda.is_available() in (True, False)


def test_the_model_and_plan_commands_print_the_calculators_bytes():
    """What users read: `kvbench model` and `kvbench plan` JSON against first principles."""
    out = subprocess.run([sys.executable, "-m", "kvbench", "model", "--format", "json",
                          "--model", "llama-3.1-8b", "--prompt-tokens", "300,4100",
                          "--block-size", "16", "--tp", "4"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for row, tokens in zip(json.loads(out.stdout), (300, 4100), strict=True):
        assert row["bytes_per_token"] == 131_072
        assert row["kv_bytes"] == sizing_payload("llama-3.1-8b", 2, tokens, 16)
        assert row["sizing"]["tp_shard"]["bytes_per_rank"] == row["kv_bytes"] // 4
    out = subprocess.run([sys.executable, "-m", "kvbench", "plan", "--format", "json", "--gbps", "25",
                          "--setup-ms", "1", "--model", "deepseek-v3", "--prompt-tokens", "5000"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["rows"][0]
    assert row["kv_bytes"] == sizing_payload("deepseek-v3", 2, 5000, None) == 61 * 576 * 2 * 5000
    assert row["bandwidth_floor_ms"] == round(row["kv_bytes"] / 25e9 * 1e3, 6)


def test_the_calculator_imports_no_torch_and_nothing_above_it():
    code = ("import sys, kvbench.kv.geometry, kvbench.kv.cut, kvbench.kv.shards; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('kvbench.model', "
            "'kvbench.p2p', 'kvbench.plan', 'kvbench.fit'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
