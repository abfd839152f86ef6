"""The engine's handoff against kvbench's model of the same link.

Before the sweep the lab measures the same machine's NIXL path with kvbench itself
(`mpirun -n 2 kvbench p2p --transport nixl --nixl-op read`, the tiny model's KV
geometry, paged blocks of the engine's block size) and fits `setup + bytes/GB/s`
(`kvbench fit`). During each disaggregated run the decode instance's NIXL histograms
give the engine's own count, bytes and time per transfer. The report puts the engine's
mean per-transfer time beside the model's prediction for the engine's mean bytes per
transfer (the model is linear, so that equals the mean prediction over transfers) and
gives the ratio: > 1 means the engine pays more than the microbenchmark predicts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvbench.plan import links_from_fit

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


def predicted_ms(link, nbytes: float) -> dict:
    """Fitted time for nbytes, with the box from the two marginal 95% intervals."""
    mid = (link.setup_ms or 0.0) + nbytes / (link.effective_gb_s * 1e9) * 1000.0
    out = {"ms": mid, "low_ms": None, "high_ms": None}
    bounds = [*(link.setup_ci95 or [None, None]), *(link.rate_ci95 or [None, None])]
    if all(isinstance(b, (int, float)) for b in bounds) and min(bounds[2:]) > 0:
        s_lo, s_hi, r_lo, r_hi = bounds
        out["low_ms"] = max(0.0, s_lo) + nbytes / (r_hi * 1e9) * 1000.0
        out["high_ms"] = s_hi + nbytes / (r_lo * 1e9) * 1000.0
    return out


def compare(fit_path: Path, xfer: dict, nbytes: dict) -> dict | None:
    """Engine vs model for one run's histogram deltas (xfer time in s, bytes); None if no transfer."""
    count = xfer["count"]
    if count <= 0:
        return None
    link = links_from_fit(str(fit_path), {})[0]
    observed_ms = xfer["sum"] / count * 1000.0
    mean_bytes = nbytes["sum"] / nbytes["count"] if nbytes["count"] else 0.0
    pred = predicted_ms(link, mean_bytes)
    ratio = observed_ms / pred["ms"] if pred["ms"] > 0 else None
    return {"transfers": count, "mean_bytes": mean_bytes, "observed_ms": observed_ms,
            "model_ms": pred["ms"], "model_low_ms": pred["low_ms"], "model_high_ms": pred["high_ms"],
            "ratio": ratio, "model": {"label": link.label, "setup_ms": link.setup_ms,
                                      "gb_s": link.effective_gb_s, "setup_ci95": link.setup_ci95,
                                      "rate_ci95": link.rate_ci95, "warnings": link.fit_warnings}}
