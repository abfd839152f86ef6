"""Human renderings of the SLO report (table, markdown) and its plots; JSON is the report itself."""

from __future__ import annotations

import io
from pathlib import Path

from kvbench.errors import UsageError


def _f(x, fmt: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _pcts(s: dict) -> str:
    return f"p50 {_f(s['p50_ms'])}  p95 {_f(s['p95_ms'])}  p99 {_f(s['p99_ms'])}  max {_f(s['max_ms'])}"


def _state(row: dict) -> str:
    return f" [{row['cache_state']}]" if row.get("cache_state") else ""


_QUEUE_WORD = {True: "growing", False: "stable", None: "not judged"}


def _gate_word(passed) -> str:
    return {True: "pass", False: "FAIL", None: "n/a"}[passed]


def _criteria_line(r: dict) -> str:
    c = r["criteria"]
    lim = []
    if c["ttft_max_ms"] is not None:
        lim.append(f"TTFT <= {c['ttft_max_ms']:g} ms")
    if c["tpot_max_ms"] is not None:
        lim.append(f"TPOT <= {c['tpot_max_ms']:g} ms (>= {c['output_tokens_minimum_for_tpot']} tokens)")
    if c["max_itl_per_request_ms"] is not None:
        lim.append(f"max ITL/request <= {c['max_itl_per_request_ms']:g} ms")
    if c["request_deadline_ms"] is not None:
        lim.append(f"deadline {c['request_deadline_ms'] / 1000:g} s")
    att = ("no attainment minimum" if c["slo_attainment_min"] is None
           else f"attainment >= {100 * c['slo_attainment_min']:g}% of {c['denominator']}")
    err = ("error rate: no maximum" if c["error_rate_max"] is None
           else f"error rate <= {100 * c['error_rate_max']:g}%")
    return (f"limits: {', '.join(lim)}; numerator {c['numerator']}; {att}; {err}; "
            f"queue growth check {'on' if c['require_no_sustained_queue_growth'] else 'off'}; "
            f"warm-up {c['warmup_requests']} requests")


def _ms(x) -> str:
    return _f(x, ".3f")


def _transfer_lines(kv: dict | None) -> list[str]:
    if kv is None:
        return ["    KV transfer  no KV-transfer metrics in this role's samples"]
    if kv["source"] == "sampled_gauge":
        return [f"    KV transfer  {kv['metric']}: {kv['samples']} scrape samples, median "
                f"{_ms(kv['median_ms'])} ms, max {_ms(kv['max_ms'])} ms ({kv['note']})"]
    t = kv["total"]
    out = [f"    KV transfer  {_f(t['transfers'], '.0f')} transfers, {_f(t['bytes'], ',.0f')} B, mean "
           f"{_f(t['mean_bytes'], ',.0f')} B and {_ms(t['mean_ms'])} ms; p50/p90/p99 {_ms(t['p50_ms'])}/"
           f"{_ms(t['p90_ms'])}/{_ms(t['p99_ms'])} ms (bucket-interpolated; '-': too few transfers); observed "
           f"{_f(t['observed_gb_s'], '.4g')} GB/s" + (f"; {kv['resets_skipped']} counter reset(s) skipped"
                                                     if kv["resets_skipped"] else "")]
    shown = kv["windows"][:12]
    for w in shown:
        out.append(f"      {w['from_s']:7.1f}-{w['to_s']:7.1f} s  {_f(w['transfers'], '5.0f')} transfers  "
                   f"mean {_f(w['mean_bytes'], ',.0f')} B  {_ms(w['mean_ms'])} ms  p50 {_ms(w['p50_ms'])}  "
                   f"p90 {_ms(w['p90_ms'])}  p99 {_ms(w['p99_ms'])} ms")
    if len(kv["windows"]) > len(shown):
        out.append(f"      ... {len(kv['windows']) - len(shown)} more windows in the JSON report")
    m = kv.get("model")
    if m:
        out.append(f"    vs model     {m['link']}: setup {_f(m['setup_ms'], '.4g')} ms + {m['effective_gb_s']:.4g} GB/s "
                   f"-> {_ms(m['predicted_mean_ms'])} ms{_band(m['predicted_band_ms'])} for the mean transfer; "
                   f"engine observed {_ms(m['observed_mean_ms'])} ms = {_f(m['observed_over_predicted'], '.3f')} "
                   f"x the model{_band(m['observed_over_band'], '.3f')}")
    return out


def _band(band: list | None, spec: str = ".3f") -> str:
    return "" if not band else f" [95% band {band[0]:{spec}}-{band[1]:{spec}}]"


def _inc(counter: dict | None) -> str:
    return "n/a (not exported)" if counter is None else f"+{counter['increase']:.0f}"


def _trend(t: dict) -> str:
    if t["growing"] is None:
        return f"not judged ({t['reason']})"
    return t["reason"]


def format_engine_metrics(r: dict) -> list[str]:
    lines: list[str] = []
    for e in r.get("engine_metrics") or []:
        lab = ", ".join(f"{k} {v}" for k, v in e["labels"].items() if v is not None)
        lines.append(f"engine metrics {e['file']}" + (f" ({lab})" if lab else "")
                     + ("; INTERRUPTED scrape" if e["interrupted"] else "")
                     + ("" if e["complete"] else "; no end line: the scrape did not finish"))
        for role in e["roles"]:
            gaps = role["gaps"]
            gap_s = (f"; {sum(g['count'] for g in gaps)} failed scrape(s) in {len(gaps)} gap(s), first "
                     f"at {gaps[0]['from_s']:.1f} s: {gaps[0]['error']}" if gaps else "")
            lines.append(f"  {role['role']} ({role['engine'] or 'unknown engine'}): {role['scrapes']} scrapes{gap_s}")
            lines.append(f"    queue        {role['metrics']['waiting'] or '-'}: {_trend(role['queue'])}")
            lines.append(f"    running      {role['metrics']['running'] or '-'}: {_trend(role['running'])}")
            fails = role["xfer_failures"]
            exp = role["kv_expired"]
            rej = role["rejected"]
            lines.append(f"    failures     transfers failed {_inc(fails)}, KV expired {_inc(exp)}, "
                         f"rejected {_inc(rej)}")
            lines += _transfer_lines(role["kv_transfer"])
            lines += [f"    note         {n}" for n in role.get("notes", [])]
        lines.append("")
    lines += [f"note: {n}" for n in r.get("notes") or []]
    return lines


def format_table(r: dict) -> str:
    if "groups" not in r:  # engine metrics only
        return "\n".join(format_engine_metrics(r)).rstrip()
    files = ", ".join(r["inputs"]["records"])
    lines = [f"kvbench slo: {r['records_total']} records from {files}"
             + (f"; plan {r['inputs']['plan']}" if r["inputs"]["plan"] else ""),
             _criteria_line(r),
             f"percentiles: {r['method']['percentiles']}", ""]
    for g in r["groups"]:
        c, cl, t, lat, a, q, w = (g["counts"], g["client"], g["throughput"], g["latency_ms"],
                                 g["attainment"], g["queue"], g["window"])
        verdict = "PASS" if g["passed"] else f"FAIL ({', '.join(g['failed_gates'])})"
        lag = cl["send_lag_ms"]
        lag_s = (f"send lag p50/p99/max {_f(lag['p50_ms'], '.2f')}/{_f(lag['p99_ms'], '.2f')}/"
                 f"{_f(lag['max_ms'], '.2f')} ms" if lag else "send lag not known (no scheduled times)")
        missed = ", ".join(f"{k} {v}" for k, v in c["missed_limit"].items())
        lines += [
            f"{g['deployment']}{_state(g)} @ {g['offered_rate_rps']:g} rps: {verdict}",
            f"  requests     {c['records']} records: {c['warmup_excluded']} warm-up excluded, "
            f"{c['offered_after_warmup']} offered after warm-up = {c['ok']} ok + {c['error']} error + "
            f"{c['rejected']} rejected + {c['timeout']} timeout",
            f"  client       send rate {_f(cl['send_rate_rps'], '.3f')} rps; {lag_s}",
            f"  window       {_f(w['window_s'], '.1f')} s ({w['source']}); {w['finished_after_window']} "
            f"finished after it",
            f"  throughput   {_f(t['throughput_rps'], '.3f')} rps ok, goodput {_f(t['goodput_rps'], '.3f')} rps, "
            f"{_f(t['output_tokens_per_s'], '.1f')} output tokens/s",
            f"  TTFT ms      {_pcts(lat['ttft'])}  (n={lat['ttft']['n']})",
            f"  TPOT ms      {_pcts(lat['tpot'])}  (n={lat['tpot']['n']})",
            f"  ITL ms       {_pcts(lat['itl_per_chunk'])}  (per chunk, n={lat['itl_per_chunk']['n']})",
            f"  max ITL ms   {_pcts(lat['max_itl_per_request'])}  (per request)"
            + (f"; chunk gaps not recorded by the client for {c['chunk_gaps_unrecorded']} requests"
               if c.get("chunk_gaps_unrecorded") else ""),
            f"  attainment   {a['numerator_count']} meet limits: {_f(a['of_successful_pct'])}% of "
            f"{a['successful_count']} successful, {_f(a['of_all_offered_pct'])}% of "
            f"{a['offered_after_warmup_count']} offered (missed: {missed or 'none'})",
            f"  error rate   {_f(g['error_rate_pct'])}%",
            f"  queue        achieved {_f(q['achieved_rps'], '.3f')} rps = {_f(q['achieved_over_offered'], '.3f')} "
            f"x the {_f(q['offered_actual_rps'], '.3f')} rps sent; TTFT median first/last third {_f(q['ttft_median_first_third_ms'])}/"
            f"{_f(q['ttft_median_last_third_ms'])} ms; in flight {_f(q['in_flight_mean_first_third'])}/"
            f"{_f(q['in_flight_mean_last_third'])} -> {_QUEUE_WORD[q['growing']]}",
        ]
        for gate in g["gates"]:
            lines.append(f"  gate {gate['name']:<16} {_gate_word(gate['passed']):<4}  {gate['detail']}")
        lines.append("")
    lines.append("capacity:")
    lines += [f"  {cap['text']}" for cap in r["capacity"]]
    for u in r.get("untested", []):
        state = f" [{u['cache_state']}]" if u.get("cache_state") else ""
        lines.append(f"  untested: {u['deployment']}{state} @ {u['offered_rate_rps']:g} rps "
                     "(in the plan, no records)")
    lines.append(f"verdict: {r['verdict']['text']}")
    engine = format_engine_metrics(r)
    return "\n".join(lines + ([""] + engine if engine else [])).rstrip()


def format_markdown(r: dict) -> str:
    engine = format_engine_metrics(r)
    engine_md = ["", "```", *engine, "```"] if engine else []
    if "groups" not in r:
        return "\n".join(engine_md).strip()
    head = ("| deployment | offered rps | offered | ok | err/rej/t-o | TTFT p95 ms | TPOT p95 ms | "
            "ITL p99 ms | max ITL p99 ms | attain. % of successful | attain. % of all | error % | "
            "goodput rps | queue | result |")
    lines = [f"**kvbench slo** — {r['records_total']} records; {_criteria_line(r)}", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for g in r["groups"]:
        c, lat, a = g["counts"], g["latency_ms"], g["attainment"]
        result = "PASS" if g["passed"] else "FAIL: " + ", ".join(g["failed_gates"])
        lines.append(
            f"| {g['deployment']}{_state(g)} | {g['offered_rate_rps']:g} | {c['offered_after_warmup']} | {c['ok']} | "
            f"{c['error']}/{c['rejected']}/{c['timeout']} | {_f(lat['ttft']['p95_ms'])} | "
            f"{_f(lat['tpot']['p95_ms'])} | {_f(lat['itl_per_chunk']['p99_ms'])} | "
            f"{_f(lat['max_itl_per_request']['p99_ms'])} | {_f(a['of_successful_pct'])} | "
            f"{_f(a['of_all_offered_pct'])} | {_f(g['error_rate_pct'])} | "
            f"{_f(g['throughput']['goodput_rps'], '.3f')} | "
            f"{_QUEUE_WORD[g['queue']['growing']]} | {result} |")
    lines += ["", "| deployment | SLO-compliant capacity rps | first failing rps | failed gates |",
              "|---|---|---|---|"]
    for cap in r["capacity"]:
        lines.append(f"| {cap['deployment']}{_state(cap)} | {_f(cap['capacity_rps'], 'g', 'none')} | "
                     f"{_f(cap['first_failing_rate_rps'], 'g', 'none')} | "
                     f"{', '.join(cap['first_failing_gates']) or '-'} |")
    lines += ["", f"**Verdict:** {r['verdict']['text']}", "",
              f"Percentiles: {r['method']['percentiles']}."]
    return "\n".join(lines + engine_md)


def render_plot(r: dict, fmt: str) -> bytes:
    """Attainment and latency percentiles against offered rate, one line per deployment."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install kvbench[plot]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    by_dep: dict[str, list[dict]] = {}
    for g in r["groups"]:
        by_dep.setdefault(g["deployment"], []).append(g)
    min_pct = r["criteria"]["slo_attainment_min"]
    for dep, gs in by_dep.items():
        gs = sorted(gs, key=lambda g: g["offered_rate_rps"])
        x = [g["offered_rate_rps"] for g in gs]
        line, = axes[0].plot(x, [g["attainment"]["of_all_offered_pct"] for g in gs], "o-",
                             label=f"{dep}: % of all offered")
        axes[0].plot(x, [g["attainment"]["of_successful_pct"] for g in gs], "s--",
                     color=line.get_color(), alpha=0.6, label=f"{dep}: % of successful")
        for q, style in ((50, ":"), (95, "--"), (99, "-")):
            axes[1].plot(x, [g["latency_ms"]["ttft"][f"p{q}_ms"] for g in gs], style, marker="o",
                         color=line.get_color(), label=f"{dep} P{q}")
        axes[2].plot(x, [g["latency_ms"]["tpot"]["p95_ms"] for g in gs], "--", marker="o",
                     color=line.get_color(), label=f"{dep} TPOT P95")
        axes[2].plot(x, [g["latency_ms"]["itl_per_chunk"]["p99_ms"] for g in gs], "-", marker="^",
                     color=line.get_color(), label=f"{dep} ITL P99 (per chunk)")
    c = r["criteria"]
    if min_pct is not None:
        axes[0].axhline(100 * min_pct, color="red", lw=1, label=f"minimum ({c['denominator']})")
    if c["ttft_max_ms"] is not None:
        axes[1].axhline(c["ttft_max_ms"], color="red", lw=1, label="TTFT limit")
    if c["tpot_max_ms"] is not None:
        axes[2].axhline(c["tpot_max_ms"], color="red", lw=1, label="TPOT limit")
    axes[1].set_yscale("log")
    titles = ("SLO attainment (%)", "TTFT P50/P95/P99 (ms, log)", "TPOT P95 and ITL P99 (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    plt.close(fig)
    return buf.getvalue()


def plot_format(path: Path) -> str:
    """The plot's format from its suffix (kvbench.results.plot_format: png, svg or pdf)."""
    from kvbench.records.write import plot_format as by_suffix

    return by_suffix(path)
