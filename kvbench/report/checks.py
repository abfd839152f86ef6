"""Warnings a reader of a results folder must see before trusting a number in it."""

from __future__ import annotations

import pandas as pd

BUSY_LOAD_PER_CPU = 0.75  # a 1-minute load average above 0.75 x CPUs: other work shared the cores
ENV_COLUMNS = {"hosts": "hosts", "env_kvbench": "kvbench", "env_torch": "torch",
               "env_mpi_library": "MPI library", "env_nixl": "NIXL", "env_cpu": "CPU",
               "env_cpu_count": "CPUs", "env_gpu": "GPU"}
FIT_DOES_NOT_HOLD = ("lack_of_fit", "poor_fit", "two_regimes", "negative_intercept", "no_rate",
                     "rate_above_line_rate", "link_mismatch")


def _values(s: pd.Series) -> list[str]:
    return sorted({str(v) for v in s.dropna()})


def busy(records: pd.DataFrame) -> list[str]:
    """Runs whose recorded load average says other work shared the machine."""
    if "env_load_1m" not in records.columns or not len(records):
        return []
    load, cpus = records["env_load_1m"], records["env_cpu_count"].astype("float64")
    hot = records[load > BUSY_LOAD_PER_CPU * cpus]
    out = []
    for src, g in hot.groupby(hot["source"].astype(str), sort=True):
        out.append(f"busy machine: `{src}` started with load average "
                   f"{g['env_load_1m'].max():.2f} on {int(g['env_cpu_count'].max())} CPUs")
    return out


def load_unknown(records: pd.DataFrame) -> int:
    """Records that do not say how loaded their machine was (written before kvbench recorded it)."""
    if not len(records):
        return 0
    if "env_load_1m" not in records.columns:
        return len(records)
    return int(records["env_load_1m"].isna().sum())


def mixed(records: pd.DataFrame, folder: str) -> list[str]:
    """A folder whose records come from different software or machines (each column named)."""
    out = []
    for col, name in ENV_COLUMNS.items():
        if col in records.columns:
            vals = _values(records[col])
            if len(vals) > 1:
                out.append(f"mixed configurations in `{folder}`: {name} differs between records "
                           f"({'; '.join(vals)})")
    return out


def pooled_runs(records: pd.DataFrame, folder: str) -> list[str]:
    """Configurations whose samples come from several runs (files): pooled by the table and fit."""
    out = []
    for label, g in records.groupby("label", sort=True):
        runs = g["source"].astype(str).nunique()
        if runs > 1:
            out.append(f"`{folder}`: [{label}] pools {runs} runs (files); their samples share one "
                       "table row per size and one fit")
    return out


def wrong(records: pd.DataFrame) -> list[str]:
    if "wrong" not in records.columns:
        return []
    bad = records[records["wrong"].fillna(0) > 0]
    return [f"wrong received bytes: `{r.source}` line {r.line} ({r.wrong} elements): that run "
            "measured nothing and is left out of its fit" for r in bad.itertuples()]


def fits(fit_records: list[dict], folder: str) -> list[str]:
    """Fits that do not hold (their warning codes), and fits without an interval."""
    out = []
    for g in fit_records:
        codes = [w["code"] for w in g["warnings"]]
        bad = [c for c in codes if c in FIT_DOES_NOT_HOLD]
        if bad:
            out.append(f"fit does not hold in `{folder}`: [{g['label']}]: {', '.join(bad)}")
        if "no_interval" in codes:  # the reason's first clause: "1 back-to-back block(s) of N B"
            why = (g.get("no_interval") or "see the fit").split(":")[0]
            out.append(f"fit without an interval in `{folder}`: [{g['label']}] ({why})")
    return out
