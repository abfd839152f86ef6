"""The fields of a Hugging Face `config.json` that decide a model's KV-cache size.

Other fields are kept unread (configs carry dozens). A value kvbench reads must be an
integer within physical bounds; where two values must agree (kv heads dividing attention
heads, one `layer_types` entry per layer) the file is refused with one line, because a
silently wrong geometry gives a silently wrong byte count.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from kvbench.errors import UsageError
from kvbench.records.schema.read import MiB, load_json
from kvbench.records.schema.types import (
    MAX_LAYERS,
    MAX_TEXT,
    MAX_TOKENS,
    MAX_WIDTH,
    Heads,
    Layers,
    Open,
    Width,
    parse,
    refuse,
)

MAX_CONFIG_BYTES = 16 * MiB  # real configs are a few KB

LayerCount = Annotated[int, Field(ge=0, le=MAX_LAYERS)]
WidthOrZero = Annotated[int, Field(ge=0, le=MAX_WIDTH)]
Window = Annotated[int, Field(ge=0, le=MAX_TOKENS)]  # 0 or null: no window


class HFConfig(Open):
    num_hidden_layers: Layers
    num_attention_heads: Heads
    num_key_value_heads: Heads | None = None
    hidden_size: WidthOrZero | None = None
    head_dim: Width | None = None
    intermediate_size: WidthOrZero | None = None
    ffn_dim: WidthOrZero | None = None
    kv_lora_rank: WidthOrZero | None = None
    qk_rope_head_dim: WidthOrZero | None = None
    sliding_window: Window | None = None
    use_sliding_window: bool | None = None
    max_window_layers: LayerCount | None = None
    sliding_window_pattern: Annotated[int, Field(ge=1, le=MAX_LAYERS)] | None = None
    layer_types: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=MAX_LAYERS)
    name_or_path: Annotated[str, Field(max_length=MAX_TEXT)] | None = Field(None, alias="_name_or_path")
    model_type: Annotated[str, Field(max_length=MAX_TEXT)] | None = None

    @model_validator(mode="after")
    def _consistent(self):
        kv, heads = self.kv_heads, self.num_attention_heads
        if heads % kv:
            raise refuse(f"num_key_value_heads {kv} does not divide num_attention_heads {heads} "
                         "(each KV head serves a whole group of attention heads)")
        if not self.is_mla and self.head_dim is None:
            if not self.hidden_size or self.hidden_size % heads:
                raise refuse(f"no head_dim, and hidden_size {self.hidden_size} is not a positive "
                             f"multiple of num_attention_heads {heads}")
        if self.is_mla and not (self.kv_lora_rank and self.qk_rope_head_dim):
            raise refuse("an MLA config (kv_lora_rank) needs kv_lora_rank and qk_rope_head_dim > 0")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise refuse(f"layer_types has {len(self.layer_types)} entries for "
                         f"{self.num_hidden_layers} layers (num_hidden_layers)")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def is_mla(self) -> bool:
        return bool(self.kv_lora_rank)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or (self.hidden_size or 0) // self.num_attention_heads


def load_hf_config_file(path) -> tuple[HFConfig, dict]:
    """The checked config and the raw mapping it came from (nested text_config merged)."""
    raw = load_json(path, MAX_CONFIG_BYTES, "model config", missing="model config not found")
    where = str(path)
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a JSON object")
    prefix = ""
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), dict):
        raw, prefix = {**raw, **raw["text_config"]}, "text_config"  # multimodal configs nest it
    return parse(HFConfig, raw, where, prefix), raw

