"""The sweep's one report: capacity, first failing gate and verdict per cache state, medians
with their spread over repeats, queue trends per role, the KV-transfer distribution and the
engine-vs-model handoff ratio, plots, and every raw file.

Judging and reading the engines' metrics stay in kvbench.slo: this module runs `kvbench slo
analyze` once per repeat, over every run's records (`--plan`), every run's scrape
(`--metrics`, from `kvbench slo scrape`) and the NIXL reference fit (`--fit`), then only
arranges its answers. A run that produced no records (the deployment stopped answering)
fails its rate: capacity is cut below it and the verdict says so.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from kvbench.records.schema.lab import SCHEMA_SWEEP_REPORT, SweepReport
from kvbench.records.write import as_contract, utc_stamp


def analyze_cmd(plan, runs: list[dict], fit: Path | None, stem: Path) -> list[str]:
    records = [str(r["folder"] / "records.jsonl") for r in runs if r["status"] == "done"]
    scrapes = [str(r["folder"] / "scrape.jsonl") for r in runs if (r["folder"] / "scrape.jsonl").exists()]
    cmd = [sys.executable, "-m", "kvbench", "slo", "analyze", *records, "--plan", plan.path,
           "--format", "json", "--out", str(stem.with_suffix(".json")), "--plot", str(stem.with_suffix(".png"))]
    for f in scrapes:
        cmd += ["--metrics", f]
    if scrapes and fit is not None:
        cmd += ["--fit", str(fit)]
    return cmd


def _inputs(cmd: list[str]) -> list[str]:
    """What an analysis was made of: its command without the output paths."""
    return [a for a in cmd[cmd.index("analyze") + 1:] if not a.endswith((".json", ".png")) or a.endswith(".fit.json")]


def run_analyze(out: Path, plan, rep: int, runs: list[dict], fit: Path | None) -> dict | None:
    """`kvbench slo analyze` over one repeat (every cache state); its JSON report, or None.

    An analysis already on disk is reused when it was made of the same files; one made
    before a resumed sweep added runs is kept aside (renamed), never overwritten.
    """
    if not any(r["status"] == "done" for r in runs):
        return None
    stem = out / "analysis" / f"rep{rep}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    cmd = analyze_cmd(plan, runs, fit, stem)
    made = stem.with_suffix(".json")
    if made.exists() and _inputs(json.loads(made.read_text())["command"]) != _inputs(cmd):
        stamp = utc_stamp()
        for suffix in (".json", ".png", ".log"):
            if stem.with_suffix(suffix).exists():
                stem.with_suffix(suffix).rename(stem.parent / f"{stem.name}.stale-{stamp}{suffix}")
    if not made.exists():
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (stem.with_suffix(".log")).write_text(proc.stderr)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "analyze failed"}
    return json.loads(made.read_text())


def load_runs(out: Path, pts) -> list[dict]:
    runs = []
    for p in pts:
        folder = p.folder(out)
        meta = folder / "run.json"
        if meta.exists():
            runs.append({**json.loads(meta.read_text()), "folder": folder, "p": p})
    return runs


def adjusted_capacity(cap: dict, failed_rates: list[float]) -> dict:
    """A rate whose run produced nothing failed: capacity must lie below the lowest such rate."""
    if not failed_rates:
        return cap
    low = min(failed_rates)
    value = cap.get("capacity_rps")
    if value is not None and value >= low:
        passing = [r for r in cap["tested_rates_rps"] if r < low and (value is None or r <= value)]
        value = max(passing) if passing else None
    return {**cap, "capacity_rps": value, "failed_runs_rps": sorted(failed_rates),
            "text": cap.get("text", "") + f"; run(s) at {', '.join(f'{r:g}' for r in sorted(failed_rates))} rps "
            "produced no result (deployment stopped answering): failing"}


def median_spread(values: list[float | None]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _matching(analyses: dict, key: tuple) -> list[dict]:
    """slo's groups of one (cache state, deployment, rate), one per repeat."""
    state, dep, rate = key
    return [g for a in analyses.values() if a and "groups" in a for g in a["groups"]
            if g.get("cache_state") == state and g["deployment"] == dep and abs(g["offered_rate_rps"] - rate) < 1e-9]


def point_table(analyses: dict, plan) -> list[dict]:
    """Per cache state x deployment x rate: median [min-max] over repeats of the key figures."""
    rows = []
    for state, dep, rate in plan.runs():
        groups = _matching(analyses, (state, dep, rate))
        if not groups:
            continue
        rows.append({"cache_state": state, "deployment": dep, "rate_rps": rate, "repeats": len(groups),
                     **{f"{m}_p{q}_ms": _lat(groups, m, q) for m in ("ttft", "tpot") for q in (50, 99)},
                     "attainment_pct": median_spread([g["attainment"]["declared_pct"] for g in groups]),
                     "throughput_rps": median_spread([g["throughput"]["throughput_rps"] for g in groups]),
                     "passed": [g["passed"] for g in groups]})
    return rows


def _lat(groups: list[dict], metric: str, q: int) -> dict:
    return median_spread([g["latency_ms"][metric][f"p{q}_ms"] for g in groups])


def engine_roles(analyses: dict) -> dict[tuple, list[dict]]:
    """slo's per-role engine analyses by (cache state, deployment, rate, role), one per repeat."""
    out: dict[tuple, list[dict]] = {}
    for a in analyses.values():
        for e in (a or {}).get("engine_metrics") or []:
            lab = e["labels"]
            for role in e["roles"]:
                key = (lab["cache_state"], lab["deployment"], lab["offered_rate_rps"], role["role"])
                out.setdefault(key, []).append(role)
    return out


def _trend_word(t: dict) -> str:
    return "-" if t["growing"] is None else ("growing" if t["growing"] else "stable")


def scheduler_table(roles: dict[tuple, list[dict]]) -> list[dict]:
    """Per run and role: queue trend (slo's first/last-third rule), running, KV usage, failures."""
    rows = []
    for (state, dep, rate, role), per_rep in sorted(roles.items(), key=lambda kv: str(kv[0])):
        rows.append({"cache_state": state, "deployment": dep, "rate_rps": rate, "role": role,
                     "queue_trend": [_trend_word(r["queue"]) for r in per_rep],
                     "waiting_first_third": median_spread([r["queue"]["mean_first_third"] for r in per_rep]),
                     "waiting_last_third": median_spread([r["queue"]["mean_last_third"] for r in per_rep]),
                     "running_last_third": median_spread([r["running"]["mean_last_third"] for r in per_rep]),
                     "kv_usage_max": median_spread([(r["kv_usage"] or {}).get("max") for r in per_rep]),
                     "failed_transfers": _increase(per_rep, "xfer_failures"),
                     "kv_expired": _increase(per_rep, "kv_expired"),
                     "scrapes": [r["scrapes"] for r in per_rep]})
    return rows


def _increase(per_rep: list[dict], key: str) -> float | None:
    vals = [r[key]["increase"] for r in per_rep if r.get(key)]
    return sum(vals) if vals else None


def kv_table(roles: dict[tuple, list[dict]], engine_points: list | None = None) -> list[dict]:
    """Per run and role with KV transfers: slo's distribution, its engine-vs-model comparison
    (the plain link fit), and the engine-shaped prediction beside it."""
    rows = []
    for (state, dep, rate, role), per_rep in sorted(roles.items(), key=lambda kv: str(kv[0])):
        kvs = [r["kv_transfer"] for r in per_rep if (r.get("kv_transfer") or {}).get("source") == "histogram"
               and r["kv_transfer"]["total"]["transfers"]]
        if not kvs:
            continue
        totals = [k["total"] for k in kvs]
        models = [k["model"] for k in kvs if k.get("model")]
        rows.append({"cache_state": state, "deployment": dep, "rate_rps": rate, "role": role,
                     "repeats": len(kvs), "transfers": median_spread([t["transfers"] for t in totals]),
                     **{k: median_spread([t[k] for t in totals])
                        for k in ("mean_bytes", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "observed_gb_s")},
                     "time_buckets_ms": _pool_buckets([t.get("time_buckets_ms") or [] for t in totals]),
                     "model": _model_summary(models),
                     "engine_shaped": _engine_shaped(totals, engine_points)})
    return rows


def _engine_shaped(totals: list[dict], points: list | None) -> dict | None:
    """kvbench p2p --nixl-engine-profile lab's NIXL xferDuration mean at each repeat's mean bytes,
    and the engine's mean time over it (kvbench.lab.load.handoff.engine_shaped_at)."""
    from kvbench.lab.load.handoff import engine_shaped_at

    if not points:
        return None
    preds = [(t, engine_shaped_at(points, t["mean_bytes"])) for t in totals if t.get("mean_bytes")]
    preds = [(t, p) for t, p in preds if p is not None]
    if not preds:
        return None
    return {"predicted_ms": median_spread([p["xfer_ms"] for _, p in preds]),
            "ratio": median_spread([t["mean_ms"] / p["xfer_ms"] for t, p in preds
                                    if t.get("mean_ms") is not None and p["xfer_ms"] > 0])}


def _pool_buckets(per_rep: list[list]) -> list[list]:
    pooled: dict = {}
    for buckets in per_rep:
        for le, n in buckets:
            pooled[le] = pooled.get(le, 0.0) + n
    return sorted(([le, n] for le, n in pooled.items()), key=lambda x: float(x[0]))


def _model_summary(models: list[dict]) -> dict | None:
    """The fitted model beside the engine over repeats: prediction, its 95% band, the ratio."""
    if not models:
        return None
    bands = [m["predicted_band_ms"] for m in models if m.get("predicted_band_ms")]
    ratio_bands = [m["observed_over_band"] for m in models if m.get("observed_over_band")]
    return {"link": models[0]["link"], "setup_ms": models[0]["setup_ms"],
            "effective_gb_s": models[0]["effective_gb_s"],
            "predicted_ms": median_spread([m["predicted_mean_ms"] for m in models]),
            "predicted_band_ms": [min(b[0] for b in bands), max(b[1] for b in bands)] if bands else None,
            "no_band": next((m["no_band"] for m in models if m.get("no_band")), None),
            "ratio": median_spread([m["observed_over_predicted"] for m in models]),
            "ratio_band": ([min(b[0] for b in ratio_bands), max(b[1] for b in ratio_bands)]
                           if ratio_bands else None)}


def machine_note(runs: list[dict]) -> dict:
    loads = [x for r in runs for x in (r.get("load_before"), r.get("load_after")) if x is not None]
    cores = os.cpu_count() or 1
    busy = bool(loads) and max(loads) > 0.75 * cores
    return {"host": platform.node(), "cores": cores, "cpu": platform.processor() or platform.machine(),
            "load_1min_min": min(loads) if loads else None, "load_1min_max": max(loads) if loads else None,
            "busy": busy}


def provenance(out: Path) -> dict:
    """Command, versions and kvbench commit: what a results/ file must say about itself."""
    from kvbench.lab.stack import deploy
    from kvbench.lab.stack import env as labenv

    meta = json.loads((out / "sweep.json").read_text())
    try:
        commit = subprocess.run(["git", "-C", str(deploy.REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"command": meta.get("command"), "started": meta.get("started"), "kvbench_commit": commit,
            "vllm": labenv.VLLM_VERSION, "nixl": labenv.NIXL_VERSION, "python": platform.python_version(),
            "client": client_label(meta.get("client", "vllm"))}


def client_label(client: str) -> str:
    """The load generator and the version its converter was checked on (kvbench.lab.load.clients)."""
    from kvbench.lab.load.clients import VERSIONS

    return "vllm bench serve" if client == "vllm" else f"{client} {VERSIONS[client]}"


def _capacities(analyses: dict, runs: list[dict], plan) -> tuple[dict, dict]:
    """capacity[state] and verdicts[state], one entry per repeat, cut below runs that failed."""
    capacity: dict = {}
    verdicts: dict = {}
    for rep, a in sorted(analyses.items()):
        if not a or "capacity" not in a:
            continue
        by_state = {v["cache_state"]: v["text"] for v in a["verdicts"]}
        for state in plan.cache_states:
            failed = {d: [r["p"].rate_rps for r in runs if r["p"].repeat == rep and r["p"].cache_state == state
                          and r["p"].deployment == d and r["status"] != "done"] for d in plan.deployments}
            caps = [adjusted_capacity(c, failed[c["deployment"]]) for c in a["capacity"]
                    if c.get("cache_state", state) == state]
            capacity.setdefault(state, []).append(caps)
            note = " (runs failed: capacity cut below them)" if any(failed.values()) else ""
            verdicts.setdefault(state, []).append(by_state.get(state, "no verdict (no run of this state)") + note)
    return capacity, verdicts


def write_report(out: Path, plan, pts, fit: Path | None, engine_ref: Path | None = None) -> str:
    from kvbench.lab.sweep.fmt import markdown, plot_sweep

    runs = load_runs(out, pts)
    reps = sorted({p.repeat for p in pts})
    analyses = {k: run_analyze(out, plan, k, [r for r in runs if r["p"].repeat == k], fit) for k in reps}
    capacity, verdicts = _capacities(analyses, runs, plan)
    roles = engine_roles(analyses)
    from kvbench.lab.load.handoff import engine_shaped_points

    engine_points = engine_shaped_points(engine_ref) if engine_ref else None
    report = {"schema": SCHEMA_SWEEP_REPORT, "plan": plan.path, "machine": machine_note(runs),
              "provenance": provenance(out),
              "runs": [{k: v for k, v in r.items() if k not in ("folder", "p")} for r in runs],
              "analysis_errors": {k: a["error"] for k, a in analyses.items() if a and "error" in a},
              "capacity": capacity, "verdicts": verdicts, "points": point_table(analyses, plan),
              "scheduler": scheduler_table(roles), "kv_transfers": kv_table(roles, engine_points),
              "handoff_fit": str(fit) if fit else None,
              "engine_shaped_reference": str(engine_ref) if engine_ref else None,
              "attainment_min_pct": 100 * plan.criteria.slo_attainment_min}
    slo_plots = sorted(str(p.relative_to(out)) for p in (out / "analysis").glob("rep*.png") if ".stale-" not in p.name)
    report["plots"] = plot_sweep(out, report) + slo_plots
    report["files"] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    as_contract(SweepReport, json.loads(json.dumps(report, default=str)), "the sweep's report")
    text = markdown(report, plan)
    (out / "sweep-report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "sweep-report.md").write_text(text)
    return text
