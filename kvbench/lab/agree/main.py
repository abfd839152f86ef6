"""`kvbench lab agree PLAN.yaml`: kvbench's prediction held against vLLM's own transfer metrics.

    kvbench lab agree examples/lab-plan.yaml --rates 1,4 --repeats 3 --out results/lab/agree

1. The plan's disaggregated deployment comes up (or the one `kvbench lab up` left running),
   decode's NIXL READs traced (kvbench.lab.venv.nixltrace), and is warmed up (warm_up);
   per rate and repeat one bounded `vllm bench serve` run with the plan's workload, prefix
   cache reset first (every request pulls its whole KV), the decode instance's NIXL
   histograms read before and after (kvbench.lab.agree.engine: exact means from
   _sum/_count, bucket fractions, never interpolated percentiles).
2. The deployment goes down; per repeat one MPI job runs the engine-shaped p2p
   (kvbench.lab.agree.p2p) on the lab model's geometry, the engine's block size and the
   engine's block count per transfer, on the instances' cores, with the lab's UCX
   environment and progress-thread delay: the engine configuration, every on/off
   combination of its features (a 2^4 factorial), a few what-ifs, the engine polled at
   decode's measured step times of each rate, and decode as it runs at each rate
   (`replica@R`: Poisson gaps, its work per request, vLLM's worker waits, the traced look
   cadence; replica_inputs, kvbench.lab.agree.p2p.replica_flags).
3. The plain p2p fit the sweep uses (kvbench.lab.load.handoff) predicts the same transfers.
4. DIR/agreement.json and DIR/agreement.md: per rate, engine mean vs prediction for post
   and transfer time, ratio with a 95% interval over runs (kvbench.lab.agree.stats), where
   xfer goes beyond post on each side (kvbench.lab.agree.remainder), the feature costs, and
   the plain fit's ratio beside it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int, parse_positive_floats
from kvbench.lab.agree import engine as agree_engine
from kvbench.lab.agree import p2p as agree_p2p
from kvbench.lab.agree.report import analyse, markdown
from kvbench.lab.load import bench
from kvbench.lab.load.handoff import ENGINE_BLOCK_TOKENS
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.procs import run_interruptible, stop_on_exit
from kvbench.lab.sweep.main import Point, Sweep, lab_target, running_lab
from kvbench.lab.venv import nixltrace
from kvbench.records.schema.lab import SCHEMA_AGREE as SCHEMA
from kvbench.records.schema.lab import AgreeDocument
from kvbench.records.write import as_contract, utc_stamp, write_new_file

ENGINE_TRACE = "engine-trace.jsonl"  # decode's per-transfer NIXL trace (kvbench.lab.venv.nixltrace)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench lab agree", description=__doc__.split("\n\n")[0])
    p.add_argument("plan", metavar="PLAN.yaml")
    p.add_argument("--rates", default=None, help="offered rates in rps, comma-separated "
                   "(default: the plan's offered_rates_rps)")
    p.add_argument("--repeats", type=arg_int(1, 50), default=3, help="engine runs and p2p jobs per rate "
                   "(default 3; the ratio's 95%% interval needs at least 2)")
    p.add_argument("--out", default=None, help="a new folder (default lab-agree-<UTC stamp>)")
    p.add_argument("--p2p-iters", type=arg_int(1, 10_000), default=60,
                   help="timed handoffs per p2p configuration")
    p.add_argument("--no-factorial", action="store_true",
                   help="only the engine configuration (no feature factorial, no what-ifs)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain p2p fit")
    return p


def parse_rates(text: str | None, plan) -> list[float]:
    if text is None:
        return sorted(float(r) for r in plan.criteria.offered_rates_rps)
    return sorted(parse_positive_floats(text, "--rates (rps)", 1e-6, 1000.0))


def engine_runs(plan, lab, out: Path, vllm: str, rates: list[float], repeats: int) -> dict:
    """Every (rate, repeat) run on the disaggregated deployment; rate -> [per repeat: deltas]."""
    sweep = Sweep(plan, lab, out, vllm)
    sweep.start_grace_s = 180.0  # `vllm bench serve` alone can take a minute to start here
    got: dict = {}
    started: list = []
    with stop_on_exit(started):
        model = deploy.model_for(lab)
        st = running_lab("disaggregated", lab)
        trace = out / ENGINE_TRACE
        if st is None:  # our own deployment: decode traces every NIXL transfer
            st = deploy.bring_up(lab, "disaggregated", model, out / "logs" / "disaggregated",
                                 started, {"decode": {nixltrace.ENV: str(trace.resolve())}})
        target = lab_target(st, model)
        decode = target.metrics.get("decode", [None])[0]
        got["warmup"] = warm_up(target.endpoint, lab.load.input_len, trace)
        for rate in rates:
            for k in range(1, repeats + 1):
                print(f"agree: engine {rate:g} rps repeat {k}", file=sys.stderr, flush=True)
                before = agree_engine.read(decode) if decode else None
                first = len(agree_engine.read_trace(trace))
                res = sweep.run_point(Point("cold", "disaggregated", rate, k), target)
                time.sleep(2.0)  # the engine logs its stats every step; one more scrape interval
                after = agree_engine.read(decode) if decode else None
                recs = agree_engine.read_trace(trace, first)
                got.setdefault(f"{rate:g}", []).append(
                    {"status": res["status"], "reason": res["reason"], "wall_s": res["wall_s"],
                     "load_before": res["load_before"], "load_after": res["load_after"],
                     "metrics": agree_engine.delta(before, after),
                     "trace_lines": [first, first + len(recs)],
                     "transfers": agree_engine.trace_transfers(recs),
                     "look_intervals_ms": agree_engine.look_intervals(recs)})
        proxy = next((s for s in st.by_role("proxy")), None)
        events = (proxy.extra or {}).get("events") if proxy else None
        for runs in (v for k, v in got.items() if k != "warmup"):
            for r in runs:
                if r["transfers"]:
                    r["transfers"]["decode_idle_s"] = (agree_engine.decode_idle(
                        r["transfers"]["unix"], events) if events else None)
    return got


WARMUP_REQUESTS = 3  # as kvbench's --warmup 3: the first transfer pays the lazy wire-up


def warm_up(endpoint: str, input_len: int, trace: Path) -> dict:
    """Requests through the deployment before any measured run, so that the engine's runs are
    warm as kvbench's timed handoffs are: the deployment's first READ pays UCX's lazy
    connection set-up (10-45 ms measured here, against ~2 ms warm), which would otherwise
    land in the first run's mean. Its trace is kept and reported apart, like kvbench's cold."""
    from kvbench.lab.stack.capture import post_json, prompt

    first = len(agree_engine.read_trace(trace))
    for i in range(WARMUP_REQUESTS):
        post_json(endpoint + "/v1/completions",
                  {"model": deploy.SERVED_NAME, "prompt": prompt(1000 + i, input_len),
                   "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    time.sleep(0.5)  # the trace line is written when the handle is released
    recs = agree_engine.read_trace(trace, first)
    return {"requests": WARMUP_REQUESTS, "trace_lines": [first, first + len(recs)],
            "transfers": agree_engine.trace_transfers(recs)}


def p2p_runs(lab, out: Path, engine: dict, repeats: int, iters: int, factorial: bool) -> dict:
    """Per repeat one MPI job of the engine-shaped configurations; returns the run notes."""
    from kvbench.model import DTYPES, resolve_model

    cfg = deploy.model_for(lab) / "config.json"
    m = resolve_model(None, str(cfg))
    bs = ENGINE_BLOCK_TOKENS
    page_all = bs * m.bytes_per_token(DTYPES["bf16"])  # one block of the engine's BF16 KV, all layers
    means = [r["metrics"].get("bytes", {}).get("mean") for runs in engine.values() for r in runs]
    means = [b for b in means if b]
    mean_bytes = sum(means) / len(means) if means else None
    tokens, why = agree_p2p.tokens_for(mean_bytes, page_all, bs, lab.load.input_len)
    draws = {}
    for rate, runs in engine.items():
        d = next((agree_engine.step_draws(r["metrics"].get("itl")) for r in runs
                  if agree_engine.step_draws(r["metrics"].get("itl"))), None)
        if d is not None:
            path = out / "p2p" / f"steps-{rate}rps.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(d) + "\n")
            draws[rate] = path
    base = agree_p2p.base_flags(cfg, bs, tokens, iters, lab.workarounds.nixl_poll_delay_us)
    replicas, replica_why = replica_inputs(engine, draws, out, lab.load.output_len)
    cfgs = agree_p2p.configs(draws, factorial, replicas)
    ucx = {k: v for k, v in deploy.nixl_env(lab, 0).items() if k.startswith("UCX_")}
    cores = (lab.cores[0], lab.cores[1] if len(lab.cores) > 1 else lab.cores[0])
    unpinned = {n: "" for n in agree_p2p.UNPINNED} if factorial else {}
    reps = []
    for k in range(1, repeats + 1):
        print(f"agree: p2p repeat {k} ({len(cfgs)} configurations)", file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
        recs = agree_p2p.run_job(out / "p2p" / f"rep{k}", base, agree_p2p.seeded(cfgs, k), cores,
                                 ucx, out / "p2p.log", 600 + 60 * len(cfgs) + 300 * len(replicas))
        if unpinned:  # the engine configuration again, its ranks not pinned one core each
            recs |= agree_p2p.run_job(out / "p2p" / f"rep{k}", base, unpinned, None, ucx,
                                      out / "p2p.log", 660)
        reps.append({"load_before": load, "load_after": os.getloadavg()[0],
                     "configs": {n: agree_p2p.summary(r) for n, r in recs.items()}})
    return {"tokens": tokens, "tokens_why": why, "block_size": bs, "mean_bytes_engine": mean_bytes,
            "base_flags": base, "ucx_env": ucx, "cores": list(cores),
            "configs": cfgs | unpinned, "replica_inputs": replica_why,
            "repeats": reps}


MIN_LOOKS = 10  # look intervals a rate needs for its own poll draws (else all rates', else ITL)


def replica_inputs(engine: dict, draws: dict[str, Path], out: Path,
                   output_len: int) -> tuple[dict[str, tuple[Path, float]], dict]:
    """Per rate what `replica@R` takes from the engine's runs at that rate: the poll draws
    (decode's look intervals from the trace: the rate's own when it has MIN_LOOKS, else all
    rates' pooled, else the inter-token-latency draws) and decode's work per request
    ((output_len - 1) x the runs' mean inter-token latency, ms). Returns ({rate: (poll file,
    busy ms)}, {rate: what was used}) for the rates with an ITL mean."""
    looks = {rate: [x for r in runs for x in r.get("look_intervals_ms") or []]
             for rate, runs in engine.items()}
    pooled = [x for xs in looks.values() for x in xs]
    got, why = {}, {}
    for rate, runs in engine.items():
        itl = [r["metrics"]["itl"]["mean"] for r in runs if (r["metrics"].get("itl") or {}).get("mean")]
        if not itl:
            continue
        busy = (output_len - 1) * sum(itl) / len(itl)
        src = looks[rate] if len(looks[rate]) >= MIN_LOOKS else pooled
        if len(src) >= MIN_LOOKS:
            path = out / "p2p" / f"looks-{rate}rps.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(src) + "\n")
            kind = f"{len(src)} look intervals of the engine's trace" + (
                "" if src is looks[rate] else " (all rates pooled)")
        elif rate in draws:
            path, kind = draws[rate], "decode's inter-token-latency draws (too few traced looks)"
        else:
            continue
        got[rate] = (path, busy)
        why[rate] = {"poll": kind, "busy_ms": busy, "itl_mean_ms": sum(itl) / len(itl),
                     "output_len": output_len}
    return got, why


def plain_fit(lab, out: Path) -> str | None:
    from kvbench.lab.load.handoff import reference_fit

    print("agree: the plain p2p fit the sweep uses", file=sys.stderr, flush=True)
    try:
        return str(reference_fit(deploy.model_for(lab), out / "plain", out / "plain.log"))
    except Exception as exc:  # noqa: BLE001 - the comparison goes on without it, and says why
        print(f"agree: plain fit failed: {exc}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    from kvbench.lab.planfile import load_lab_plan

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    plan, lab = load_lab_plan(args.plan)
    rates = parse_rates(args.rates, plan)
    if lab is None:
        raise UsageError(f"{args.plan}: kvbench lab agree needs the plan's lab: section")
    if labenv.missing_reason():
        raise UsageError(labenv.missing_reason())
    out = Path(args.out or f"lab-agree-{utc_stamp()}")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty: give a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    started = utc_stamp()
    vllm = bench.find_vllm(labenv.lab_bin("vllm"))
    engine = engine_runs(plan, lab, out, vllm, rates, args.repeats)
    warmup = engine.pop("warmup", None)
    p2p = p2p_runs(lab, out, engine, args.repeats, args.p2p_iters, not args.no_factorial)
    fit = None if args.no_plain else plain_fit(lab, out)
    doc = {"schema": SCHEMA, "command": ["kvbench", "lab", "agree", *argv], "started": started,
           "finished": utc_stamp(), "plan": args.plan, "rates_rps": rates,
           "repeats": args.repeats, "host": os.uname().nodename, "cpu_count": os.cpu_count(),
           "loadavg_end": os.getloadavg(), "engine_warmup": warmup, "engine": engine, "p2p": p2p,
           "plain_fit": fit}
    doc["agreement"] = analyse(doc)
    as_contract(AgreeDocument, json.loads(json.dumps(doc)), "the agreement document")
    write_new_file(out / "agreement.json", json.dumps(doc) + "\n")  # compact: ~1 MB indented
    write_new_file(out / "agreement.md", markdown(doc))
    print(markdown(doc))
    return 0


def cli(argv=None) -> int:
    return run_interruptible("kvbench lab agree", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
