"""The sweep's one report: capacity, first failing gate and verdict per cache state (from
`kvbench slo analyze`), medians with their spread over repeats, the KV-transfer
distribution and the engine-vs-model handoff ratio, plots, and every raw file.

Judging stays in kvbench.slo: this module runs `kvbench slo analyze` once per cache
state and repeat, then only arranges its answers. A run that produced no records (the
deployment stopped answering) fails its rate: capacity is cut below it and the
verdict says so.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from kvbench.lab import handoff
from kvbench.lab.planfile import _slo_view
from kvbench.lab.promtext import bucket_quantile, histogram, histogram_delta
from kvbench.lab.scrapeglue import slo_has_scrape

XFER = "vllm:nixl_xfer_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"


def slo_plan_path(out: Path, plan_path: str) -> Path:
    """The plan as the installed slo checker accepts it (itself, or the adapted view)."""
    from kvbench.slo.plan import check_plan

    data = yaml.safe_load(Path(plan_path).read_text())
    if not check_plan(data)[1]:
        return Path(plan_path)
    view = out / "analysis" / "plan.slo.yaml"
    if not view.exists():
        view.parent.mkdir(parents=True, exist_ok=True)
        view.write_text(yaml.safe_dump(_slo_view(data), sort_keys=False))
    return view


def analyze_supports(flag: str) -> bool:
    from kvbench.lab.scrapeglue import slo_supports

    return slo_supports("analyze", flag)


def run_analyze(out: Path, plan_path: Path, state: str, rep: int, runs: list[dict], fit: Path | None) -> dict | None:
    """`kvbench slo analyze` over one cache state and repeat; its JSON report, or None."""
    records = [str(r["folder"] / "records.jsonl") for r in runs if r["status"] == "done"]
    if not records:
        return None
    stem = out / "analysis" / f"{state}-rep{rep}"
    if not stem.with_suffix(".json").exists():
        cmd = [sys.executable, "-m", "kvbench", "slo", "analyze", *records, "--plan", str(plan_path),
               "--format", "json", "--out", str(stem.with_suffix(".json")), "--plot", str(stem.with_suffix(".png"))]
        if slo_has_scrape() and analyze_supports("--metrics"):
            for r in runs:
                cmd += ["--metrics", str(r["folder"] / "scrape.jsonl")]
            if fit is not None and analyze_supports("--fit"):
                cmd += ["--fit", str(fit)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (stem.with_suffix(".log")).write_text(proc.stdout[-4000:] + proc.stderr)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "analyze failed"}
    return json.loads(stem.with_suffix(".json").read_text())


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


def kv_distribution(run: dict) -> dict | None:
    """Decode's NIXL histograms over one run: transfer count, bytes, time and its buckets."""
    path = run["folder"] / "metrics-before-after.json"
    if not path.exists():
        return None
    snap = json.loads(path.read_text())
    key = next((k for k in snap["after"] if k.startswith("decode")), None)
    if key is None or not snap["before"].get(key) or not snap["after"].get(key):
        return None
    xfer = histogram_delta(histogram(snap["before"][key], XFER), histogram(snap["after"][key], XFER))
    nbytes = histogram_delta(histogram(snap["before"][key], BYTES), histogram(snap["after"][key], BYTES))
    return {"xfer": xfer, "bytes": nbytes}


def median_spread(values: list[float | None]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def point_table(analyses: dict, states, deployments, rates) -> list[dict]:
    """Per cache state x deployment x rate: median [min-max] over repeats of the key figures."""
    rows = []
    for s in states:
        for d in deployments:
            for r in rates:
                groups = [g for a in analyses.get(s, []) if a and "groups" in a for g in a["groups"]
                          if g["deployment"] == d and abs(g["offered_rate_rps"] - r) < 1e-9]
                if not groups:
                    continue
                rows.append({"cache_state": s, "deployment": d, "rate_rps": r, "repeats": len(groups),
                             "ttft_p50_ms": _lat(groups, "ttft", 50),
                             "ttft_p99_ms": _lat(groups, "ttft", 99),
                             "tpot_p50_ms": _lat(groups, "tpot", 50),
                             "attainment_pct": median_spread([g["attainment"]["declared_pct"] for g in groups]),
                             "throughput_rps": median_spread([g["throughput"]["throughput_rps"] for g in groups]),
                             "passed": [g["passed"] for g in groups]})
    return rows


def _lat(groups: list[dict], metric: str, q: int) -> dict:
    return median_spread([g["latency_ms"][metric][f"p{q}_ms"] for g in groups])


def kv_table(runs: list[dict], fit: Path | None) -> list[dict]:
    """Per cache state x rate (disaggregated): pooled transfers and the engine-vs-model ratio."""
    rows = []
    keys = sorted({(r["p"].cache_state, r["p"].rate_rps) for r in runs if r["p"].deployment == "disaggregated"})
    for state, rate in keys:
        dists = [kv_distribution(r) for r in runs if r["p"].deployment == "disaggregated"
                 and r["p"].cache_state == state and r["p"].rate_rps == rate]
        dists = [d for d in dists if d and d["xfer"]["count"] > 0]
        if not dists:
            continue
        pooled = {k: _pool([d[k] for d in dists]) for k in ("xfer", "bytes")}
        cmp_runs = [handoff.compare(fit, d["xfer"], d["bytes"]) for d in dists] if fit else []
        rows.append({"cache_state": state, "rate_rps": rate, "transfers": pooled["xfer"]["count"],
                     "mean_bytes": pooled["bytes"]["sum"] / pooled["bytes"]["count"],
                     "mean_ms": pooled["xfer"]["sum"] / pooled["xfer"]["count"] * 1000.0,
                     **{f"p{q}_ms_bucket_estimate": _ms(bucket_quantile(pooled["xfer"], q / 100)) for q in (50, 90, 99)},
                     "buckets_s": pooled["xfer"]["buckets"],
                     "engine_vs_model": _pooled_compare(fit, pooled) if fit else None,
                     "ratio_per_repeat": [c["ratio"] for c in cmp_runs if c]})
    return rows


def _pooled_compare(fit, pooled):
    return handoff.compare(fit, pooled["xfer"], pooled["bytes"])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _pool(hists: list[dict]) -> dict:
    buckets: dict[float, float] = {}
    for h in hists:
        for le, c in h["buckets"]:
            buckets[le] = buckets.get(le, 0.0) + c
    return {"buckets": sorted(buckets.items()), "sum": sum(h["sum"] for h in hists),
            "count": sum(h["count"] for h in hists)}


def machine_note(runs: list[dict]) -> dict:
    loads = [x for r in runs for x in (r.get("load_before"), r.get("load_after")) if x is not None]
    cores = os.cpu_count() or 1
    busy = bool(loads) and max(loads) > 0.75 * cores
    return {"host": platform.node(), "cores": cores, "cpu": platform.processor() or platform.machine(),
            "load_1min_min": min(loads) if loads else None, "load_1min_max": max(loads) if loads else None,
            "busy": busy}


def provenance(out: Path) -> dict:
    """Command, versions and kvbench commit: what a results/ file must say about itself."""
    from kvbench.lab import deploy
    from kvbench.lab import env as labenv

    meta = json.loads((out / "sweep.json").read_text())
    try:
        commit = subprocess.run(["git", "-C", str(deploy.REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"command": meta.get("command"), "started": meta.get("started"), "kvbench_commit": commit,
            "vllm": labenv.VLLM_VERSION, "nixl": labenv.NIXL_VERSION, "python": platform.python_version()}


def write_report(out: Path, plan, lab_plan, pts, fit: Path | None) -> str:
    from kvbench.lab.sweepfmt import markdown, plot_spread_and_kv

    runs = load_runs(out, pts)
    states, rates = lab_plan.cache_states, list(plan.offered_rates_rps)
    reps = sorted({p.repeat for p in pts})
    slo_plan = slo_plan_path(out, lab_plan.path)
    analyses, capacity, verdicts = {}, {}, {}
    for s in states:
        for k in reps:
            mine = [r for r in runs if r["p"].cache_state == s and r["p"].repeat == k]
            a = run_analyze(out, slo_plan, s, k, mine, fit)
            analyses.setdefault(s, []).append(a)
            if a and "capacity" in a:
                failed = {d: [r["p"].rate_rps for r in mine if r["p"].deployment == d and r["status"] != "done"]
                          for d in plan.deployments}
                capacity.setdefault(s, []).append([adjusted_capacity(c, failed.get(c["deployment"], []))
                                                   for c in a["capacity"]])
                note = " (runs failed: capacity cut below them)" if any(failed.values()) else ""
                verdicts.setdefault(s, []).append(a["verdict"]["text"] + note)
    report = {"schema": "kvbench.lab.sweep-report/1", "plan": lab_plan.path, "machine": machine_note(runs),
              "provenance": provenance(out),
              "runs": [{k: v for k, v in r.items() if k not in ("folder", "p")} for r in runs],
              "capacity": capacity, "verdicts": verdicts,
              "points": point_table(analyses, states, plan.deployments, rates),
              "kv_transfers": kv_table(runs, fit), "handoff_fit": str(fit) if fit else None}
    report["plots"] = plot_spread_and_kv(out, report)
    report["files"] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    text = markdown(report, plan)
    (out / "sweep-report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "sweep-report.md").write_text(text)
    return text

