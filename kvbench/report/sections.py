"""The parts of a `kvbench report`: per folder its environment, a table per configuration and
size, its fits (refitted from the records) with plots, the fit files and SLO reports found."""

from __future__ import annotations

import math
import re

import pandas as pd

from kvbench.records.stats import min_samples_for
from kvbench.report.doc import Doc, Image
from kvbench.units import MIN_TIME_MS, fmt_bytes

GROUPS_PER_PLOT = 4


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def _num(v, spec: str = ".4g", none: str = "-") -> str:
    """4 significant digits, but whole numbers with separators from 10,000 on (no 1.2e+04)."""
    if _missing(v):
        return none
    v = float(v)
    return f"{v:,.0f}" if spec == ".4g" and abs(v) >= 1e4 else format(v, spec)


def _cell(v) -> str:
    return "-" if _missing(v) else str(v)


def _pct(v, q: float) -> str:
    return _num(v, ".4g", f"n/a (n<{min_samples_for(q)})")


def _ci(v, lo, hi, spec: str = ".4g") -> str:
    if v is None or pd.isna(v):
        return "-"
    if lo is None or pd.isna(lo):
        return _num(v, spec)
    top = "unbounded" if hi is None or pd.isna(hi) else _num(hi, spec)
    return f"{_num(v, spec)} [{_num(lo, spec)}, {top}]"


def _bytes(n) -> str:
    return f"{fmt_bytes(int(n))} ({int(n):,} B)"


def environment(doc: Doc, records: pd.DataFrame) -> None:
    cols = {"env_host": "host (rank 0)", "hosts": "hosts", "env_kvbench": "kvbench",
            "env_python": "Python", "env_torch": "torch", "env_mpi_library": "MPI library",
            "env_nixl": "NIXL", "env_cpu": "CPU", "env_cpu_count": "CPUs", "env_gpu": "GPU",
            "transport": "transport", "transport_path": "transport_info.path",
            "env_load_1m": "load 1 min"}
    have = [c for c in cols if c in records.columns]
    if not have:
        return
    env = records[have].astype(object).map(lambda v: None if _missing(v) else v)
    combos = env.assign(n=1).groupby(have, dropna=False, sort=False)["n"].count().reset_index()
    stamps = records["timestamp"].dropna() if "timestamp" in records.columns else []
    when = (f" Records written {stamps.min():%Y-%m-%d %H:%M} .. {stamps.max():%Y-%m-%d %H:%M} "
            "UTC." if len(stamps) else "")
    doc.h(2, "Environment")
    doc.p(f"What the records say about the machine and software that produced them.{when}")
    doc.table([cols[c] for c in have] + ["records"],
              [[_num(r[c], ".3g") if c == "env_load_1m" else _cell(r[c]) for c in have]
               + [str(r["n"])] for _, r in combos.iterrows()])


def measurements(doc: Doc, records: pd.DataFrame, sizes: pd.DataFrame) -> None:
    """A table per configuration: one row per payload size, samples of every run pooled."""
    doc.h(2, "Measurements")
    doc.p("Per configuration and payload size: every sample of every run in this folder pooled. "
          f"p95 needs n >= {min_samples_for(0.95)} samples and p99 n >= {min_samples_for(0.99)}; "
          "fewer show n/a. GB/s = bytes / p50 (decimal; end to end, so it includes the setup). "
          "cold = the first handoff of a point, before warm-up (median over runs).")
    for (config, label), recs in records.groupby(["config", "label"], sort=False):
        rows = []
        mine = sizes[sizes["config"] == config].sort_values("payload_bytes")
        for s in mine.itertuples():
            at = recs[recs["payload_bytes"] == s.payload_bytes]
            tokens = sorted({int(t) for t in at["prompt_tokens"].dropna()})
            gbps = s.payload_bytes / 1e9 / (s.p50_ms / 1e3) if s.p50_ms >= MIN_TIME_MS else None
            rows.append([_bytes(s.payload_bytes), ",".join(map(str, tokens)) or "-",
                         str(len(at)), str(s.n), _num(s.p50_ms), _pct(s.p95_ms, 0.95),
                         _pct(s.p99_ms, 0.99), _num(gbps), _num(at["cold_ms"].median())])
        doc.h(3, label)
        doc.table(["payload", "prompt tokens", "records", "n", "p50 ms", "p95 ms", "p99 ms",
                   "GB/s (p50)", "cold ms"], rows)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "root"


def fits(doc: Doc, folder: str, fitted: list, skipped: list[dict], n_boot: int) -> None:
    """The refit of this folder's records: a table and the plots (kvbench.report)."""
    from kvbench.fit import plots as report

    doc.h(2, "Fits (refitted from this folder's records)")
    doc.p(f"`kvbench fit` over every p2p record of this folder ({n_boot} resamples, seed 0): "
          "time_ms = setup_ms + bytes / (GB/s x 1e9) x 1000 through the per-size medians, "
          "95% intervals from resampling rounds (or back-to-back blocks).")
    rows = []
    for gf in fitted:
        g = gf.record
        lof = g.get("lack_of_fit")
        rows.append([g["label"], str(g["n_sizes"]), str(g["n_samples"]),
                     _ci(g["setup_ms"], *(g["setup_ms_ci95"] or (None, None))),
                     _ci(g["effective_gb_s"], *(g["effective_gb_s_ci95"] or (None, None))),
                     _num(lof["p_value"], ".2g") if lof else "-",
                     ", ".join(w["code"] for w in g["warnings"]) or "-"])
    doc.table(["group", "sizes", "samples", "setup ms [95% CI]", "GB/s [95% CI]",
               "lack of fit p", "warnings"], rows)
    doc.ul([f"not fitted: [{s['label']}]: {s['reason']}" for s in skipped])
    for i in range(0, len(fitted), GROUPS_PER_PLOT):
        part = fitted[i:i + GROUPS_PER_PLOT]
        doc.image(Image(f"{_slug(folder)}-fit-{i // GROUPS_PER_PLOT + 1}.png",
                        f"fits of {folder}", report.plot_fits(part)))


def fit_files(doc: Doc, files: pd.DataFrame) -> None:
    if not len(files):
        return
    doc.h(2, "Fit files in this folder (as written)")
    doc.table(["file", "schema", "group", "setup ms [95% CI]", "GB/s [95% CI]", "warnings"],
              [[f"`{r.source}`", r.fit_schema, r.label,
                _ci(r.setup_ms, r.setup_ms_ci95_lo, r.setup_ms_ci95_hi),
                _ci(r.effective_gb_s, r.effective_gb_s_ci95_lo, r.effective_gb_s_ci95_hi),
                _cell(r.warning_codes)]
               for r in files.itertuples()])


def slo_reports(doc: Doc, reports: pd.DataFrame) -> None:
    if not len(reports):
        return
    doc.h(2, "SLO reports (`kvbench slo analyze`)")
    for src, g in reports.groupby(reports["source"].astype(str), sort=True):
        doc.h(3, f"`{src}`")
        doc.table(["deployment", "cache", "offered rps", "attainment % (all offered)",
                   "TTFT p95 ms", "TPOT p95 ms", "error %", "passed", "failed gates"],
                  [[str(r.deployment), _cell(r.cache_state),
                    _num(r.offered_rate_rps, "g"), _num(r.attainment_of_all_pct, ".1f"),
                    _num(r.ttft_p95_ms), _num(r.tpot_p95_ms), _num(r.error_rate_pct, ".1f"),
                    "-" if pd.isna(r.passed) else ("yes" if r.passed else "no"),
                    _cell(r.failed_gates)]
                   for r in g.itertuples()])
