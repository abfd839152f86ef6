"""kvbench's side of `kvbench lab agree`: the engine-shaped p2p on the lab's exact geometry.

One `mpirun -n 2` job per repeat runs every configuration in turn (`kvbench p2p --cases`,
each into its own folder, so the torch/NIXL start-up is paid once):
the engine as deployed (`engine`: what vLLM 0.32.0 + the lab's connector do), every on/off
combination of its features (a 2^4 factorial, so each feature's cost is a measured main
effect), and a few what-ifs one step from the engine.
The prefill rank runs on the prefill instance's core, the decode rank on the decode
instance's (taskset, as `kvbench.lab.stack.deploy` binds them), with the lab's UCX environment.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from kvbench.lab.load.handoff import engine_profile, mpirun
from kvbench.p2p.transports.nixl import profile

# The engine's own features, each on as vLLM 0.32.0 + the lab run it: the flags that turn it
# off. Every on/off combination is run (a 2^4 factorial, `engine` = all on), so a feature's
# cost is its main effect averaged over the others' settings, and pairs that interact show.
FEATURES = {
    "threads": (profile.flag(threads=0), "UCX worker threads (4 -> 0)"),
    "progress-thread": ("--no-nixl-progress-thread", "NIXL's progress thread"),
    "per-request": (profile.flag(per_request=False), "a new prepped READ per request"),
    "step-poll": (profile.flag(poll="busy"), "completion polled per engine step (1 ms), not busily"),
}
# What-ifs one step from the engine configuration (not features the engine has on or off).
# The engine-profile ones are layers over the base's profile (profiles stack: .profile).
VARIANTS = {
    "delay0": (profile.flag(progress_delay_us=0), "progress-thread delay (lab's -> NIXL's 0)"),
    "kv-split": ("--kv-pages split", "K and V as separate regions (2 x layers)"),
    "scattered": ("--block-ids scattered", "scattered block ids (nothing merges)"),
    "waits-yield": (profile.flag("waits-yield"), "threads spin with sched_yield while they wait "
                    "(vLLM's worker loop between steps), not sleep"),
    "waits-spin": (profile.flag("waits-spin"), "threads spin while they wait, never yielding (the "
                   "harness before this was found)"),
    "announce-nixl": (profile.flag("announce-nixl"), "the request announced to decode as a NIXL "
                      "notification, not outside NIXL as vLLM's proxy and engine core do"),
}


def cell_name(off: tuple[str, ...]) -> str:
    """A factorial cell's configuration name: `engine`, or `off:` and the features it turns off."""
    return "engine" if not off else "off:" + "+".join(off)


def factorial_cells() -> dict[str, tuple[str, ...]]:
    """name -> the features that cell turns off, every one of the 2^k combinations."""
    cells = {}
    for bits in itertools.product((False, True), repeat=len(FEATURES)):
        off = tuple(f for f, b in zip(FEATURES, bits, strict=True) if b)
        cells[cell_name(off)] = off
    return cells


def tokens_for(mean_bytes: float | None, page_bytes_all_layers: int, block_size: int,
               input_len: int) -> tuple[int, str]:
    """The prompt length whose paged KV is the engine's transfer: whole blocks of the engine's
    mean bytes per transfer, else the workload's prompt rounded up to blocks."""
    if mean_bytes:
        blocks = max(1, round(mean_bytes / page_bytes_all_layers))
        exact = abs(blocks * page_bytes_all_layers - mean_bytes) < 0.5
        return blocks * block_size, (f"{blocks} block(s) = the engine's mean bytes per transfer"
                                     + ("" if exact else f" rounded ({mean_bytes:.0f} B)"))
    blocks = math.ceil(input_len / block_size)
    return blocks * block_size, f"{blocks} block(s) from the workload's {input_len}-token prompts"


def base_flags(model_config: Path, block_size: int, tokens: int, iters: int,
               delay_us: int) -> str:
    """The flags every configuration shares: the engine as the lab deploys it (the `lab`
    engine profile at the lab's progress-thread delay) on the lab's geometry."""
    return (f"--transport nixl {profile.FLAG} {engine_profile(delay_us)} --layout paged "
            f"--granularity block --block-size {block_size} --model-config {model_config} "
            f"--dtype bf16 --sizes {tokens} --iters {iters} --min-iters {min(iters, 10)} "
            f"--warmup 3 --seconds-per-point 30 --quiet")


def configs(draws: dict[str, Path], factorial: bool,
            replicas: dict[str, tuple[Path, float]] | None = None) -> dict[str, str]:
    """name -> extra flags: the engine; with `factorial` every cell of the feature factorial
    and the what-if variants; per rate the engine polled at the decode instance's own
    measured step times, back to back (`poll-drawn@R`) and paced at the rate (`paced@R`);
    per rate in `replicas` (poll file, decode's work per request in ms) `replica@R`."""
    out = {"engine": ""}
    if factorial:
        for name, off in factorial_cells().items():
            out[name] = " ".join(FEATURES[f][0] for f in off)
        out.update({k: v[0] for k, v in VARIANTS.items()})
    for rate, path in draws.items():
        out[f"poll-drawn@{rate}"] = profile.flag(poll=f"draw:{path}")
        # the engine as it runs at that rate: a transfer every 1000/R ms, polled at its steps
        out[f"paced@{rate}"] = profile.flag(poll=f"draw:{path}", gap_ms=f"{1000.0 / float(rate):g}")
    for rate, (path, busy_ms) in (replicas or {}).items():
        out[f"replica@{rate}"] = replica_flags(float(rate), path, busy_ms)
    return out


def replica_flags(rate: float, poll: Path, busy_ms: float) -> str:
    """The engine's decode as it runs at `rate` under the lab's client: requests Poisson at
    the rate (gaps drawn exponentially with mean 1000/R ms, as `vllm bench serve` spaces
    them), decode busy for its work on each request (`busy_ms`) inside the gap, its threads
    waiting as vLLM's worker does (yield-spinning for 1 s after the last work, asleep after
    that), completion looked at on the cadence decode's looks had in the engine's trace."""
    return profile.flag("replica", gap_ms=f"{1000.0 / rate:g}", busy_ms=f"{busy_ms:.3f}",
                        poll=f"draw:{poll}")


def seeded(cfgs: dict[str, str], repeat: int) -> dict[str, str]:
    """Each p2p job draws its own gaps (a seed per repeat), so repeats are independent."""
    drawn = profile.flag("replica")
    return {name: flags + (f" {profile.flag(gap_seed=repeat)}" if drawn in flags else "")
            for name, flags in cfgs.items()}


# Run in a job of their own, the ranks not pinned to a core each: name -> what it changes.
UNPINNED = {"unpinned": "ranks free on both cores, not one core each (the engine configuration)"}


def run_job(folder: Path, base: str, cfgs: dict[str, str], cores: tuple[int, int] | None,
            ucx_env: dict, log: Path, timeout_s: float) -> dict[str, dict | None]:
    """Every configuration in one MPI job; name -> its record (None when it produced none).
    `cores`: the prefill and decode ranks' cores (taskset), None to leave both free."""
    folder.mkdir(parents=True, exist_ok=True)
    cases = folder / f"cases-{'pinned' if cores else 'free'}.txt"
    lines = [f"{base} {extra} --out {folder / name}" for name, extra in cfgs.items()]
    cases.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", **ucx_env)
    # The run folder keeps the cases (the exact p2p lines) and the records.
    with open(log, "ab") as fh:
        py = [sys.executable, "-m", "kvbench.p2p", "--cases", str(cases)]
        if cores is None:
            cmd = [mpirun(), "--bind-to", "none", "-n", "2", *py]
        else:
            cmd = [mpirun(), "--bind-to", "none", "-n", "1", "taskset", "-c", str(cores[0]), *py,
                   ":", "-n", "1", "taskset", "-c", str(cores[1]), *py]
        fh.write((" ".join(cmd) + "\n").encode())
        subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                       check=False)
    return {name: _record(folder / name) for name in cfgs}


def _record(folder: Path) -> dict | None:
    files = sorted(folder.glob("kvbench-p2p-*.jsonl"))
    if not files:
        return None
    rec = json.loads(files[-1].read_text().splitlines()[0])
    return rec if rec.get("wrong") == 0 and rec.get("nixl_post_mean_ms") is not None else None


def summary(rec: dict | None) -> dict | None:
    """The numbers agree compares: NIXL telemetry means, kvbench's p50, the merged count, and
    per timed handoff what the xfer remainder is made of (kvbench.lab.agree.remainder)."""
    if rec is None:
        return None
    tel = rec.get("nixl_telemetry") or {}
    transfers = None
    if tel.get("looks") and tel.get("post_done"):
        transfers = {"post_ms": tel["post_ms"], "xfer_ms": tel["xfer_ms"],
                     "post_done": tel["post_done"], "late": [int(n > 0) for n in tel["looks"]]}
        if tel.get("idle_ms"):
            # decode's idle time at each post, as the engine's comes from the proxy's events
            transfers["decode_idle_s"] = [i / 1e3 for i in tel["idle_ms"]]
            transfers["gap_ms"] = tel["gap_ms"]
    return {"post_mean_ms": rec["nixl_post_mean_ms"], "xfer_mean_ms": rec["nixl_xfer_mean_ms"],
            "kvbench_p50_ms": rec["p50_ms"], "n": rec["n_samples"], "bytes": rec["bytes"],
            "desc_count": rec.get("descriptors_merged", rec.get("nixl_desc_count")),
            "spec_id": rec["spec_id"],
            "transport_options": rec["spec"]["transport_options"], "transfers": transfers}
