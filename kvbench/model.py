"""Model presets, Hugging Face configs and the transfer model (the tutorial's artifact).

The KV geometry (bytes per token, scales, paged blocks, TP shards) is kvbench.kv.geometry's,
the one calculator every layer sizes with; its names are re-exported here, where users and
older code import them:

    KV_bytes           = 2 x layers x kv_heads x head_dim x bytes_per_element x tokens   (MHA/GQA)
                       = layers x (kv_lora_rank + qk_rope_head_dim) x bytes x tokens     (MLA)
    bandwidth_floor_ms = KV_bytes / (GB/s x 1e9) x 1000
    handoff_floor_ms   = setup_ms + bandwidth_floor_ms

May import: kvbench.units, kvbench.errors, kvbench.cli, kvbench.records, kvbench.tutorial,
kvbench.kv (the geometry sits below this module). Run `python -m kvbench.model --help`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvbench.cli import (
    FORMAT_HELP,
    ArgumentParser,
    UsageError,
    arg_int,
    non_negative_float,
    output_format,
    parse_positive_floats,
    parse_positive_ints,
    run_main,
)
from kvbench.kv.geometry import (  # noqa: F401  (re-exported: the geometry's old home)
    DTYPES,
    SCALE_DTYPES,
    SCALE_MODES,
    DType,
    KVSizing,
    ModelSpec,
    get_dtype,
)
from kvbench.records.schema.types import MAX_GBPS, MAX_TOKENS, MIN_GBPS
from kvbench.tutorial import floor_table_labels
from kvbench.units import GiB, MiB, handoff_ms, round_places, transfer_ms

MAX_SETUP_MS = 1e7  # ~2.8 hours: a setup cost beyond it is a typo
MAX_BUDGET_MS = 1e9
MAX_TP = 65_536

# Checked against each model's public config.json (Hugging Face hub, model card revision
# current in 2026): num_hidden_layers, num_key_value_heads, head_dim / hidden_size, MLA fields.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # The tutorial's hypothetical 70B-class GQA model: 327,680 bytes/token in BF16.
        ModelSpec("seed-70b-gqa", 80, 8, 128, "gqa", num_attention_heads=64, hidden_size=8192,
                  intermediate_size=28672),
        ModelSpec("llama-3.1-8b", 32, 8, 128, "gqa", num_attention_heads=32, hidden_size=4096,
                  intermediate_size=14336),
        ModelSpec("llama-3.1-70b", 80, 8, 128, "gqa", num_attention_heads=64, hidden_size=8192,
                  intermediate_size=28672),
        # Qwen2.5-72B ships sliding_window fields but use_sliding_window=false: all layers full.
        ModelSpec("qwen2.5-72b", 80, 8, 128, "gqa", num_attention_heads=64, hidden_size=8192,
                  intermediate_size=29568),
        # OPT-66B: full multi-head attention, 72 heads x 128 = hidden 9216.
        ModelSpec("opt-66b", 64, 72, 128, "mha", num_attention_heads=72, hidden_size=9216,
                  intermediate_size=36864),
        # DeepSeek-V3: MLA caches one 512-wide latent plus a 64-wide RoPE key per token/layer.
        ModelSpec("deepseek-v3", 61, 1, 576, "mla", kv_lora_rank=512, qk_rope_head_dim=64,
                  num_attention_heads=128, hidden_size=7168, intermediate_size=18432),
        # Mistral-7B-v0.1: every layer uses a 4096-token sliding window.
        ModelSpec("mistral-7b-v0.1", 32, 8, 128, "gqa", sliding_window=4096, sliding_layers=32,
                  num_attention_heads=32, hidden_size=4096, intermediate_size=14336),
    )
}
DEFAULT_MODEL = "seed-70b-gqa"


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a local Hugging Face config.json into a ModelSpec (no network access).

    The file goes through kvbench.records.schema (bounded JSON, typed fields, physical bounds), so
    a malformed value is one line naming the key, never a traceback or a wrong size.
    """
    from kvbench.records.schema.hf_config import load_hf_config_file

    cfg, raw = load_hf_config_file(path)
    p = Path(path)
    name = cfg.name_or_path or cfg.model_type or p.parent.name or p.stem
    common = dict(num_attention_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size or 0,
                  intermediate_size=cfg.intermediate_size or cfg.ffn_dim or 0, source=str(p))
    if cfg.is_mla:
        return ModelSpec(str(name), cfg.num_hidden_layers, 1, 0, "mla", kv_lora_rank=cfg.kv_lora_rank,
                         qk_rope_head_dim=cfg.qk_rope_head_dim, **common)
    window, sliding = _sliding_window(cfg)
    kind = "mha" if cfg.kv_heads == cfg.num_attention_heads else "gqa"
    return ModelSpec(str(name), cfg.num_hidden_layers, cfg.kv_heads, cfg.resolved_head_dim, kind,
                     sliding_window=window, sliding_layers=sliding, **common)


def _sliding_window(cfg) -> tuple[int | None, int]:
    """How many layers keep only a window, from the several ways configs say it."""
    window, layers = cfg.sliding_window, cfg.num_hidden_layers
    if not window or cfg.use_sliding_window is False:
        return None, 0
    if cfg.layer_types is not None:  # newer configs: one entry per layer
        return window, sum(1 for t in cfg.layer_types if "sliding" in t)
    if cfg.max_window_layers is not None and cfg.use_sliding_window is not None:
        return window, max(0, layers - cfg.max_window_layers)  # Qwen2 style
    if cfg.sliding_window_pattern:  # Gemma style: every Nth layer is global
        return window, layers - layers // cfg.sliding_window_pattern
    return window, layers


def resolve_model(name: str | None = None, config: str | None = None) -> ModelSpec:
    if config:
        return load_hf_config(config)
    name = name or DEFAULT_MODEL
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
                         "(or --model-config PATH to a config.json)") from None


# ---------------------------------------------------------------------------
# the transfer model


@dataclass
class LinkFloor:
    effective_bandwidth_gb_s: float
    bandwidth_floor_ms: float
    handoff_floor_ms: float
    within_budget: bool


def handoff_floor(kv_bytes: int, effective_gb_s: float, setup_ms: float) -> tuple[float, float]:
    """(bandwidth_floor_ms, handoff_floor_ms). effective_gb_s must be a sustained rate
    without setup."""
    return transfer_ms(kv_bytes, effective_gb_s), handoff_ms(setup_ms, kv_bytes, effective_gb_s)


@dataclass
class FloorTableArgs:
    model: ModelSpec
    dtype: DType
    tokens: int
    links_effective_gb_s: list[float] = field(default_factory=lambda: [100.0, 25.0, 10.0])
    setup_ms: float = 1.0
    budget_ms: float = 20.0
    short_prompt_tokens: int = 300
    scale_mode: str = "none"
    scale_dtype: str = "fp32"
    block_size: int | None = None
    tp: int = 1


def _budget_key(budget_ms: float) -> str:
    b = int(budget_ms) if float(budget_ms).is_integer() else str(budget_ms).replace(".", "p")
    return f"floor_within_{b}ms_budget"


def floor_table(a: FloorTableArgs) -> dict:
    """The tutorial's artifact for one prompt length, with the assumptions stated."""
    sizing = KVSizing(a.model, a.dtype, a.tokens, a.scale_mode, a.scale_dtype, a.block_size, a.tp)
    kv = sizing.kv_bytes
    key = _budget_key(a.budget_ms)
    links = []
    for effective_gb_s in a.links_effective_gb_s:
        bw, total = handoff_floor(kv, effective_gb_s, a.setup_ms)
        links.append({
            "effective_bandwidth_gb_s": effective_gb_s,  # the output's name since its first version
            "bandwidth_floor_ms": round_places(bw),
            "setup_ms": a.setup_ms,
            "handoff_floor_ms": round_places(total),
            key: total <= a.budget_ms,
            "within_budget": total <= a.budget_ms,
        })
    slow = min(a.links_effective_gb_s)
    short = replace(sizing, tokens=a.short_prompt_tokens)
    _, short_total = handoff_floor(short.kv_bytes, slow, a.setup_ms)
    out = {
        "scope": ("lower bound on one prefill->decode KV handoff: setup plus bytes at a "
                  "sustained effective rate; excludes queueing, contention, serialization "
                  "and retries"),
        "model": a.model.name,
        "geometry": {k: v for k, v in a.model.geometry().items() if v not in (None, 0, "")},
        "dtype": a.dtype.name,
        "bytes_per_token": a.model.bytes_per_token(a.dtype),
        "prompt_tokens": a.tokens,
        "kv_bytes": kv,
        "kv_mib": round_places(kv / MiB),
        "kv_gib": round_places(kv / GiB),
        "setup_ms": a.setup_ms,
        "budget_ms": a.budget_ms,
        "links": links,
        "broken_short_prompt_case": {
            "prompt_tokens": a.short_prompt_tokens,
            "kv_bytes": short.kv_bytes,
            "effective_bandwidth_gb_s": slow,
            "handoff_floor_ms": round_places(short_total),
        },
        "sizing": sizing.summary(),
        "assumptions": [
            "effective_bandwidth_gb_s is a sustained payload rate (decimal GB/s) that excludes setup",
            "a rate measured end to end already contains setup: do not add setup_ms to it again",
            "a link's peak spec is not an effective rate; measure it (python -m kvbench.p2p, then fit)",
        ],
        # every value printed here that nothing measured, the tutorial's named as such
        "not_measured": floor_table_labels(a.model.name, a.links_effective_gb_s, a.setup_ms,
                                           a.budget_ms, a.short_prompt_tokens),
    }
    if a.model.sliding_layers:
        out["assumptions"].append(
            f"{a.model.sliding_layers} of {a.model.layers} layers keep only a "
            f"{a.model.sliding_window}-token sliding window")
    if a.dtype.quantized:
        bf16 = KVSizing(a.model, DTYPES["bf16"], a.tokens, block_size=a.block_size).kv_bytes
        out["quantized_kv"] = {
            "payload_vs_bf16": round_places(sizing.payload_bytes / bf16),
            "scale_mode": a.scale_mode,
            "scale_dtype": a.scale_dtype if a.scale_mode != "none" else None,
            "scale_bytes_added": sizing.scale_bytes,
            "a_real_fp8_kv_needs": [
                "scales that travel with the KV (per tensor, per layer and head, or per token and head)",
                "block-aligned allocation so scales and pages line up (see --block-size)",
                "an accuracy check against the BF16 baseline on your own prompts before adopting it",
            ],
        }
    return out


# ---------------------------------------------------------------------------
# CLI

DEFAULT_PROMPT_TOKENS = 2000  # model's and plan's prompt length when none is given
DEFAULT_LINKS_GBPS = "100,25,10"
DEFAULT_BUDGET_MS = "20"  # model's and plan's handoff budget
# One spelling per idea across commands (kvbench model, plan, plan route): the prompt lengths
# as kvbench p2p spells them (--sizes) or --prompt-tokens; a link rate --gbps or --links-gbps.
TOKENS_FLAGS = ("--prompt-tokens", "--sizes")
RATE_FLAGS = ("--gbps", "--links-gbps")

_EPILOG = """\
examples:
  python -m kvbench.model                          # the tutorial's fixed example, as JSON
  python -m kvbench.model --prompt-tokens 300,2000,8192 --format table
  python -m kvbench.model --model llama-3.1-8b --dtype fp8_e4m3 --scale-mode per-token-per-head
  python -m kvbench.model --model-config ./config.json --tp 4
"""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kvbench model",
        description="KV-cache size of a model and the handoff floor it implies on given links:\n"
                    "handoff_floor_ms = setup_ms + KV_bytes / (GB/s x 1e9) x 1000.",
        epilog=_EPILOG,
    )
    p.add_argument("--model", default=None, help=f"preset name (default {DEFAULT_MODEL}); "
                   f"one of {', '.join(PRESETS)}")
    p.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json")
    p.add_argument("--dtype", default="bf16", help=f"KV element type: {', '.join(DTYPES)}")
    p.add_argument(*TOKENS_FLAGS, dest="prompt_tokens", default=None, metavar="N[,N...]",
                   help=f"prompt length(s) in tokens (default {DEFAULT_PROMPT_TOKENS}; a list "
                        "prints one object each)")
    p.add_argument(*RATE_FLAGS, dest="links_gbps", default=DEFAULT_LINKS_GBPS, metavar="R[,R...]",
                   help="sustained effective link rates in decimal GB/s (default %(default)s)")
    p.add_argument("--setup-ms", default="1.0", help="per-handoff setup cost in ms (default %(default)s)")
    p.add_argument("--budget-ms", default=DEFAULT_BUDGET_MS,
                   help="handoff budget in ms (default %(default)s)")
    p.add_argument("--short-prompt-tokens", type=arg_int(1, MAX_TOKENS), default=300,
                   help="prompt length of the short-prompt case (default 300), at the slowest link")
    p.add_argument("--scale-mode", default="none", choices=SCALE_MODES,
                   help="FP8/INT8 scale overhead (default none)")
    p.add_argument("--scale-dtype", default="fp32", choices=list(SCALE_DTYPES))
    p.add_argument("--block-size", type=arg_int(1, MAX_TOKENS), default=None,
                   help="paged block size in tokens: allocation is rounded up to whole blocks")
    p.add_argument("--tp", type=arg_int(1, MAX_TP), default=1,
                   help="tensor-parallel size: report bytes per rank")
    p.add_argument("--format", choices=("json", "table"), default=None, help=FORMAT_HELP)
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (never overwrites)")
    return p


def format_table(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r['model']} {r['dtype']}: {r['prompt_tokens']} tokens x "
                     f"{r['bytes_per_token']:,} B/token = {r['kv_bytes']:,} B "
                     f"({r['kv_mib']:.1f} MiB), setup {r['setup_ms']} ms, budget {r['budget_ms']} ms")
        lines.append(f"  {'link GB/s':>10} {'bw floor ms':>12} {'setup ms':>9} "
                     f"{'handoff ms':>11}  within budget")
        for link in r["links"]:
            lines.append(f"  {link['effective_bandwidth_gb_s']:>10g} {link['bandwidth_floor_ms']:>12.4f} "
                         f"{link['setup_ms']:>9g} {link['handoff_floor_ms']:>11.4f}  "
                         f"{'yes' if link['within_budget'] else 'no'}")
        s = r["broken_short_prompt_case"]
        lines.append(f"  short prompt: {s['prompt_tokens']} tokens at {s['effective_bandwidth_gb_s']:g} GB/s"
                     f" -> {s['handoff_floor_ms']:.4f} ms")
        if "quantized_kv" in r:
            q = r["quantized_kv"]
            lines.append(f"  quantized KV: {q['payload_vs_bf16']:.2f}x the BF16 payload, "
                         f"+{q['scale_bytes_added']:,} B of scales ({q['scale_mode']})")
        shard = r["sizing"].get("tp_shard")
        if shard:
            lines.append(f"  TP {shard['tp']}: {shard['bytes_per_rank']:,} B per rank"
                         + (f" ({shard['note']})" if shard["note"] else ""))
        lines += [f"  not measured: {label}" for label in r["not_measured"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = resolve_model(args.model, args.model_config)
    dtype = get_dtype(args.dtype)
    tokens = ([DEFAULT_PROMPT_TOKENS] if args.prompt_tokens is None
              else parse_positive_ints(args.prompt_tokens, "--prompt-tokens", MAX_TOKENS))
    links = parse_positive_floats(args.links_gbps, "--links-gbps", MIN_GBPS, MAX_GBPS)
    setup = non_negative_float(args.setup_ms, "--setup-ms", MAX_SETUP_MS)
    budget = parse_positive_floats(args.budget_ms, "--budget-ms", hi=MAX_BUDGET_MS)[0]
    if args.out:
        from kvbench.records.write import check_new_file

        check_new_file(args.out)
    results = [
        floor_table(FloorTableArgs(model, dtype, t, links, setup, budget,
                                         args.short_prompt_tokens, args.scale_mode,
                                         args.scale_dtype, args.block_size, args.tp))
        for t in tokens
    ]
    payload = results[0] if args.prompt_tokens is None else results
    from kvbench.records.write import dumps_json, write_new_file

    text = dumps_json(payload)
    if args.out:
        write_new_file(Path(args.out), text + "\n")
    print(format_table(results) if output_format(args.format) == "table" else text)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    return run_main("kvbench model", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
