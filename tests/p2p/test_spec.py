"""HandoffSpec: the frozen 'what was measured', its id, and that no option hides from it."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from kvbench.model import PRESETS
from kvbench.p2p.spec import model_key
from kvbench.records.schema.p2p import HandoffSpec, spec_id_of

BASE = dict(transport="mpi", pattern="sequential", granularity="whole", layout="contiguous",
            device="cpu", world={"size": 2, "prefill_ranks": [0], "decode_ranks": [1]},
            hosts=["a", "a"], dtype="bf16", model="seed-70b-gqa")


def test_spec_id_is_sha256_of_the_canonical_json():
    s = HandoffSpec.build(**BASE)
    d = s.as_dict()
    want = hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert s.spec_id == want[:12] == spec_id_of(json.loads(json.dumps(d)))
    assert set(d) == {"transport", "transport_options", "pattern", "variant", "granularity",
                      "layout", "block_size", "dtype", "device", "pack_kernel", "model",
                      "compute", "layer_poll", "world", "hosts"}


@pytest.mark.parametrize("change", [
    {"transport_options": {"batch": "handoff"}}, {"pack_kernel": "cuda"},
    {"compute": {"layer_compute": "ms", "layer_compute_ms": 2.0, "compute_threads": 1}},
    {"layer_poll": False}, {"variant": "xfer"}, {"hosts": ["a", "b"]}, {"block_size": 32},
    {"world": {"size": 2, "prefill_ranks": [1], "decode_ranks": [0]}}, {"device": "cuda"},
])
def test_every_option_changes_the_id(change):
    assert HandoffSpec.build(**{**BASE, **change}).spec_id != HandoffSpec.build(**BASE).spec_id


def test_spec_is_frozen_and_checked():
    s = HandoffSpec.build(**BASE)
    with pytest.raises(ValidationError, match="frozen"):
        s.transport = "gloo"
    with pytest.raises(ValueError, match="layout"):
        HandoffSpec.build(**{**BASE, "layout": "ragged"})
    with pytest.raises(ValueError, match="one host per rank"):
        HandoffSpec.build(**{**BASE, "hosts": ["a"]})
    with pytest.raises(ValueError, match="scalar"):
        HandoffSpec.build(**{**BASE, "transport_options": {"x": [1]}})


def test_model_key_names_presets_and_hashes_custom_geometry():
    g = PRESETS["llama-3.1-8b"].geometry()
    assert model_key("llama-3.1-8b", g, g) == "llama-3.1-8b"
    other = {**g, "layers": 2}
    k = model_key("llama-3.1-8b", other, g)
    assert k.startswith("llama-3.1-8b#") and len(k) == len("llama-3.1-8b#") + 8
    assert model_key("tiny", other, None) != model_key("tiny", {**other, "hidden_size": 1}, None)
    # the same shape loaded from a config file (other source) is the preset
    assert model_key("llama-3.1-8b", {**g, "source": "/x/config.json"}, g) == "llama-3.1-8b"
    assert model_key("t", {**other, "source": "/a"}, None) == model_key("t", {**other, "source": "/b"}, None)
