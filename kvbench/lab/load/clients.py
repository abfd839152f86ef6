"""The load generators `kvbench sweep --client` can drive: vLLM's, AIPerf, GuideLLM.

Each runs open-loop (Poisson arrivals at the offered rate) with the same workload shape
(random prompts of input_len tokens, output_len tokens with ignore_eos, the run's seed),
from its own executable: vLLM's from the lab venv, AIPerf and GuideLLM each from a venv of
their own (never kvbench's: they pin their own dependencies). Its result is converted by
`kvbench slo convert --from TOOL`, so the report is the same whichever client ran.

    kvbench lab install --clients     # both, pinned, each in its own venv (cached), i.e.
    python3 -m venv ~/.cache/kvbench/clients/aiperf && ~/.cache/kvbench/clients/aiperf/bin/pip install aiperf==0.13.0
    python3 -m venv ~/.cache/kvbench/clients/guidellm && ~/.cache/kvbench/clients/guidellm/bin/pip install guidellm==0.8.1
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.lab.load import bench

CLIENTS = ("vllm", "aiperf", "guidellm")
# start-up of AIPerf (its services, tokenizer, dataset) and GuideLLM (tokenizer, synthetic data,
# workers) before the first request: 20-90 s seen on the busy 2-core lab machine
STARTUP_S = 180.0
VERSIONS = {"aiperf": "0.13.0", "guidellm": "0.8.1"}  # the versions kvbench's converters were checked on


def clients_home() -> Path:
    """$KVBENCH_CLIENTS_HOME, else ~/.cache/kvbench/clients (one venv per tool below it)."""
    env = os.environ.get("KVBENCH_CLIENTS_HOME")
    return Path(env) if env else Path.home() / ".cache" / "kvbench" / "clients"


def install_hint(tool: str) -> str:
    d = clients_home() / tool
    return f"python3 -m venv {d} && {d}/bin/pip install {tool}=={VERSIONS[tool]}"


def install_client(tool: str) -> str:
    """The tool's own venv at its pinned version, made once (a stamp names what it holds, so a
    venv cut short is made again); returns one line saying what is there."""
    import subprocess
    import sys

    d = clients_home() / tool
    stamp = d / ".kvbench-installed"
    want = f"{tool}=={VERSIONS[tool]}\n"
    if stamp.is_file() and stamp.read_text() == want and (d / "bin" / tool).exists():
        return f"{tool}: cached {d} ({want.strip()})"
    shutil.rmtree(d, ignore_errors=True)
    d.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
    subprocess.run([str(d / "bin" / "python"), "-m", "pip", "install", "-q", want.strip()], check=True)
    stamp.write_text(want)
    return f"{tool}: installed {d} ({want.strip()})"


def find_client(tool: str, lab_vllm: Path | None) -> str:
    """The tool's executable: its own venv's, else one on PATH; missing is one line, exit 2."""
    if tool == "vllm":
        return bench.find_vllm(lab_vllm)
    own = clients_home() / tool / "bin" / tool
    if own.exists():
        return str(own)
    found = shutil.which(tool)
    if not found:
        raise UsageError(f"`{tool}` not found in {own.parent} nor on PATH: {install_hint(tool)}")
    return found


@dataclass(frozen=True)
class ClientRun:
    """One run's command line, where its result lands (what `slo convert` reads), its environment."""

    cmd: list[str]
    result: Path
    # AIPerf 0.13 cannot load a tokenizer from a local folder under HF_HUB_OFFLINE=1
    # (HFValidationError "Repo id must be in the form ...", seen in the lab test), so only
    # vLLM's client runs with the Hugging Face offline switches
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float = 0.0  # the tool's own start-up before its first request (added to the bounds)


def client_run(tool: str, exe: str, run: bench.BenchRun, folder: Path, prepass: bool = False) -> ClientRun:
    """The open-loop run (or, prepass, the same prompts at concurrency 4 to warm the cache)."""
    stem = "warm-prepass" if prepass else "bench"
    if tool == "vllm":
        out = folder / f"{stem}.json" if prepass else folder / "vllm-bench.json"
        return ClientRun(bench.bench_cmd(exe, run, out, rate="inf" if prepass else None,
                                         concurrency=4 if prepass else None), out, dict(bench.OFFLINE_ENV))
    if tool == "aiperf":
        out = folder / ("aiperf-warm" if prepass else "aiperf")
        return ClientRun(aiperf_cmd(exe, run, out, prepass), out, startup_s=STARTUP_S)
    out = folder / ("guidellm-warm" if prepass else "guidellm") / "benchmarks.json"
    return ClientRun(guidellm_cmd(exe, run, out, prepass), out, startup_s=STARTUP_S)


def aiperf_cmd(exe: str, run: bench.BenchRun, out: Path, prepass: bool = False) -> list[str]:
    load = (["--concurrency", "4"] if prepass
            else ["--request-rate", f"{run.rate_rps:g}", "--arrival-pattern", "poisson"])
    return [exe, "profile", "--model", run.model, "--url", run.endpoint, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", run.tokenizer, "--isl", str(run.input_len), "--isl-stddev", "0",
            "--osl", str(run.output_len), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
            *load, "--request-count", str(run.num_prompts), "--random-seed", str(run.seed),
            "--use-server-token-count", "--output-artifact-dir", str(out), "--ui-type", "none",
            "--export-level", "records", "--no-server-metrics", "--no-gpu-telemetry"]


def guidellm_cmd(exe: str, run: bench.BenchRun, out: Path, prepass: bool = False) -> list[str]:
    profile = "kind=concurrent,streams=4" if prepass else f"kind=poisson,rate={run.rate_rps:g}"
    return [exe, "run",
            "--backend", f"kind=openai_http,target={run.endpoint},model={run.model},"
                         "request_format=/v1/completions,extras.body.ignore_eos=true",
            "--profile", profile, "--constraint", f"kind=max_requests,count={run.num_prompts}",
            "--data", f"kind=synthetic_text,prompt_tokens={run.input_len},output_tokens={run.output_len}",
            "--tokenizer", f"kind=huggingface_auto,model={run.tokenizer}",
            "--seed", f"kind=static,value={run.seed}", "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]
