"""Which files to read, what each one holds, and how chunks of rows become one DataFrame.

A path may be a file, a folder (every file in it, recursively, that holds the kind asked
for) or a glob (`results/**/*.jsonl`). A file's kind is read from its first record's
`schema` (a CSV's from its first row), never guessed from its name.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import pandas as pd

from kvbench.errors import UsageError
from kvbench.records.schema.fit import SCHEMAS as FIT_SCHEMAS
from kvbench.records.schema.p2p import SCHEMA_P2P
from kvbench.records.schema.read import MiB, iter_lines, loads, path_error, path_kind
from kvbench.records.schema.slo import SCHEMA_METRICS, SCHEMA_REPORT, SCHEMA_REQUEST

KINDS = {  # kind -> schemas a file of that kind starts with
    "p2p": (SCHEMA_P2P,),
    "fit": FIT_SCHEMAS,
    "fit-sizes": FIT_SCHEMAS,
    "slo-requests": (SCHEMA_REQUEST,),
    "slo-report": (SCHEMA_REPORT,),
    "metrics": (SCHEMA_METRICS,),
}
SUFFIXES = (".jsonl", ".json", ".csv")
_SCHEMA_AT_START = re.compile(rb'"schema"\s*:\s*"([^"]{1,64})"')


def schema_of(path: Path) -> str | None:
    """The schema a results file declares first (None: not a kvbench results file)."""
    if path.suffix == ".csv":
        return _csv_schema(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(64 * 1024)
    except OSError as exc:
        raise path_error(path, exc) from None
    m = _SCHEMA_AT_START.search(head)  # every kvbench writer puts "schema" first in a record
    return m.group(1).decode("utf-8", "replace") if m else None


def _csv_schema(path: Path) -> str | None:
    import csv

    rows = csv.reader(_text_lines(path, limit=2))
    header, first = next(rows, None), next(rows, None)
    if not header or not first or "schema" not in header or len(first) != len(header):
        return None
    return first[header.index("schema")]


def _text_lines(path: Path, limit: int | None = None) -> Iterator[str]:
    for i, (where, raw) in enumerate(iter_lines(path, "CSV file", missing="no such file")):
        if limit is not None and i >= limit:
            return
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"cannot read {where}: not UTF-8 text (byte {exc.start})") from None


def kind_of(path: Path) -> str | None:
    """The first kind whose schema this file declares (p2p, fit, slo-requests, ...)."""
    schema = schema_of(path)
    return next((k for k, schemas in KINDS.items() if schema in schemas), None)


def expand(paths_or_globs: str | Path | Iterable[str | Path], kind: str,
           quiet_skips: bool = False) -> list[Path]:
    """Files of `kind`: named files must hold it; folders and globs keep the files that do. A
    file of the kind's family in a schema version this kvbench does not read (kvbench.p2p/2)
    is skipped with a warning (`quiet_skips`: the caller says it itself), never silently."""
    if isinstance(paths_or_globs, (str, Path)):
        paths_or_globs = [paths_or_globs]
    out: list[Path] = []
    for item in paths_or_globs:
        p = Path(item)
        what = path_kind(p)
        if what == "dir":
            found = [f for f in walk_files(p) if f.suffix in SUFFIXES]
            out += _without_twins([f for f in found if _keep(f, kind, quiet_skips)])
        elif what != "missing":
            schema = schema_of(p)
            if schema not in KINDS[kind]:
                raise UsageError(f"{p}: holds {schema or 'no kvbench schema'}, not {kind} "
                                 f"({' or '.join(KINDS[kind])})")
            out.append(p)
        elif glob.has_magic(str(item)):
            out += _without_twins([Path(f) for f in sorted(_glob(str(item)))
                                   if path_kind(f) == "file" and _keep(Path(f), kind, quiet_skips)])
        else:
            raise UsageError(f"no such file: {p}")
    seen: set[str] = set()  # one file named twice (a folder and a glob, f and ./f) is read once
    return [f for f in out if not (os.path.realpath(f) in seen or seen.add(os.path.realpath(f)))]


def _keep(f: Path, kind: str, quiet: bool) -> bool:
    """Whether a file found in a folder or glob holds `kind`; warns about another version."""
    schema = schema_of(f)
    if schema in KINDS[kind]:
        return True
    family = {s.rsplit("/", 1)[0] for s in KINDS[kind]}
    if not quiet and schema is not None and schema.rsplit("/", 1)[0] in family:
        warnings.warn(f"kvbench.results: skipped {f}: {why_not(f, [kind])}", stacklevel=4)
    return False


def why_not(path: Path, kinds: Iterable[str]) -> str:
    """Why a results-looking file (.jsonl, .json, .csv) is not one of `kinds`, in a few words:
    another kind of kvbench file, a schema version this kvbench does not read (a newer one,
    usually), or no kvbench schema at all."""
    schema = schema_of(path)
    wanted = sorted({s for k in kinds for s in KINDS[k]})
    if schema is None:
        return "no kvbench schema (not a kvbench results file)"
    family = schema.rsplit("/", 1)[0]
    same = sorted({s for s in (x for v in KINDS.values() for x in v) if s.rsplit("/", 1)[0] == family})
    if same and schema not in same:
        return f"schema {schema}: this kvbench reads {' and '.join(same)} (a newer kvbench wrote it?)"
    if not schema.startswith("kvbench."):
        return f"schema {schema!r} is not kvbench's"
    return f"holds {schema}, not {' or '.join(wanted)}"


def not_read(root: Path, read: Iterable[Path], kinds: Iterable[str],
             skip: Path | None = None) -> list[tuple[Path, str]]:
    """(file, why) for every results-looking file under root that is not in `read` (a CSV
    twin of a file read is the same records; files under `skip` are left out)."""
    done = {os.path.realpath(f) for f in read}
    out = _not_files(root, skip)
    for f in walk_files(root):
        if f.suffix not in SUFFIXES or (skip is not None and skip in f.resolve().parents):
            continue
        if os.path.realpath(f) in done or (f.suffix == ".csv" and os.path.realpath(f.with_suffix(".jsonl")) in done):
            continue
        out.append((f, why_not(f, kinds)))
    return sorted(out, key=lambda fw: str(fw[0]))


def _glob(pattern: str) -> list[str]:
    """glob.glob with `**`; Python's recurses once per folder level, so a tree deeper than the
    interpreter's recursion limit is one line naming the way round, not a traceback."""
    try:
        return glob.glob(pattern, recursive=True)
    except RecursionError:
        raise UsageError(f"{pattern}: the folders nest too deep for a glob; name the folder "
                         "instead (folders are walked without recursion)") from None


def walk(root: Path, onerror=None):
    """os.walk's (folder, subfolders, file names), top-down, links to folders not followed,
    but with a stack instead of recursion: Python 3.11's os.walk recurses once per level, and
    1,100 nested folders were a RecursionError (a page of traceback) in `kvbench report`."""
    stack = [os.fspath(root)]
    while stack:
        top = stack.pop()
        dirs, files = [], []
        try:
            with os.scandir(top) as it:
                for entry in it:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    (dirs if is_dir else files).append(entry.name)
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            continue
        yield top, dirs, files
        stack.extend(os.path.join(top, d) for d in reversed(dirs))


def _not_files(root: Path, skip: Path | None) -> list[tuple[Path, str]]:
    """Results-looking names under root that are no regular file (a broken link, a FIFO)."""
    out = []
    for d, _, names in walk(root):
        for n in names:
            f = Path(d) / n
            if f.suffix in SUFFIXES and not (skip is not None and skip in f.parents):
                kind = path_kind(f)
                if kind == "missing":
                    out.append((f, "a broken link (its target does not exist)"))
                elif kind == "other":
                    out.append((f, "not a regular file (a FIFO, socket or device)"))
    return out


def walk_files(root: Path) -> list[Path]:
    """Every regular file under root, sorted. A folder that cannot be listed is an error, as an
    unreadable file is: skipping it silently would drop its results from a report unseen."""
    def refuse(exc: OSError):
        raise path_error(exc.filename or root, exc)

    found = []
    for d, _, names in walk(root, onerror=refuse):
        found += [Path(d) / n for n in names if path_kind(Path(d) / n) == "file"]
    return sorted(found)


def _without_twins(found: list[Path]) -> list[Path]:
    """A folder or glob's CSV twins (x.csv beside x.jsonl) are the same records: read them once."""
    have = set(found)
    return [f for f in found if not (f.suffix == ".csv" and f.with_suffix(".jsonl") in have)]


def json_document(path: Path, limit: int, what: str):
    from kvbench.records.schema.read import read_text_bounded

    return loads(read_text_bounded(path, limit, what, missing="no such file"), str(path))


MAX_JSON_DOC = 256 * MiB


# ---------------------------------------------------------------------------
# rows -> DataFrame chunks -> one DataFrame


def frame(rows: list[dict], dtypes: dict[str, str]) -> pd.DataFrame:
    """A chunk of rows with the kind's dtypes (and the dtype of spec_* columns by their values)."""
    df = pd.DataFrame.from_records(rows) if rows else pd.DataFrame(columns=list(dtypes))
    for col in df.columns:
        if col not in dtypes:  # (from_records turns [2, None] into floats: keep the values)
            df[col] = pd.Series([r.get(col) for r in rows], index=df.index, dtype=object)
    return apply_dtypes(df, dtypes)


def apply_dtypes(df: pd.DataFrame, dtypes: dict[str, str]) -> pd.DataFrame:
    for col in df.columns:
        want = dtypes.get(col) or _by_values(df[col])
        if want and str(df[col].dtype) != want:
            df[col] = df[col].astype(want)
    return df


def _by_values(s: pd.Series) -> str | None:
    """category for text, Int64 for integers, boolean for flags, float64 for numbers."""
    if s.dtype.name != "object":
        return None
    if not s.notna().any():
        return "category"  # a column no row of this chunk has a value for (None and NaN alike)
    return _INFERRED.get(pd.api.types.infer_dtype(s, skipna=True))


_INFERRED = {"string": "category", "boolean": "boolean", "integer": "Int64",
             "floating": "float64", "mixed-integer-float": "float64"}


def concat(chunks: list[pd.DataFrame], dtypes: dict[str, str]) -> pd.DataFrame:
    """Chunks as one frame: every column gets the dtype the chunks that hold values gave it
    (categoricals: the union of their categories), as if the rows had been one chunk."""
    if not chunks:
        return frame([], dtypes)
    columns = list(dict.fromkeys(c for df in chunks for c in df.columns))  # first seen first
    final = {col: _common_dtype([df[col] for df in chunks if col in df.columns
                                 and df[col].notna().any()]) for col in columns}
    for i, df in enumerate(chunks):
        parts = {}
        for col in columns:
            if col in df.columns and df[col].notna().any():
                parts[col] = df[col].astype(final[col])
            else:
                parts[col] = pd.Series(None, index=df.index, dtype=object).astype(final[col])
        chunks[i] = pd.DataFrame(parts, index=df.index)
    return apply_dtypes(pd.concat(chunks, ignore_index=True, sort=False), dtypes)


def _common_dtype(parts: list[pd.Series]):
    if not parts:
        return "category"  # no chunk has a value: as frame() types such a column
    if all(isinstance(p.dtype, pd.CategoricalDtype) for p in parts):
        values = set().union(*(p.cat.categories for p in parts))
        return pd.CategoricalDtype(sorted(values, key=str))  # as astype("category") sorts
    kinds = {str(p.dtype) for p in parts}
    return kinds.pop() if len(kinds) == 1 else object
