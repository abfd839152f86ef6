"""Helpers the plan tests share: `kvbench plan` and `plan export` in-process, and the fit files
and KV-sized p2p records to plan from."""

from __future__ import annotations

import json

from kvbench.model import PRESETS
from kvbench.plan import cli as kvplan
from tests.conftest import run_cli
from tests.helpers import SPEC, rounds_records, run, write_jsonl

LLAMA8B = PRESETS["llama-3.1-8b"]


def fit_file(tmp_path, setup_ms=1.0, effective_gb_s=10.0, name="fit.json", groups=1):
    doc = {"schema": "kvbench.fit/1", "groups": [
        {"label": f"link {i}", "group": {"transport": "nixl", "hosts": ["a", "b"], "n": str(i)},
         "setup_ms": setup_ms, "setup_ms_ci95": [setup_ms * 0.5, setup_ms * 1.5],
         "effective_gb_s": effective_gb_s, "effective_gb_s_ci95": [effective_gb_s * 0.9, effective_gb_s * 1.1],
         # a valid kvbench fit group (kvbench.records.schema.fit): at least one measured size
         "n_samples": 20, "n_sizes": 1, "sizes": [{"bytes": 1 << 30, "n": 20}],
         "warnings": []} for i in range(groups)]}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def export(*args) -> tuple[int, str, str]:
    """`kvbench plan export ARGS` in-process: (exit status, stdout, stderr)."""
    return run(kvplan.cli, "export", *args)


BPT_8B = 131_072  # 32 layers x 8 kv heads x 128 x 2 (K,V) x 2 bytes


def run_json(*args: str):
    res = run_cli("kvbench.plan", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def bad(*args: str, prog="kvbench plan") -> str:
    res = run_cli("kvbench.plan", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:"), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    return lines[0]


def make_fit(tmp_path, records, name="run", *args: str) -> str:
    src = write_jsonl(tmp_path / f"{name}.jsonl", records)
    out = tmp_path / f"{name}.fit.json"
    res = run_cli("kvbench.fit", str(src), "--out", str(out), "--bootstrap", "300", *args)
    assert res.returncode == 0, res.stderr
    return str(out)


def kv_records(tokens, setup, gb_s, seed=0, **kw):
    """Records as a p2p run with --sizes would write them (interleaved rounds): payloads are
    exact KV sizes."""
    model = {"name": LLAMA8B.name, **LLAMA8B.geometry()}
    spec = {**SPEC, "layout": "contiguous", "dtype": "bf16", "model": LLAMA8B.name}
    recs = rounds_records([t * BPT_8B for t in tokens], setup, gb_s, seed=seed, spec=spec,
                          layout="contiguous", dtype="bf16", model=model, **kw)
    for rec, t in zip(recs, tokens, strict=True):
        rec["prompt_tokens"] = t
    return recs


POOL = 2 << 30  # 2 ranks x 1 GiB mounted


def export_text(fit: str, *args: str) -> str:
    """`kvbench plan export --fit FIT --model llama-3.1-8b ARGS`'s stdout (asserting exit 0)."""
    res = run_cli("kvbench.plan", "export", "--fit", fit, "--model", "llama-3.1-8b", *args)
    assert res.returncode == 0, res.stderr
    return res.stdout
