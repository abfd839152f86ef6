"""Tokens -> bytes: the one KV-geometry calculator every layer of kvbench sizes with.

    KV_bytes = 2 x layers x kv_heads x head_dim x bytes_per_element x tokens   (MHA/GQA)
             = layers x (kv_lora_rank + qk_rope_head_dim) x bytes x tokens     (MLA)

A model's KV per layer is `parts` tensors (K and V; MLA's one latent) of `n_heads` heads
(MLA: one latent "head") of `width` elements per token. Sliding-window layers (the last
`sliding_layers` of them) keep at most `sliding_window` tokens.

Two ways of rounding to paged blocks live here, each named, because two surfaces have
printed them since their first versions and their outputs must not move:

- `KVSizing` (`kvbench model`, `kvbench plan`, the memory checks): the prompt is rounded
  up to whole blocks first, then sliding-window layers keep the window of that.
- `ModelSpec.held_bytes` / `layer_blocks` (the tensors kvbench.p2p allocates, the page
  plan of kvbench.kv.cut): each layer keeps its tokens (the window, for a sliding layer),
  then rounds that up to whole blocks, as a serving engine's block manager does.

They agree unless a sliding window is not a multiple of the block size and the prompt is
longer than the window (no preset and no power-of-two block size does that).

Why here, below kvbench.model: p2p, plan and fit size KV from the same numbers, and
kvbench.kv.cut (below model's CLI and presets) needs the model's types. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvbench.errors import UsageError
from kvbench.records.schema.types import MAX_BYTES, MAX_TOKENS

# ---------------------------------------------------------------------------
# dtypes


@dataclass(frozen=True)
class DType:
    name: str
    bytes: int
    torch_name: str
    quantized: bool = False  # FP8/INT8 need scales to be usable


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bf16", 2, "bfloat16"),
        DType("fp16", 2, "float16"),
        DType("fp32", 4, "float32"),
        DType("fp8_e4m3", 1, "float8_e4m3fn", quantized=True),
        DType("fp8_e5m2", 1, "float8_e5m2", quantized=True),
        DType("int8", 1, "int8", quantized=True),
    )
}

SCALE_MODES = ("none", "per-tensor", "per-layer-per-head", "per-token-per-head")
SCALE_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}


def get_dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}") from None


def aligned_tokens(tokens: int, block_size: int | None) -> int:
    """Tokens allocated for `tokens`: rounded up to whole blocks when paged (block_size)."""
    if block_size:
        return math.ceil(tokens / block_size) * block_size
    return tokens


def tp_split(kv_heads: int, tp: int) -> tuple[int, int] | None:
    """(heads each TP rank holds, ranks holding each head) for `kv_heads` over `tp` ranks:
    whole heads per rank when TP divides them, one head replicated on TP/K ranks when TP is
    a multiple of them; None when neither (each caller words the refusal with its flag)."""
    if tp <= kv_heads:
        return (kv_heads // tp, 1) if kv_heads % tp == 0 else None
    return (1, tp // kv_heads) if tp % kv_heads == 0 else None


# ---------------------------------------------------------------------------
# model geometry


@dataclass(frozen=True)
class ModelSpec:
    """The parts of a model that decide its KV-cache size (and, roughly, its prefill work)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    attention: str = "gqa"  # "mha", "gqa" or "mla"
    kv_lora_rank: int = 0  # MLA only: compressed latent width
    qk_rope_head_dim: int = 0  # MLA only: decoupled RoPE key width
    sliding_window: int | None = None  # tokens kept by sliding-window layers
    sliding_layers: int = 0  # how many of `layers` use the window
    num_attention_heads: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    source: str = "preset"

    def __post_init__(self):
        if self.layers <= 0:
            raise UsageError(f"model {self.name}: layers must be positive")
        if self.attention == "mla":
            if self.kv_lora_rank + self.qk_rope_head_dim <= 0:
                raise UsageError(f"model {self.name}: MLA needs kv_lora_rank + qk_rope_head_dim > 0")
        elif self.kv_heads <= 0 or self.head_dim <= 0:
            raise UsageError(f"model {self.name}: kv_heads and head_dim must be positive")
        if not 0 <= self.sliding_layers <= self.layers:
            raise UsageError(f"model {self.name}: sliding_layers must be within 0..layers")

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def parts(self) -> int:
        """Tensors per layer: K and V, or MLA's single latent."""
        return 1 if self.is_mla else 2

    @property
    def n_heads(self) -> int:
        """Distinct KV heads a layer's tensor holds (MLA: 1, the latent is not split by heads)."""
        return 1 if self.is_mla else self.kv_heads

    @property
    def width(self) -> int:
        """Elements of one head of one part per token (MLA: the latent plus the RoPE key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def elements_per_token_layer(self) -> int:
        """KV elements one token adds to one layer (K and V together; MLA has one latent)."""
        return self.parts * self.n_heads * self.width

    def bytes_per_token_layer(self, dtype: DType) -> int:
        return self.elements_per_token_layer * dtype.bytes

    def bytes_per_token(self, dtype: DType) -> int:
        """Bytes per token over all layers, ignoring any sliding-window cap."""
        return self.layers * self.bytes_per_token_layer(dtype)

    def tokens_held(self, tokens: int) -> tuple[int, int]:
        """(tokens kept by full layers, tokens kept by sliding-window layers)."""
        if self.sliding_window and self.sliding_layers:
            return tokens, min(tokens, self.sliding_window)
        return tokens, tokens

    def kv_elements(self, tokens: int) -> int:
        full_tok, win_tok = self.tokens_held(tokens)
        full_layers = self.layers - self.sliding_layers
        per = self.elements_per_token_layer
        return per * (full_layers * full_tok + self.sliding_layers * win_tok)

    def kv_bytes(self, tokens: int, dtype: DType) -> int:
        return self.kv_elements(tokens) * dtype.bytes

    def layer_tokens(self, tokens: int, layer: int) -> int:
        """Tokens one layer keeps: sliding-window layers (the last ones) keep the window."""
        if self.sliding_window and layer >= self.layers - self.sliding_layers:
            return min(tokens, self.sliding_window)
        return tokens

    def layer_blocks(self, tokens: int, block_size: int, layer: int) -> int:
        """Blocks of `block_size` tokens a layer's KV takes."""
        return math.ceil(self.layer_tokens(tokens, layer) / block_size)

    def held_bytes(self, tokens: int, dtype: DType, heads: int | None = None,
                   block_size: int | None = None) -> int:
        """Bytes of every (layer, part) tensor for `heads` heads (default all), each layer at
        its kept tokens rounded up to whole blocks when paged (block_size): what a rank holds
        and a handoff moves."""
        heads = self.n_heads if heads is None else heads
        per_token = self.parts * heads * self.width * dtype.bytes
        full, window = self.tokens_held(tokens)
        sliding = self.sliding_layers if self.sliding_window else 0
        return per_token * ((self.layers - sliding) * aligned_tokens(full, block_size)
                            + sliding * aligned_tokens(window, block_size))

    def geometry(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------
# sizing: scales, alignment, tensor parallelism


@dataclass(frozen=True)
class KVSizing:
    """Exact bytes for one prompt, with every overhead spelled out."""

    model: ModelSpec
    dtype: DType
    tokens: int
    scale_mode: str = "none"
    scale_dtype: str = "fp32"
    block_size: int | None = None  # align tokens up to whole paged blocks
    tp: int = 1

    def __post_init__(self):
        if self.scale_mode not in SCALE_MODES:
            raise UsageError(f"unknown scale mode {self.scale_mode!r}; choose from {', '.join(SCALE_MODES)}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise UsageError(f"unknown scale dtype {self.scale_dtype!r}; choose from {', '.join(SCALE_DTYPES)}")
        if self.scale_mode != "none" and not self.dtype.quantized:
            raise UsageError(f"scales apply to fp8/int8 KV, not {self.dtype.name}")
        if self.tokens <= 0:
            raise UsageError("prompt tokens must be positive")
        if self.tp <= 0:
            raise UsageError("tensor-parallel size must be positive")
        if self.tokens > MAX_TOKENS:
            raise UsageError(f"prompt tokens must be at most {MAX_TOKENS:,}, got {self.tokens:,}")
        if self.kv_bytes > MAX_BYTES:
            raise UsageError(f"{self.tokens:,} tokens of {self.model.name} are {self.kv_bytes:.3e} bytes of "
                             f"KV, more than 2^53 B (9 PB): not a payload kvbench can size exactly")

    @property
    def stored_tokens(self) -> int:
        """Tokens actually allocated: rounded up to whole blocks when paged."""
        return aligned_tokens(self.tokens, self.block_size)

    @property
    def payload_bytes(self) -> int:
        return self.model.kv_bytes(self.stored_tokens, self.dtype)

    @property
    def scale_bytes(self) -> int:
        m, sb = self.model, SCALE_DTYPES[self.scale_dtype]
        tensors = m.parts * m.layers  # one K and one V per layer (MLA: one)
        if self.scale_mode == "per-tensor":
            return tensors * sb
        if self.scale_mode == "per-layer-per-head":
            return tensors * m.n_heads * sb
        if self.scale_mode == "per-token-per-head":
            full_tok, win_tok = m.tokens_held(self.stored_tokens)
            per_layer_tokens = (m.layers - m.sliding_layers) * full_tok + m.sliding_layers * win_tok
            return m.parts * m.n_heads * per_layer_tokens * sb
        return 0

    @property
    def kv_bytes(self) -> int:
        return self.payload_bytes + self.scale_bytes

    @property
    def bytes_per_layer(self) -> int:
        full_tok, _ = self.model.tokens_held(self.stored_tokens)
        return self.model.bytes_per_token_layer(self.dtype) * full_tok

    @property
    def bytes_per_block(self) -> int | None:
        if not self.block_size:
            return None
        return self.model.bytes_per_token_layer(self.dtype) * self.block_size

    def tp_shard(self) -> dict:
        """What each tensor-parallel rank holds; heads are replicated when kv_heads < TP."""
        m = self.model
        if m.is_mla:
            return {"tp": self.tp, "heads_per_rank": None, "replicated": self.tp > 1,
                    "note": "MLA latent is not split by heads: every TP rank holds all of it",
                    "bytes_per_rank": self.kv_bytes}
        split = tp_split(m.kv_heads, self.tp)
        if split is None and self.tp <= m.kv_heads:
            raise UsageError(f"TP {self.tp} does not divide kv_heads {m.kv_heads}")
        if split is None:
            raise UsageError(f"TP {self.tp} is not a multiple of kv_heads {m.kv_heads}")
        heads, copies = split
        replicated = copies > 1  # TP above kv_heads: each head on several ranks
        note = (f"kv_heads {m.kv_heads} < TP {self.tp}: each head replicated on {copies} ranks"
                if replicated else "")
        return {"tp": self.tp, "heads_per_rank": heads, "replicated": replicated, "note": note,
                "bytes_per_rank": self.kv_bytes * heads // m.kv_heads}

    def summary(self) -> dict:
        out = {
            "bytes_per_token": self.model.bytes_per_token(self.dtype),
            "bytes_per_layer": self.bytes_per_layer,
            "bytes_per_block": self.bytes_per_block,
            "stored_tokens": self.stored_tokens,
            "payload_bytes": self.payload_bytes,
            "scale_bytes": self.scale_bytes,
        }
        if self.tp > 1:
            out["tp_shard"] = self.tp_shard()
        return out
