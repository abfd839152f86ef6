"""Every kvbench result as a pandas DataFrame: `kvbench.results.load(paths, kind=...)`.

    kind            one row per ...                        samples=True: one row per ...
    p2p             p2p record (JSON Lines or CSV twin)    timed sample (with its round)
    fit             fitted group of a fit file             joint bootstrap draw
    fit-sizes       (fitted group, payload size)           -
    slo-requests    request record                         streamed chunk (with its ITL)
    slo-report      (deployment, rate, cache state)        -
    metrics         metric sample of a scrape line         -

Files are read one line (or one document) at a time, each record checked by its typed
model in kvbench.records.schema: a bad row stops the load with one line naming its file and line.
Rows are gathered in chunks of `chunksize` and turned into columns with compact dtypes
(categoricals for repeated text, nullable integers), so memory follows the DataFrame, not
the files' text. `iter_frames` yields the chunks for inputs too big for one DataFrame.
Column names carry their unit (`_ms`, `_bytes`, `_gbps`, `_rps`, `_pct`); docs/results.md
lists them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pandas as pd

from kvbench.errors import UsageError
from kvbench.records.frames import files

KINDS = tuple(files.KINDS)
CHUNK_ROWS = 100_000


def _dtypes(kind: str) -> dict[str, str]:
    from kvbench.records.frames import fit, p2p, slo

    return {"p2p": p2p.DTYPES, "fit": fit.DTYPES, "fit-sizes": fit.DTYPES,
            "slo-requests": slo.REQUEST_DTYPES, "slo-report": slo.REPORT_DTYPES,
            "metrics": slo.METRIC_DTYPES}[kind]


def _row_lists(path: Path, kind: str, samples: bool) -> Iterator[list[dict]]:
    """Rows of one file, in small lists (a record's rows, or one document group's)."""
    from kvbench.records.frames import fit, p2p, slo

    if kind == "p2p":
        make = p2p.sample_rows if samples else (lambda r, s, n: [p2p.record_row(r, s, n)])
        for line, rec in p2p.records(path):
            yield make(rec, str(path), line)
    elif kind in ("fit", "fit-sizes"):
        yield from fit.rows(path, "sizes" if kind == "fit-sizes" else
                            "draws" if samples else "groups")
    elif kind == "slo-requests":
        yield from slo.request_rows(path, samples)
    elif kind == "slo-report":
        yield from slo.report_rows(path)
    else:
        yield from slo.metric_rows(path)


def _check(kind: str, samples: bool) -> None:
    if kind not in files.KINDS:
        raise UsageError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    if samples and kind in ("fit-sizes", "slo-report", "metrics"):
        raise UsageError(f"kind {kind!r} has no samples (samples=True is for p2p, fit, "
                         "slo-requests)")


def _progress(progress) -> Callable[[str], None] | None:
    if progress is True:
        return lambda msg: print(f"kvbench results: {msg}", file=sys.stderr, flush=True)
    return progress or None


def iter_frames(paths_or_globs: str | Path | Iterable[str | Path], kind: str = "p2p", *,
                samples: bool = False, chunksize: int = CHUNK_ROWS,
                progress: bool | Callable[[str], None] | None = None) -> Iterator[pd.DataFrame]:
    """DataFrames of at most about `chunksize` rows each, in file order (see the module doc)."""
    _check(kind, samples)
    say = _progress(progress)
    paths = files.expand(paths_or_globs, kind)
    dtypes = _dtypes(kind)
    rows: list[dict] = []
    last = time.monotonic()
    for i, path in enumerate(paths, 1):
        for part in _row_lists(path, kind, samples):
            rows += part
            if len(rows) >= chunksize:
                yield files.frame(rows, dtypes)
                rows = []
                if say and time.monotonic() - last > 5:
                    last = time.monotonic()
                    say(f"{i}/{len(paths)} files, reading {path}")
        if say:
            say(f"{i}/{len(paths)} files read ({path})")
    if rows:
        yield files.frame(rows, dtypes)


def load(paths_or_globs: str | Path | Iterable[str | Path], kind: str = "p2p", *,
         samples: bool = False, chunksize: int = CHUNK_ROWS,
         progress: bool | Callable[[str], None] | None = None) -> pd.DataFrame:
    """One DataFrame of every row of the kind in paths_or_globs (files, folders or globs).

    >>> df = load("results/", kind="p2p")
    >>> df.groupby(["transport", "payload_bytes"], observed=True)["p50_ms"].median()
    """
    chunks = list(iter_frames(paths_or_globs, kind, samples=samples, chunksize=chunksize,
                              progress=progress))
    return files.concat(chunks, _dtypes(kind))


def kind_of(path: str | Path) -> str | None:
    """The kind a results file holds (from its schema), or None."""
    return files.kind_of(Path(path))
