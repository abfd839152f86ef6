"""How the sweep report reads: the markdown text and the plots (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _ms(v: dict, digits: int = 0) -> str:
    if v["median"] is None:
        return "-"
    f = f"{{:.{digits}f}}"
    if v["n"] < 2 or v["min"] == v["max"]:
        return f.format(v["median"])
    return f"{f.format(v['median'])} [{f.format(v['min'])}-{f.format(v['max'])}]"


def _num(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _capacity_lines(report: dict) -> list[str]:
    out = []
    for state, per_rep in report["capacity"].items():
        out.append(f"### Cache state: {state}")
        for k, caps in enumerate(per_rep, 1):
            for c in caps:
                cap = "none" if c["capacity_rps"] is None else f"{c['capacity_rps']:g} rps"
                gates = ", ".join(c.get("first_failing_gates") or []) or "-"
                first = c.get("first_failing_rate_rps")
                out.append(f"- repeat {k}: **{c['deployment']}** capacity {cap}; first failing rate "
                           f"{'-' if first is None else f'{first:g} rps'} (gates: {gates})")
        for k, v in enumerate(report["verdicts"].get(state, []), 1):
            out.append(f"- verdict (repeat {k}): {v}")
        out.append("")
    return out


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def _points_lines(report: dict) -> list[str]:
    rows = [[r["cache_state"], r["deployment"], f"{r['rate_rps']:g}", str(r["repeats"]), _ms(r["ttft_p50_ms"]),
             _ms(r["ttft_p99_ms"]), _ms(r["tpot_p50_ms"], 1), _ms(r["tpot_p99_ms"], 1),
             _ms(r["attainment_pct"], 1), _ms(r["throughput_rps"], 2),
             "/".join("yes" if p else "no" for p in r["passed"])] for r in report["points"]]
    return _table(["cache", "deployment", "rate rps", "repeats", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                   "TPOT p99 ms", "attainment %", "throughput rps", "passed"], rows) + [
        "", "Cells: median over repeats [min-max]; each repeat's percentile is over its own "
        "requests after warm-up (kvbench slo's definitions)."]


def _scheduler_lines(report: dict) -> list[str]:
    rows = [[r["cache_state"], r["deployment"], f"{r['rate_rps']:g}", r["role"], "/".join(map(str, r["scrapes"])),
             "/".join(r["queue_trend"]), f"{_ms(r['waiting_first_third'], 2)} -> {_ms(r['waiting_last_third'], 2)}",
             _ms(r["running_last_third"], 2), _ms(r["kv_usage_max"], 4), _num(r["failed_transfers"], 0),
             _num(r["kv_expired"], 0)] for r in report["scheduler"]]
    return _table(["cache", "deployment", "rate rps", "role", "scrapes", "queue (per repeat)",
                   "waiting first -> last third", "running last third", "KV usage max", "failed transfers",
                   "expired KV"], rows) + [
        "", "From each instance's own /metrics (`kvbench slo scrape`, every 1 s during the run), judged "
        "by `kvbench slo analyze --metrics`: the waiting-queue gauge averaged over the first and the "
        "last third of the scrapes, growing when last > 1.5 x first and by more than 1 request "
        "('-': fewer than 9 scrapes). vLLM counts expired KV leases on the prefill instance."]


def _band(band: list | None, spec: str) -> str:
    return "" if not band else f" [{band[0]:{spec}}-{band[1]:{spec}}]"


def _kv_lines(report: dict) -> list[str]:
    rows = []
    for r in report["kv_transfers"]:
        m = r["model"] or {}
        model = (f"{_ms(m['predicted_ms'], 3)}{_band(m['predicted_band_ms'], '.3f')}" if m else "-")
        ratio = (f"{_ms(m['ratio'], 2)}{_band(m['ratio_band'], '.2f')}" if m else "-")
        qs = " / ".join(_ms(r[f"p{q}_ms"], 2) for q in (50, 90, 99))
        es = r.get("engine_shaped") or {}
        rows.append([r["cache_state"], f"{r['rate_rps']:g}", r["role"], _ms(r["transfers"]), _ms(r["mean_bytes"]),
                     _ms(r["mean_ms"], 3), qs, _ms(r["observed_gb_s"], 4),
                     _ms(es.get("predicted_ms"), 3) if es else "-",
                     _ms(es.get("ratio"), 2) if es else "-", model, ratio])
    out = _table(["cache", "rate rps", "role", "transfers", "mean bytes", "mean ms",
                  "p50 / p90 / p99 ms (bucket est.)", "observed GB/s", "engine-shaped ms",
                  "engine/engine-shaped", "plain model ms [95% band]",
                  "engine/plain model [vs band]"], rows)
    link = next((r["model"] for r in report["kv_transfers"] if r["model"]), None)
    fit = (f"Model: `{link['link']}` from `{report['handoff_fit']}`: setup {link['setup_ms']:.4g} ms + "
           f"{link['effective_gb_s']:.4g} GB/s (kvbench p2p --transport nixl on this machine, then kvbench "
           "fit); the band is 95% of the fit's joint bootstrap draws at the engine's mean bytes (the "
           "model's uncertainty, not the spread of single transfers)"
           + (f"; no band: {link['no_band']}" if link.get("no_band") else "") + "." if link else
           "No fitted model beside the engine (`--no-handoff-model`, or no transfers).")
    ref = report.get("engine_shaped_reference")
    shaped = (f"Engine-shaped: `kvbench p2p --nixl-engine-profile lab` records `{ref}` (vLLM 0.32's regions, "
              "descriptors, per-request READ, 1 ms step polling, the lab's agent settings; docs/nixl.md): "
              "NIXL's own xferDuration mean, the quantity behind vllm:nixl_xfer_time_seconds, at the "
              "engine's mean bytes (interpolated between measured sizes). The plain model is the link "
              "shape (busy-polled, reused handles): what the interconnect can do, not what the engine "
              "pays. " if ref else "No engine-shaped reference (`--no-handoff-model`). ")
    return out + ["", shaped + "From the decode instance's own NIXL histograms over each run (`kvbench slo analyze "
                  "--metrics --fit`). Percentiles interpolate inside Prometheus buckets ('-': too few "
                  "transfers for that percentile); cells are medians over repeats [min-max]. " + fit]


def _run_name(run: dict) -> str:
    pt = run.get("point") or {}
    return (f"run {pt.get('deployment')} {pt.get('cache_state')} at {pt.get('rate_rps', 0):g} rps, "
            f"repeat {pt.get('repeat')}")


def markdown(report: dict, plan) -> str:
    m = report["machine"]
    busy = ("**busy machine**: other jobs shared the cores, so latencies are noisy and high"
            if m["busy"] else "machine not busy by the 1-min load average")
    pv = report.get("provenance") or {"command": None, "started": "?", "vllm": "?", "nixl": "?",
                                      "python": "?", "kvbench_commit": "?"}
    errors = [f"- analysis of repeat {k} failed: {e}" for k, e in report.get("analysis_errors", {}).items()]
    errors += [f"- {_run_name(r)}: {r['client_shortfall']['line']}" for r in report["runs"]
               if r.get("client_shortfall")]
    lines = ["# kvbench sweep report", "", f"Plan: `{report['plan']}`. {plan.summary()}", "",
             f"Command: `{' '.join(pv['command'] or [])}` (started {pv['started']}); vLLM {pv['vllm']} "
             f"(CPU build), nixl {pv['nixl']}, Python {pv['python']}, kvbench {pv['kvbench_commit']}; "
             f"load generator {pv.get('client', 'vllm bench serve')}.", "",
             f"Host {m['host']} ({m['cores']} cores); 1-min load average during runs "
             f"{_num(m['load_1min_min'])}-{_num(m['load_1min_max'])}: {busy}.", "",
             *errors, *([""] if errors else []),
             "## Capacity, first failing gate and verdict", "", *_capacity_lines(report),
             "## Per point", "", *_points_lines(report), "",
             "## Scheduler: queues per role", "", *_scheduler_lines(report), "",
             "## KV transfers and the engine against kvbench's model", "", *_kv_lines(report), "",
             "## Plots", "", *[f"- `{p}`" for p in report["plots"]], "",
             f"## Raw files ({len(report['files'])})", "",
             "Every run folder keeps the load generator's result and log, the converted records, the scrape of "
             "every instance's /metrics (`scrape.jsonl`) and `run.json`; `analysis/` holds kvbench slo's "
             "JSON reports and plots, `handoff-model/` the p2p records and fit: see sweep-report.json "
             "`files` for the full list.", ""]
    return "\n".join(lines)


def plot_sweep(out: Path, report: dict) -> list[str]:
    """Per cache state: TTFT, TPOT and attainment against rate (median and spread over
    repeats), and the per-transfer time distribution from the engine's buckets."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for state in sorted({r["cache_state"] for r in report["points"]}):
        fig, axes = plt.subplots(2, 2, figsize=(13, 9))
        rows = [r for r in report["points"] if r["cache_state"] == state]
        _latency_axis(axes[0][0], rows, "ttft", "TTFT")
        _latency_axis(axes[0][1], rows, "tpot", "TPOT")
        _attainment_axis(axes[1][0], rows, report.get("attainment_min_pct"))
        _kv_axis(axes[1][1], [r for r in report["kv_transfers"] if r["cache_state"] == state])
        busy = " (busy machine)" if report["machine"]["busy"] else ""
        fig.suptitle(f"kvbench sweep, cache state {state}{busy}")
        fig.tight_layout()
        path = out / f"sweep-{state}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    return written


COLORS = {"aggregated": "tab:blue", "disaggregated": "tab:red"}


def _by_deployment(rows):
    for dep in sorted({r["deployment"] for r in rows}):
        yield dep, sorted((r for r in rows if r["deployment"] == dep), key=lambda r: r["rate_rps"])


def _latency_axis(ax, rows, metric: str, name: str) -> None:
    for dep, rs in _by_deployment(rows):
        x = [r["rate_rps"] for r in rs]
        for q, style in ((50, "o:"), (99, "s-")):
            cells = [r[f"{metric}_p{q}_ms"] for r in rs]
            med = [c["median"] for c in cells]
            err = [[m - c["min"] if m is not None else 0 for m, c in zip(med, cells, strict=True)],
                   [c["max"] - m if m is not None else 0 for m, c in zip(med, cells, strict=True)]]
            ax.errorbar(x, med, yerr=err, fmt=style, capsize=3, color=COLORS.get(dep), label=f"{dep} P{q}")
    ax.set(xlabel="offered rate (requests/s)", ylabel=f"{name} (ms)", title=f"{name} median [min-max] over repeats")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _attainment_axis(ax, rows, minimum_pct: float | None) -> None:
    for dep, rs in _by_deployment(rows):
        ax.plot([r["rate_rps"] for r in rs], [r["attainment_pct"]["median"] for r in rs], "o-",
                color=COLORS.get(dep), label=dep)
    if minimum_pct is not None:
        ax.axhline(minimum_pct, color="gray", linestyle="--", label=f"plan's minimum {minimum_pct:g}%")
    ax.set(xlabel="offered rate (requests/s)", ylabel="attainment (% of offered after warm-up)",
           title="SLO attainment (declared denominator)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _kv_axis(ax, rows) -> None:
    for r in rows:
        labels = [f"<={le:g}" if le != "+Inf" else ">" for le, _ in r["time_buckets_ms"]]
        ax.plot(range(len(labels)), [n for _, n in r["time_buckets_ms"]], "o-",
                label=f"{r['deployment']} {r['role']} {r['rate_rps']:g} rps")
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
    ax.set(xlabel="per-transfer time bucket (ms, the engine's own bounds)", ylabel="transfers",
           title="KV transfers: engine's time per transfer")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
