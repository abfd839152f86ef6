"""What `kvbench report` reads from a results folder, through kvbench.results.load: one record row
per p2p record, each (folder, configuration, size)'s pooled samples, the fit files and SLO
reports found, and a refit of each folder's records with kvbench fit.

A configuration is what the fit groups by: the record's spec (spec_id), or for records written
before specs the legacy keys (kvbench.fit.data). A folder is the directory a file lies in: one
experiment, refitted on its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.fit.data import label_of
from kvbench.records.frames import iter_frames, load
from kvbench.records.frames.files import expand, not_read
from kvbench.records.schema.p2p import LEGACY_GROUP_KEYS, LEGACY_OPTIONAL_KEYS
from kvbench.records.schema.read import path_kind
from kvbench.records.stats import percentile_if_supported


@dataclass
class Folder:
    """One directory's results."""

    path: Path
    records: pd.DataFrame  # p2p record rows (with `config` and `label`)
    sizes: pd.DataFrame  # (config, payload_bytes): pooled sample statistics
    fit_files: pd.DataFrame
    slo_reports: pd.DataFrame
    fits: list = field(default_factory=list)  # kvbench.fit.GroupFit of the refit
    skipped: list = field(default_factory=list)  # groups the refit skipped (not a link)
    notes: list[Path] = field(default_factory=list)  # README files beside the results


SPEC_LABEL_KEYS = ("transport", "pattern", "variant", "granularity", "layout", "dtype", "device",
                   "world_size", "hosts")


def _plain(v):
    """A cell as the record held it: None for a missing value, Python scalars for numpy's."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return None
    return v.item() if isinstance(v, np.generic) else v


def _configs(records: pd.DataFrame) -> pd.DataFrame:
    """`config` and `label` per record, as kvbench fit groups and labels them: the spec_id (label:
    the usual fields and the id), or for records without a spec the fit's legacy label."""
    records = records.copy()
    legacy_keys = [k for k in (*LEGACY_GROUP_KEYS, *LEGACY_OPTIONAL_KEYS) if k in records.columns]
    spec_keys = [k for k in SPEC_LABEL_KEYS if k in records.columns]
    labels: dict[tuple, tuple[str, str]] = {}
    config, label = [], []
    for row in zip(records["spec_id"].astype(object), *(records[k] for k in legacy_keys),
                   strict=True):
        got = labels.get(row)
        if got is None:
            sid, vals = row[0], dict(zip(legacy_keys, map(_plain, row[1:]), strict=True))
            if _plain(sid) is None:
                got = (label_of(vals),) * 2
            else:
                got = (sid, label_of({k: vals.get(k) for k in spec_keys}) + f" spec={sid}")
            labels[row] = got
        config.append(got[0])
        label.append(got[1])
    records["config"], records["label"] = config, label
    return records


def _pooled(files: list[Path], records: pd.DataFrame, say) -> pd.DataFrame:
    """Per (folder, config, payload_bytes): n, p50/p95/p99 of every pooled sample, and more."""
    key_of = {(s, int(n)): (str(Path(s).parent), c) for s, n, c in
              zip(records["source"].astype(str), records["line"], records["config"], strict=True)}
    pools: dict[tuple, list[np.ndarray]] = defaultdict(list)
    for chunk in iter_frames(files, "p2p", samples=True, progress=say):
        keys = [key_of[(s, int(n))] for s, n in zip(chunk["source"].astype(str), chunk["line"],
                                                   strict=True)]
        part = pd.DataFrame({"k": keys, "b": chunk["payload_bytes"].astype("int64"),
                             "ms": chunk["time_ms"].to_numpy(float)})
        for (k, b), g in part.groupby(["k", "b"], sort=False):
            pools[(*k, b)].append(g["ms"].to_numpy())
    rows = []
    for (folder, config, nbytes), parts in pools.items():
        ms = np.concatenate(parts)
        rows.append({"folder": folder, "config": config, "payload_bytes": nbytes, "n": len(ms),
                     "p50_ms": float(np.percentile(ms, 50)),
                     "p95_ms": percentile_if_supported(ms, 95),
                     "p99_ms": percentile_if_supported(ms, 99)})
    # (records without samples pool nothing: the table still has its columns)
    return pd.DataFrame(rows, columns=["folder", "config", "payload_bytes", "n", "p50_ms", "p95_ms",
                                       "p99_ms"])


KINDS_READ = ("p2p", "fit", "slo-report")


def read(root: Path, say: Callable[[str], None] | None = None,
         skip: Path | None = None) -> tuple[list[Folder], list[tuple[Path, str]]]:
    """Every folder under root that holds p2p records, fit files or SLO reports; and every
    other results-looking file, with why it was not read (a newer schema, another kind)."""
    found = {k: [f for f in expand(root, k, quiet_skips=True) if skip is None or skip not in f.parents]
             for k in KINDS_READ}
    skipped = not_read(root, [f for fs in found.values() for f in fs], KINDS_READ, skip)

    def kind(k: str) -> pd.DataFrame:
        return load(found[k], k, progress=say) if found[k] else pd.DataFrame(columns=["source"])

    records = kind("p2p")
    if len(records):
        records = _configs(records)
        if say:
            say(f"pooling the samples of {len(records):,} p2p records")
        sizes = _pooled(found["p2p"], records, say)
    else:
        sizes = pd.DataFrame(columns=["folder"])
    fits, reports = kind("fit"), kind("slo-report")
    dirs = sorted({str(Path(s).parent) for df in (records, fits, reports)
                   for s in df["source"].astype(str)})
    return [Folder(Path(d), _in(records, d), sizes[sizes["folder"] == d], _in(fits, d),
                   _in(reports, d), notes=[p for p in (Path(d) / "README.md",) if path_kind(p) == "file"])
            for d in dirs], skipped


def _in(df: pd.DataFrame, folder: str) -> pd.DataFrame:
    if not len(df):
        return df
    return df[[str(Path(s).parent) == folder for s in df["source"].astype(str)]]
