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


def engine_profile(delay_us: int) -> str:
    """The engine profile SPEC of the lab's deployment: `lab`, at the lab plan's
    progress-thread delay (kvbench.p2p.transports.nixl.profile; `lab` holds the default)."""
    from kvbench.p2p.transports.nixl import profile

    if profile.layer("lab").get("progress_delay_us") == delay_us:
        return "lab"
    return profile.spec_text("lab", progress_delay_us=delay_us)


def engine_cmd(model_config: Path, out_dir: Path, delay_us: int) -> list[str]:
    """The engine-shaped p2p as the lab's vLLM performs it (the `lab` engine profile,
    kvbench.p2p.transports.nixl.engine_shape): per-layer regions, per-block descriptors, a
    prepped READ per request, 1 ms step polling, 4 UCX threads, the lab connector's
    progress-thread delay."""
    return [mpirun(), "-n", "2", sys.executable, "-m", "kvbench.p2p", "--transport", "nixl",
            "--nixl-engine-profile", engine_profile(delay_us),
            "--model-config", str(model_config), "--dtype", "bf16", "--layout", "paged",
            "--granularity", "block", "--block-size", str(ENGINE_BLOCK_TOKENS),
            "--sizes", P2P_TOKENS, "--iters", "40", "--out", str(out_dir), "--quiet"]


def engine_reference(model_dir: Path, out_dir: Path, log: Path, delay_us: int,
                     ucx_env: dict) -> Path:
    """Run the engine-shaped p2p once into out_dir (kept for resume); returns its records file."""
    done = sorted(out_dir.glob("kvbench-p2p-*.jsonl"))
    if done:
        return done[-1]
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **ucx_env)
    with open(log, "ab") as fh:
        subprocess.run(engine_cmd(model_dir / "config.json", out_dir, delay_us), check=True,
                       env=env, stdout=fh, stderr=subprocess.STDOUT)
    return sorted(out_dir.glob("kvbench-p2p-*.jsonl"))[-1]


def engine_shaped_points(records: Path) -> list[tuple[int, float, float]]:
    """(bytes, NIXL telemetry post mean ms, xfer mean ms) per measured size, by bytes."""
    import json

    pts = []
    for line in records.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("wrong") == 0 and rec.get("nixl_xfer_mean_ms") is not None:
            pts.append((int(rec["bytes"]), float(rec["nixl_post_mean_ms"]),
                        float(rec["nixl_xfer_mean_ms"])))
    return sorted(pts)


def engine_shaped_at(points: list[tuple[int, float, float]], nbytes: float) -> dict | None:
    """The engine-shaped prediction at `nbytes`: the measured size itself, else straight-line
    interpolation between the two measured sizes around it (no extrapolation: None outside)."""
    for (b0, p0, x0), (b1, p1, x1) in zip(points, points[1:], strict=False):
        if b0 <= nbytes <= b1:
            w = 0.0 if b1 == b0 else (nbytes - b0) / (b1 - b0)
            return {"post_ms": p0 + w * (p1 - p0), "xfer_ms": x0 + w * (x1 - x0)}
    if len(points) == 1 and points[0][0] == round(nbytes):
        return {"post_ms": points[0][1], "xfer_ms": points[0][2]}
    return None
