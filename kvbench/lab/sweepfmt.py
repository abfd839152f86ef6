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


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}"


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


def _points_lines(report: dict) -> list[str]:
    out = ["| cache | deployment | rate rps | repeats | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
           "attainment % | throughput rps | passed |", "|" + "---|" * 10]
    for r in report["points"]:
        out.append(f"| {r['cache_state']} | {r['deployment']} | {r['rate_rps']:g} | {r['repeats']} | "
                   f"{_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p99_ms'])} | {_ms(r['tpot_p50_ms'], 1)} | "
                   f"{_ms(r['attainment_pct'], 1)} | {_ms(r['throughput_rps'], 2)} | "
                   f"{'/'.join('yes' if p else 'no' for p in r['passed'])} |")
    return out + ["", "Cells: median over repeats [min-max]; each repeat's percentile is over its own "
                  "requests after warm-up (kvbench slo's definitions)."]


def _kv_lines(report: dict) -> list[str]:
    out = ["| cache | rate rps | transfers | mean bytes | mean ms | p50 / p90 / p99 ms (bucket est.) | "
           "model ms [box] | engine/model |", "|" + "---|" * 8]
    for r in report["kv_transfers"]:
        cmp_ = r["engine_vs_model"] or {}
        box = (f"{cmp_['model_ms']:.3f} [{cmp_['model_low_ms']:.3f}-{cmp_['model_high_ms']:.3f}]"
               if cmp_.get("model_low_ms") is not None else
               (f"{cmp_['model_ms']:.3f}" if cmp_ else "-"))
        qs = " / ".join("-" if r[f"p{q}_ms_bucket_estimate"] is None else f"{r[f'p{q}_ms_bucket_estimate']:.2f}"
                        for q in (50, 90, 99))
        ratio = "-" if not cmp_ else f"{cmp_['ratio']:.2f}"
        per = ", ".join(f"{x:.2f}" for x in r["ratio_per_repeat"] if x is not None)
        out.append(f"| {r['cache_state']} | {r['rate_rps']:g} | {r['transfers']:.0f} | {r['mean_bytes']:,.0f} | "
                   f"{r['mean_ms']:.3f} | {qs} | {box} | {ratio}{f' (repeats {per})' if per else ''} |")
    return out + ["", "From the decode instance's own NIXL histograms (read before and after each run). "
                  "Bucket estimates interpolate inside Prometheus buckets (bounded by the bucket edges). "
                  "Model: kvbench's fitted setup + bytes/GB/s from `kvbench p2p --transport nixl` on this "
                  "machine; the box combines the two marginal 95% intervals (not a joint interval)."]


def markdown(report: dict, plan) -> str:
    m = report["machine"]
    busy = ("**busy machine**: other jobs shared the cores, so latencies are noisy and high"
            if m["busy"] else "machine not busy by the 1-min load average")
    pv = report.get("provenance") or {"command": None, "started": "?", "vllm": "?", "nixl": "?",
                                      "python": "?", "kvbench_commit": "?"}
    lines = ["# kvbench sweep report", "", f"Plan: `{report['plan']}`. {plan.summary()}", "",
             f"Command: `{' '.join(pv['command'] or [])}` (started {pv['started']}); vLLM {pv['vllm']} "
             f"(CPU build), nixl {pv['nixl']}, Python {pv['python']}, kvbench {pv['kvbench_commit']}.", "",
             f"Host {m['host']} ({m['cores']} cores); 1-min load average during runs "
             f"{_num(m['load_1min_min'])}-{_num(m['load_1min_max'])}: {busy}.", "",
             "## Capacity, first failing gate and verdict", "", *_capacity_lines(report),
             "## Per point", "", *_points_lines(report), "",
             "## KV transfers (disaggregated) and the engine against kvbench's model", "", *_kv_lines(report), "",
             "## Plots", "", *[f"- `{p}`" for p in report["plots"]], "",
             f"## Raw files ({len(report['files'])})", "",
             "Every run folder keeps the vllm bench result and log, the converted records, the scrape, "
             "and the /metrics text of every instance before and after the run: see sweep-report.json "
             "`files` for the full list.", ""]
    return "\n".join(lines)


def plot_spread_and_kv(out: Path, report: dict) -> list[str]:
    """TTFT and attainment against rate with the spread over repeats; the transfer-time buckets."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for state in sorted({r["cache_state"] for r in report["points"]}):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        _spread_axes(axes[:2], [r for r in report["points"] if r["cache_state"] == state])
        _kv_axis(axes[2], [r for r in report["kv_transfers"] if r["cache_state"] == state])
        busy = " (busy machine)" if report["machine"]["busy"] else ""
        fig.suptitle(f"kvbench sweep, cache state {state}{busy}")
        fig.tight_layout()
        path = out / f"sweep-{state}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


COLORS = {"aggregated": "tab:blue", "disaggregated": "tab:red"}


def _spread_axes(axes, rows) -> None:
    for dep in sorted({r["deployment"] for r in rows}):
        rs = sorted((r for r in rows if r["deployment"] == dep), key=lambda r: r["rate_rps"])
        x = [r["rate_rps"] for r in rs]
        color = COLORS.get(dep)
        for key, style, name in (("ttft_p50_ms", "o:", "P50"), ("ttft_p99_ms", "s-", "P99")):
            med = [r[key]["median"] for r in rs]
            err = [[m - r[key]["min"] if m is not None else 0 for m, r in zip(med, rs, strict=True)],
                   [r[key]["max"] - m if m is not None else 0 for m, r in zip(med, rs, strict=True)]]
            axes[0].errorbar(x, med, yerr=err, fmt=style, capsize=3, color=color, label=f"{dep} TTFT {name}")
        att = [r["attainment_pct"]["median"] for r in rs]
        axes[1].plot(x, att, "o-", color=color, label=dep)
    axes[0].set(xlabel="offered rate (requests/s)", ylabel="TTFT (ms)", title="TTFT median [min-max] over repeats")
    axes[0].set_yscale("log")
    axes[1].set(xlabel="offered rate (requests/s)", ylabel="attainment (%)", title="SLO attainment (declared)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)


def _kv_axis(ax, rows) -> None:
    for r in rows:
        edges = [le for le, _ in r["buckets_s"]]
        counts, prev = [], 0.0
        for _, c in r["buckets_s"]:
            counts.append(c - prev)
            prev = c
        labels = [f"<={le * 1000:g}" if le != float("inf") else ">" for le in edges]
        ax.plot(range(len(labels)), counts, "o-", label=f"{r['rate_rps']:g} rps")
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
    ax.set(xlabel="per-transfer time bucket (ms)", ylabel="transfers", title="decode NIXL transfer time")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
