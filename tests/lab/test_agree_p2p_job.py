"""`kvbench lab agree`'s p2p job without a lab: `agree_p2p.run_job` runs its configurations
as one real MPI job through `kvbench p2p --cases` (the engine-shaped NIXL handoff on a tiny
model, ranks unpinned) and leaves in the run folder the cases file and the records, no code."""

from __future__ import annotations

import json

import pytest

from kvbench.lab.agree import p2p as agree_p2p
from kvbench.p2p.transports.nixl import binding as nixl_import
from tests.conftest import ROOT

HAVE_NIXL = nixl_import.import_nixl()[0] is not None
TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable: pip install 'kvbench[nixl]'")
def test_run_job_records_every_configuration_and_leaves_no_code(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the job imports this checkout's kvbench
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY))
    base = agree_p2p.base_flags(model, 16, 32, 3, 1000)  # 2 blocks of 16 tokens, 3 handoffs
    cfgs = {"engine": "", "off:threads": agree_p2p.FEATURES["threads"][0]}
    folder, log = tmp_path / "p2p" / "rep1", tmp_path / "p2p.log"
    got = agree_p2p.run_job(folder, base, cfgs, None, {}, log, 300)
    assert set(got) == set(cfgs)
    assert all(r is not None and r["wrong"] == 0 and r["n_samples"] == 3 for r in got.values()), \
        log.read_text()[-3000:]
    assert got["off:threads"]["spec"]["transport_options"] != got["engine"]["spec"]["transport_options"]
    assert [ln.split(" in ")[0] for ln in log.read_text().splitlines() if ln.startswith("case ")] \
        == ["case 1/2: exit 0", "case 2/2: exit 0"], log.read_text()[-3000:]
    kept = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert "cases-free.txt" in kept and not [p for p in kept if p.endswith(".py")], kept
    assert all(p == "cases-free.txt" or p.split("/")[0] in cfgs for p in kept), kept
