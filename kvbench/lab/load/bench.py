"""One bounded open-loop run of `vllm bench serve` against one deployment.

The real load generator, not a new one: Poisson arrivals at the offered rate, random
prompts of a fixed shape, `--ignore-eos` so every request produces output_len tokens,
`--save-result --save-detailed` for per-request times that `kvbench slo convert-vllm`
reads. This vLLM has no duration flag, so the run is sized by request count
(warm-up + rate x duration) and bounded: an overloaded deployment must still finish
its run (slow requests fail the latency gates, they are data), but one that makes no
progress - no new token anywhere for longer than the plan's request deadline - or runs
past a generous hard bound is killed (its process group) and recorded as failed: the
deployment stopped answering.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import UsageError


@dataclass(frozen=True)
class BenchRun:
    endpoint: str
    model: str
    tokenizer: str
    rate_rps: float
    num_prompts: int
    input_len: int
    output_len: int
    seed: int


def find_vllm(lab_vllm: Path | None) -> str:
    """The `vllm` executable: the lab's own, else one on PATH; missing is one line, exit 2."""
    if lab_vllm is not None and lab_vllm.exists():
        return str(lab_vllm)
    found = shutil.which("vllm")
    if not found:
        raise UsageError("`vllm bench serve` not found: install vLLM (for the local lab: "
                         "kvbench lab install) or put `vllm` on PATH")
    return found


def num_prompts(rate_rps: float, duration_s: float, warmup: int) -> int:
    return warmup + max(1, math.ceil(rate_rps * duration_s))


def bench_cmd(vllm: str, run: BenchRun, out: Path, rate: str | None = None,
              concurrency: int | None = None) -> list[str]:
    cmd = [vllm, "bench", "serve", "--backend", "openai", "--base-url", run.endpoint,
           "--endpoint", "/v1/completions", "--model", run.model, "--tokenizer", run.tokenizer,
           "--dataset-name", "random", "--random-input-len", str(run.input_len),
           "--random-output-len", str(run.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(run.num_prompts), "--request-rate", rate or f"{run.rate_rps:g}",
           "--ignore-eos", "--seed", str(run.seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    return cmd + ["--save-result", "--save-detailed", "--result-dir", str(out.parent),
                  "--result-filename", out.name]


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def run_bounded(cmd: list[str], log: Path, timeout_s: float, progress=None,
                stall_s: float | None = None, env_extra: dict[str, str] | None = None,
                startup_s: float = 0.0) -> tuple[bool, str]:
    """Run cmd in its own process group; (ok, reason).

    env_extra (default: Hugging Face offline, no vLLM usage stats) is added to the environment;
    startup_s is the client's own start-up before its first request (AIPerf and GuideLLM spend
    a minute on a busy 2-core machine): the stall watch starts after it.
    Killed (the whole group) past timeout_s, or when progress() - a number that grows
    while the deployment works, e.g. tokens generated - has not changed for stall_s
    (not counted during the first start_grace_s: the client's own start-up on a busy host).
    """
    env = dict(os.environ, **(OFFLINE_ENV if env_extra is None else env_extra))
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        try:
            why = _watch(proc, timeout_s, progress, stall_s, startup_s)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if why:
        return False, why
    return (True, "") if proc.returncode == 0 else (False, f"{Path(cmd[0]).name} exited {proc.returncode} "
                                                          f"(see {log.name})")


def _watch(proc, timeout_s: float, progress, stall_s: float | None, startup_s: float = 0.0) -> str:
    """Wait for proc; kill it and say why when it runs too long or the deployment stalls."""
    t0 = time.monotonic()
    last, last_change = None, t0 + startup_s
    while proc.poll() is None:
        now = time.monotonic()
        if progress is not None and stall_s is not None:
            value = progress()
            if value != last:
                last, last_change = value, max(now, last_change)
            elif now - last_change > stall_s:
                return _kill(proc, f"no token generated for {stall_s:.0f} s: deployment stopped answering "
                                   "(run killed)")
        if now - t0 > timeout_s:
            return _kill(proc, f"no result within {timeout_s:.0f} s (run killed)")
        time.sleep(2.0)
    return ""


def _kill(proc, why: str) -> str:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return why


def wall_bound_s(run: BenchRun, deadline_s: float) -> float:
    """Hard bound: arrivals take N/rate; allow the backlog 5x that, the last deadline, start-up."""
    arrivals = run.num_prompts / run.rate_rps
    return 6 * arrivals + deadline_s + 60.0
