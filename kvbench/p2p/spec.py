"""The frozen description of *what* a p2p record measured, apart from the measurement.

Every record carries its `HandoffSpec` (as `spec`) and the spec's short hash (`spec_id`).
Records with the same spec_id are replicates of one configuration and may be merged (the
fit's group key); records with different ones must never be pooled. So every option that
changes what is measured belongs here: transport and its options, pattern and variant,
granularity, layout, block size, dtype, device, pack kernel, the layerwise compute settings
and polling, the world's roles and hosts, and for the page plan the cut (K/V pages, block
ids, TP pair: kvbench.kv.cut). The payload size is not in it: it is the x of a fit.

Not in it, on purpose: how the samples were taken (`order`, iteration counts, warm-up),
which is recorded beside it and does not change the quantity being estimated.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

LAYOUTS = ("contiguous", "paged", "raw")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def spec_id_of(spec: dict) -> str:
    """First 12 hex digits of sha256 over the spec's canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()[:12]


def model_key(name: str, geometry: dict, preset_geometry: dict | None) -> str:
    """The model's name when it is a preset with the preset's geometry; otherwise the name plus
    8 hex digits of its geometry, so two configs sharing a `model_type` are never pooled.
    (Where the geometry came from, `name` and `source`, does not change what is measured.)"""
    def shape(g: dict) -> dict:
        return {k: v for k, v in g.items() if k not in ("name", "source")}

    if preset_geometry is not None and shape(preset_geometry) == shape(geometry):
        return name
    return f"{name}#{hashlib.sha256(canonical_json(shape(geometry)).encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class HandoffSpec:
    transport: str
    pattern: str
    granularity: str
    layout: str
    device: str
    world: dict  # {"size": int, "prefill_ranks": [int], "decode_ranks": [int]}
    hosts: list[str]
    transport_options: dict = field(default_factory=dict)  # scalars only
    variant: str | None = None
    block_size: int | None = None
    dtype: str | None = None
    pack_kernel: str | None = None
    model: str | None = None
    compute: dict | None = None
    layer_poll: bool | None = None
    cut: dict | None = None  # the page plan's cut (kvbench.kv.cut); absent otherwise

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for k, v in self.transport_options.items():
            if not isinstance(v, (str, int, float, bool)) and v is not None:
                raise ValueError(f"transport option {k!r} must be a scalar, got {type(v).__name__}")
        if set(self.world) != {"size", "prefill_ranks", "decode_ranks"}:
            raise ValueError(f"world needs size, prefill_ranks, decode_ranks; got {sorted(self.world)}")
        if len(self.hosts) != self.world["size"]:
            raise ValueError(f"one host per rank: {len(self.hosts)} hosts, {self.world['size']} ranks")

    def as_dict(self) -> dict:
        d = asdict(self)
        if d["cut"] is None:  # specs without a cut keep the ids they always had
            del d["cut"]
        d["hosts"] = list(self.hosts)
        d["world"] = {k: (list(v) if isinstance(v, (list, tuple)) else v)
                      for k, v in self.world.items()}
        return d

    @property
    def spec_id(self) -> str:
        return spec_id_of(self.as_dict())
