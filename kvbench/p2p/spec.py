"""The p2p side of the spec: `kvbench p2p` builds each record's HandoffSpec (the one class,
kvbench.records.schema.p2p, where what belongs in a spec is said) from the entries every
record of the run shares (`run_entries`) and the ones its pattern decides
(kvbench.p2p.patterns.base.SpecEntries), so this module never knows a pattern's own keys."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from kvbench.model import PRESETS
from kvbench.records.schema.p2p import HandoffSpec, canonical_json

if TYPE_CHECKING:  # (the patterns pull in torch; the spec's builder does not need it)
    from kvbench.p2p.patterns.base import SpecEntries


def model_key(name: str, geometry: dict, preset_geometry: dict | None) -> str:
    """The model's name when it is a preset with the preset's geometry; otherwise the name plus
    8 hex digits of its geometry, so two configs sharing a `model_type` are never pooled.
    (Where the geometry came from, `name` and `source`, does not change what is measured.)"""
    def shape(g: dict) -> dict:
        return {k: v for k, v in g.items() if k not in ("name", "source")}

    if preset_geometry is not None and shape(preset_geometry) == shape(geometry):
        return name
    return f"{name}#{hashlib.sha256(canonical_json(shape(geometry)).encode()).hexdigest()[:8]}"


def run_entries(args, hosts: list[str], device: str, model, dtype, transport, raw: bool) -> dict:
    """The spec entries every record of the run shares (`raw`: --bytes, no model's KV)."""
    return {
        "transport": type(transport).name, "transport_options": transport.spec_options(),
        "layout": "raw" if raw else args.layout, "device": device, "hosts": hosts,
        "block_size": args.block_size if args.layout == "paged" and not raw else None,
        "dtype": None if raw else dtype.name,
        "model": None if raw else model_key(model.name, model.geometry(),
                                            PRESETS[model.name].geometry()
                                            if model.name in PRESETS else None),
    }


def make_spec(common: dict, pattern: str, entries: SpecEntries) -> HandoffSpec:
    """A record's frozen 'what was measured' (everything but the payload size): the run's
    entries, its pattern's name, and the entries its pattern decided. A point's own block
    size (a block-size sweep) replaces the run's where the run is paged."""
    if common["block_size"] is not None and entries.block_size is not None:
        common = {**common, "block_size": entries.block_size}
    return HandoffSpec.build(**common, pattern=pattern, variant=entries.variant, cut=entries.cut,
                             granularity=entries.granularity, pack_kernel=entries.pack_kernel,
                             world={"size": len(common["hosts"]),
                                    "prefill_ranks": entries.prefill_ranks,
                                    "decode_ranks": entries.decode_ranks},
                             compute=entries.compute, layer_poll=entries.layer_poll)
