"""`kvbench sweep PLAN.yaml`: the plan's equal-budget rate sweep, run and judged.

For every deployment x cache state x offered rate (x repeat) one bounded open-loop
run of the chosen load generator (`--client`: `vllm bench serve`, AIPerf or GuideLLM,
kvbench.lab.load.clients), with the deployment's /metrics recorded during it by `kvbench slo
scrape`; records converted and analysed (with the scrapes) by `kvbench slo`; one report
(kvbench.lab.sweep.report). With a `lab:` section and no endpoints the deployments are
started locally, one at a time (an idle deployment would share the cores), and stopped
after their runs or on any failure or Ctrl-C. Every run's files stay in the output
folder; a run folder with run.json is done, so a second invocation on the same folder
resumes where the first stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int
from kvbench.lab.load import bench
from kvbench.lab.load.clients import CLIENTS, client_run, find_client
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.procs import run_interruptible, stop_on_exit
from kvbench.records.schema.lab import SCHEMA_SWEEP as SCHEMA
from kvbench.records.schema.lab import SweepMeta
from kvbench.records.schema.types import parse
from kvbench.records.write import as_contract, utc_stamp, write_new_file


@dataclass(frozen=True)
class Point:
    cache_state: str
    deployment: str
    rate_rps: float
    repeat: int

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.cache_state / self.deployment / f"{self.rate_rps:g}rps-rep{self.repeat}"


@dataclass
class Target:
    """Where a deployment answers during its runs."""

    endpoint: str
    metrics: dict[str, list[str]]
    instances: list[str]  # base URLs for cache resets ([] when unknown: a real cluster)
    model: str
    tokenizer: str


def points(plan, repeats: int) -> list[Point]:
    """Every run the plan requires (slo's BenchmarkPlan.runs()) x repeats, one deployment after the other."""
    runs = sorted(plan.runs(), key=lambda run: plan.deployments.index(run[1]))
    return [Point(s, d, r, k) for s, d, r in runs for k in range(1, repeats + 1)]


def _post(url: str) -> None:
    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


def progress(metrics: dict[str, list[str]]):
    """Tokens generated so far over every instance (None where unreadable): the stall watch."""
    from kvbench.lab.load.snapshot import fetch

    def total():
        snaps = [fetch(u, timeout_s=3) for urls in metrics.values() for u in urls]
        return tuple(None if s is None else s.get("generation_tokens") for s in snaps)
    return total if metrics else None


def scrape_endpoints(metrics: dict[str, list[str]]) -> list[str]:
    """ROLE=URL items for `kvbench slo scrape`, numbered when a role has several instances."""
    out = []
    for role, urls in metrics.items():
        for i, url in enumerate(urls):
            out.append(f"{role}={url}" if len(urls) == 1 else f"{role}-{i}={url}")
    return out


def scrape_cmd(metrics: dict[str, list[str]], folder: Path, bound_s: float, point: Point) -> list[str]:
    return [sys.executable, "-m", "kvbench", "slo", "scrape", *scrape_endpoints(metrics), "--interval", "1",
            "--duration", f"{bound_s + 30:.0f}", "--out", str(folder / "scrape.jsonl"),
            "--deployment", point.deployment, "--offered-rate", f"{point.rate_rps:g}",
            "--cache-state", point.cache_state]


def convert_cmd(client: str, point: Point, result: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "kvbench", "slo", "convert", "--from", client, str(result),
            "--deployment", point.deployment, "--offered-rate", f"{point.rate_rps:g}",
            "--cache-state", point.cache_state, "--out", str(out)]


@contextmanager
def scraping(metrics: dict[str, list[str]], folder: Path, bound_s: float, point: Point):
    """`kvbench slo scrape` of every /metrics endpoint while the body runs (scrape.jsonl).

    Bounded by the run's own bound; when the load ends, SIGTERM makes it take one last
    reading and write its file (slo scrape's clean early stop). Its own process group, so
    a Ctrl-C of the sweep does not cut it before that last reading.
    """
    if not metrics:
        yield
        return
    cmd = scrape_cmd(metrics, folder, bound_s, point)
    with open(folder / "scrape.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    t0 = time.monotonic()
    try:
        yield
    finally:
        time.sleep(max(0.0, t0 + 3.0 - time.monotonic()))  # past its start-up: SIGTERM is handled
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def set_aside(folder: Path) -> None:
    """A run folder without run.json was cut short: keep its files under another name, rerun."""
    if folder.exists() and not (folder / "run.json").exists():
        aside = folder.with_name(f"{folder.name}.partial-{utc_stamp()}")
        folder.rename(aside)
        print(f"sweep: {folder} was cut short; kept as {aside.name}, running it again", file=sys.stderr)


class Sweep:
    def __init__(self, plan, lab, out: Path, exe: str, client: str = "vllm"):
        self.plan, self.lab, self.out, self.exe, self.client = plan, lab, out, exe, client
        self.c = plan.criteria
        self.start_grace_s = 0.0  # stall watch paused while the client starts (kvbench lab agree)

    def log(self, folder: Path, prepass: bool = False) -> Path:
        name = "vllm-bench" if self.client == "vllm" else f"{self.client}-bench"
        return folder / ("warm-prepass.log" if prepass else f"{name}.log")

    def prepare_cache(self, point: Point, target: Target, folder: Path, run: bench.BenchRun) -> str:
        """cold: every instance's prefix cache reset; warm: the same prompts sent once first."""
        if point.cache_state == "cold":
            if not target.instances:
                return "cold not enforced: instance URLs unknown (no reset endpoint)"
            for base in target.instances:
                _post(base + "/reset_prefix_cache")
            return "prefix cache reset on every instance"
        if point.cache_state == "warm":
            cr = client_run(self.client, self.exe, run, folder, prepass=True)
            ok, why = bench.run_bounded(cr.cmd, self.log(folder, prepass=True),
                                        bench.wall_bound_s(run, 60) + cr.startup_s, env_extra=cr.env)
            return "same prompts sent once before the run (prefix cache warm)" if ok else f"prepass failed: {why}"
        return f"cache state {point.cache_state!r} is a label only (kvbench knows cold and warm)"

    def bench_run(self, point: Point, target: Target) -> bench.BenchRun:
        load = self.lab.load if self.lab else None
        return bench.BenchRun(target.endpoint, target.model, target.tokenizer, point.rate_rps,
                              bench.num_prompts(point.rate_rps, self.c.duration_s, self.c.warmup_requests),
                              load.input_len if load else 256, load.output_len if load else 32,
                              (load.seed if load else 0) + point.repeat - 1)

    def run_point(self, point: Point, target: Target) -> dict:
        folder = point.folder(self.out)
        set_aside(folder)
        folder.mkdir(parents=True)
        run = self.bench_run(point, target)
        cache_note = self.prepare_cache(point, target, folder, run)
        load_before = os.getloadavg()[0]
        cr = client_run(self.client, self.exe, run, folder)
        bound = bench.wall_bound_s(run, self.c.request_deadline_ms / 1000.0) + cr.startup_s
        t0 = time.time()
        with scraping(target.metrics, folder, bound, point):
            grace = max(cr.startup_s, self.start_grace_s)
            ok, why = bench.run_bounded(cr.cmd, self.log(folder), bound + grace - cr.startup_s,
                                        progress(target.metrics),
                                        self.c.request_deadline_ms / 1000.0 + 10.0, cr.env, grace)
        records = self.convert(point, folder, cr.result) if ok else None
        result = {"point": asdict(point), "client": self.client, "status": "done" if records else "failed",
                  "reason": why if not ok else ("" if records else conversion_failure(folder)),
                  "cache": cache_note, "num_prompts": run.num_prompts, "seed": run.seed,
                  "scrape": (folder / "scrape.jsonl").exists(),
                  "started_unix": t0, "wall_s": round(time.time() - t0, 1), "bound_s": round(bound),
                  "load_before": load_before, "load_after": os.getloadavg()[0],
                  "client_shortfall": self.shortfall(cr.result) if records else None}
        write_new_file(folder / "run.json", json.dumps(result, indent=2) + "\n")
        return result

    def shortfall(self, result: Path) -> dict | None:
        """Requests the load generator created and left out of its result (GuideLLM's own
        scheduler counts, kvbench.slo.guidellm.Shortfall); None for the other clients."""
        if self.client != "guidellm":
            return None
        from kvbench.slo.guidellm import client_shortfall

        return client_shortfall(result)

    def convert(self, point: Point, folder: Path, result: Path) -> Path | None:
        out = folder / "records.jsonl"
        proc = subprocess.run(convert_cmd(self.client, point, result, out), capture_output=True, text=True)
        (folder / "convert.log").write_text(proc.stdout + proc.stderr)
        return out if proc.returncode == 0 else None


def conversion_failure(folder: Path) -> str:
    """Why `slo convert` refused a client's result: its last line in convert.log, so that a
    failed point says what the converter said rather than only that it failed."""
    log = folder / "convert.log"
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    return "conversion failed" + (f": {lines[-1].strip()} (convert.log)" if lines else "")


def running_lab(name: str, lab):
    """The deployment `kvbench lab up` left running for this plan's lab (same ports), if alive."""
    from kvbench.lab.stack.env import state_dir
    from kvbench.lab.stack.procs import LabState

    path = state_dir() / f"{name}.json"
    if not path.exists():
        return None
    st = LabState.from_json(path.read_text())
    proxy_port = lab.port(0 if name == "aggregated" else 100)
    if st.endpoint != deploy.url(proxy_port) or not all(s.alive() for s in st.services):
        return None
    return st


def lab_target(st, model_dir: Path) -> Target:
    return Target(st.endpoint, st.metrics_endpoints,
                  [deploy.url(s.port) for s in st.services if s.role != "proxy"], deploy.SERVED_NAME,
                  str(model_dir))


def plan_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def open_out(out: Path, plan_path: str, argv: list[str], client: str = "vllm") -> None:
    """Create the sweep folder, or resume one made from the same plan file with the same client."""
    meta = out / "sweep.json"
    digest = plan_digest(plan_path)
    if meta.exists():
        old = parse(SweepMeta, json.loads(meta.read_text()), str(meta)).model_dump()
        if old.get("plan_sha256_16") != digest:
            raise UsageError(f"{out} holds a sweep of a different plan (or the plan changed); "
                             "use a new --out folder")
        if old.get("client", "vllm") != client:
            raise UsageError(f"{out} holds a sweep driven by --client {old.get('client', 'vllm')}; "
                             f"use a new --out folder for --client {client}")
        print(f"sweep: resuming in {out}", file=sys.stderr)
        return
    out.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "plan": plan_path, "plan_sha256_16": digest, "client": client,
           "command": ["kvbench", "sweep", *argv], "started": utc_stamp()}
    as_contract(SweepMeta, doc, "the sweep folder's marker")
    write_new_file(meta, json.dumps(doc, indent=2) + "\n")
    (out / "plan.yaml").write_bytes(Path(plan_path).read_bytes())


def run_deployment(sweep: Sweep, name: str, todo: list[Point], counter: list[int], total: int) -> None:
    """Bring one deployment up (lab) or use its endpoint, run its pending points, take it down."""
    lab, spec = sweep.lab, sweep.plan.deployment_specs[name]
    started: list = []
    with stop_on_exit(started):
        if spec.endpoint:
            load = lab.load if lab else None
            if not (load and load.model and load.tokenizer):
                raise UsageError("a plan with endpoints needs lab.load.model and lab.load.tokenizer "
                                 "for vllm bench serve")
            metrics = {role: list(urls) for role, urls in spec.metrics_endpoints.items()}
            target = Target(spec.endpoint, metrics, [], load.model, load.tokenizer)
        else:
            from kvbench.lab.stack.deploy import model_for

            model = model_for(lab)
            st = running_lab(name, lab)
            if st is None:
                st = deploy.bring_up(lab, name, model, sweep.out / "logs" / name, started)
            else:
                print(f"sweep: using {name} started by `kvbench lab up` ({st.endpoint})", file=sys.stderr)
            target = lab_target(st, model)
        for p in todo:
            counter[0] += 1
            print(f"sweep: [{counter[0]}/{total}] {p.deployment} {p.cache_state} {p.rate_rps:g} rps "
                  f"rep {p.repeat}: running (bounded)", file=sys.stderr, flush=True)
            res = sweep.run_point(p, target)
            print(f"sweep: [{counter[0]}/{total}] {res['status']} in {res['wall_s']:.0f} s"
                  + (f": {res['reason']}" if res["reason"] else ""), file=sys.stderr, flush=True)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("plan", metavar="PLAN.yaml")
    p.add_argument("--out", help="output folder (default lab-sweep-<UTC stamp>); an existing sweep "
                   "folder of the same plan is resumed")
    p.add_argument("--repeats", type=arg_int(1, 1000), default=1, help="runs per point; the report gives medians "
                   "and the spread across them (default 1)")
    p.add_argument("--client", choices=CLIENTS, default="vllm",
                   help="load generator: vllm (vllm bench serve, the lab's), aiperf or guidellm (each from "
                        "its own venv, see kvbench.lab.load.clients; default vllm)")
    p.add_argument("--no-handoff-model", action="store_true",
                   help="skip the p2p NIXL references (plain and engine-shaped) and the "
                        "engine-vs-model comparison")
    return p


def main(argv=None) -> int:
    from kvbench.lab.planfile import load_lab_plan
    from kvbench.lab.sweep.report import write_report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    plan, lab = load_lab_plan(args.plan)
    local = [n for n, d in plan.deployment_specs.items() if not d.endpoint]
    if local and labenv.missing_reason():
        raise UsageError(labenv.missing_reason())
    exe = find_client(args.client, labenv.lab_bin("vllm") if lab else None)
    out = Path(args.out or f"lab-sweep-{utc_stamp()}")
    open_out(out, args.plan, argv, args.client)
    fit = engine_ref = None
    if lab and not args.no_handoff_model:
        fit = reference_fit(lab, out)
        engine_ref = engine_reference(lab, out)
    pts = points(plan, args.repeats)
    todo = [p for p in pts if not (p.folder(out) / "run.json").exists()]
    print(f"sweep: {len(pts)} runs, {len(pts) - len(todo)} already done", file=sys.stderr, flush=True)
    counter = [len(pts) - len(todo)]
    sweep = Sweep(plan, lab, out, exe, args.client)
    for name in plan.deployments:
        mine = [p for p in todo if p.deployment == name]
        if mine:
            run_deployment(sweep, name, mine, counter, len(pts))
    print(write_report(out, plan, pts, fit, engine_ref))
    return 0


def reference_fit(lab, out: Path) -> Path:
    from kvbench.lab.load.handoff import reference_fit as run_fit
    from kvbench.lab.stack.deploy import model_for

    print("sweep: measuring the NIXL reference with kvbench p2p + fit first", file=sys.stderr, flush=True)
    return run_fit(model_for(lab), out / "handoff-model", out / "handoff-model.log")


def engine_reference(lab, out: Path) -> Path:
    from kvbench.lab.load.handoff import engine_reference as run_engine
    from kvbench.lab.stack.deploy import model_for, nixl_env

    print("sweep: measuring the engine-shaped NIXL reference (kvbench p2p --nixl-engine-profile lab)",
          file=sys.stderr, flush=True)
    ucx = {k: v for k, v in nixl_env(lab, 0).items() if k.startswith("UCX_")}
    return run_engine(model_for(lab), out / "engine-shaped", out / "engine-shaped.log",
                      lab.workarounds.nixl_poll_delay_us, ucx)


def cli(argv=None) -> int:
    return run_interruptible("kvbench sweep", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
