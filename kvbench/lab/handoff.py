"""The engine's handoff against kvbench's model of the same link.

Before the sweep the lab measures the same machine's NIXL path with kvbench itself
(`mpirun -n 2 kvbench p2p --transport nixl --nixl-op read`, the tiny model's KV
geometry, paged blocks of the engine's block size) and fits `setup + bytes/GB/s`
(`kvbench fit`, a kvbench.fit/2 document with joint bootstrap draws). During each
disaggregated run `kvbench slo scrape` records the decode instance's NIXL histograms, and
`kvbench slo analyze --metrics ... --fit` puts the engine's mean per-transfer time beside
the fitted model at the engine's mean bytes per transfer (read through
`kvbench.plan.links_from_fit`, with `Link.band` for the model's 95% band) and gives the
ratio: > 1 means the engine pays more than the microbenchmark predicts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

P2P_TOKENS = "128,256,512,1024,2048"
ENGINE_BLOCK_TOKENS = 128  # vLLM's CPU block size for this model (seen in its NIXL descriptors)


def mpirun() -> str:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else (shutil.which("mpirun") or "mpirun")


def p2p_cmd(model_config: Path, out_dir: Path) -> list[str]:
    return [mpirun(), "-n", "2", sys.executable, "-m", "kvbench.p2p", "--transport", "nixl",
            "--nixl-op", "read", "--no-nixl-progress-thread", "--model-config", str(model_config),
            "--dtype", "bf16", "--layout", "paged", "--block-size", str(ENGINE_BLOCK_TOKENS),
            "--sizes", P2P_TOKENS, "--iters", "40", "--out", str(out_dir), "--quiet"]


def reference_fit(model_dir: Path, out_dir: Path, log: Path) -> Path:
    """Run the p2p + fit once into out_dir (kept for resume); returns the fit JSON path."""
    fit = out_dir / "nixl-reference.fit.json"
    if fit.exists():
        return fit
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with open(log, "ab") as fh:
        subprocess.run(p2p_cmd(model_dir / "config.json", out_dir), check=True, env=env,
                       stdout=fh, stderr=subprocess.STDOUT)
        records = sorted(out_dir.glob("kvbench-p2p-*.jsonl"))
        subprocess.run([sys.executable, "-m", "kvbench.fit", *map(str, records), "--out", str(fit)],
                       check=True, stdout=fh, stderr=subprocess.STDOUT)
    return fit
