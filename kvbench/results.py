"""The public face users import: `kvbench.results.load(...)` and the record writer's names.

A thin facade over kvbench.records (the writer in records/write.py, the pandas readers in
records/frames/). It sits at the top of the layering, so no module of kvbench imports it;
kvbench's own code imports kvbench.records directly.
"""

from __future__ import annotations

from kvbench.records.schema.p2p import SCHEMA_P2P  # noqa: F401  (re-exported for users)
from kvbench.records.write import (  # noqa: F401  (re-exported for users)
    check_destination,
    check_new_file,
    dumps_json,
    environment,
    records_to_csv,
    utc_stamp,
    write_files,
    write_new_file,
    write_records,
)


def load(paths_or_globs, kind: str = "p2p", **kw):
    """Results as a pandas DataFrame: p2p records, fits, SLO requests and reports, scrapes.

    kind: p2p | fit | fit-sizes | slo-requests | slo-report | metrics; samples=True for one
    row per sample (p2p), draw (fit) or chunk (slo-requests). Columns: docs/results.md.
    Implemented in kvbench.records.frames (pandas is imported only when this is called).
    """
    from kvbench.records.frames import load as _load

    return _load(paths_or_globs, kind, **kw)
