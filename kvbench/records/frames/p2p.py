"""p2p records (JSON Lines or the CSV twin) as rows: one per record, or one per sample.

Every line goes through the typed record (kvbench.records.schema.p2p), so a bad row is one line naming
its file and line. Columns: docs/results.md.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from kvbench.errors import UsageError
from kvbench.records.frames.files import _text_lines
from kvbench.records.schema.job import Jobs
from kvbench.records.schema.p2p import (
    LEGACY_OPTIONAL_KEYS,
    P2PRecord,
    parse_p2p_line,
    parse_p2p_record,
)
from kvbench.records.schema.read import MAX_LINE_BYTES, iter_lines, loads
from kvbench.records.stats import min_samples_for
from kvbench.units import rate_gbps

DTYPES = {
    "source": "category", "line": "Int64", "run_id": "category", "spec_id": "category",
    "order": "category", "transport": "category", "pattern": "category", "variant": "category",
    "granularity": "category", "layout": "category", "dtype": "category", "device": "category",
    "model_name": "category", "hosts": "category", "transport_path": "category",
    "prompt_tokens": "Int64", "payload_bytes": "Int64", "world_size": "Int64",
    "block_size": "Int64", "iters": "Int64", "n_samples": "Int64", "wrong": "Int64",
    "peak_rss_bytes": "Int64", "peak_device_bytes": "Int64", "fit_as_link": "boolean", "not_link_reason": "category",
    "timestamp": "datetime64[ns, UTC]",
    "p50_ms": "float64", "p95_ms": "float64", "p99_ms": "float64", "mean_ms": "float64",
    "min_ms": "float64", "max_ms": "float64", "cold_ms": "float64", "notice_ms": "float64",
    "transport_open_ms": "float64", "p50_gbps": "float64", "best_gbps": "float64",
    "sample": "Int64", "round": "Int64", "time_ms": "float64", "sample_gbps": "float64",
    "env_host": "category", "env_kvbench": "category", "env_python": "category",
    "env_torch": "category", "env_numpy": "category", "env_mpi4py": "category",
    "env_mpi_library": "category", "env_nccl": "category", "env_nixl": "category",
    "env_gpu": "category", "env_cpu": "category", "env_cpu_count": "Int64",
    "env_load_1m": "float64",
}
# record keys of records without a spec that the fit groups by (kvbench.fit.data), as columns
LEGACY_OPTIONS = tuple(k for k in LEGACY_OPTIONAL_KEYS if k not in ("variant", "block_size"))
ENV_KEYS = ("host", "kvbench", "python", "torch", "numpy", "mpi4py", "mpi_library", "nccl",
            "nixl", "gpu", "cpu", "cpu_count")
# CSV cells of these fields are text even when they look like JSON (a spec_id of 12 digits)
_TEXT = {"transport", "pattern", "variant", "granularity", "layout", "dtype", "device", "run_id",
         "order", "not_link_reason", "spec_id", "timestamp", "schema"}


def records(path: Path) -> Iterator[tuple[int, P2PRecord]]:
    """(line, typed record) of a JSON Lines or CSV results file, one at a time."""
    jobs = Jobs()  # a lean matrix record made whole from its job's first record
    if path.suffix == ".csv":
        for line, rec in _csv_records(path):
            yield line, jobs.typed(rec, f"{path}:{line}")
        return
    for where, raw in iter_lines(path, "results file", missing="no such file"):
        yield int(where.rsplit(":", 1)[1]), jobs.typed(parse_p2p_line(raw, where), where)


def _csv_records(path: Path) -> Iterator[tuple[int, P2PRecord]]:
    """The CSV twin: scalars as text, lists and objects as compact JSON (results.records_to_csv)."""
    if csv.field_size_limit() < MAX_LINE_BYTES:
        csv.field_size_limit(MAX_LINE_BYTES)
    reader = csv.DictReader(_text_lines(path))
    try:
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row or None in row.values():
                raise UsageError(f"{where}: {len(reader.fieldnames or ())} columns in the header, "
                                 "a different number in this row")
            rec = {k: _cell(k, v, where) for k, v in row.items() if v != ""}
            yield reader.line_num, parse_p2p_record(rec, where)
    except csv.Error as exc:
        raise UsageError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None


_CSV_BOOLS = {"True": True, "False": False}  # how the csv module writes Python's booleans


def _cell(key: str, text: str, where: str):
    if key in _TEXT:
        return text
    if text in _CSV_BOOLS:
        return _CSV_BOOLS[text]
    if text[0] in '[{"-0123456789' or text in ("true", "false", "null"):
        return loads(text, f"{where}: column {key}")
    return text


def _flat(prefix: str, value, out: dict) -> None:
    """spec.world.size -> spec_world_size; lists as comma-joined text (hashable, groupable)."""
    if isinstance(value, dict):
        if not value:
            out[prefix] = None
        for k, v in value.items():
            _flat(f"{prefix}_{k}", v, out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = ",".join(map(str, value))
    else:
        out[prefix] = value


def _supported(value, q: float, n: int):
    """A percentile the sample count supports, else None (kvbench.records.stats.min_samples_for)."""
    return value if value is not None and n >= min_samples_for(q) else None


def _env(extra: dict, out: dict) -> None:
    env = extra.get("env")
    ranks = env.get("ranks") if isinstance(env, dict) else None
    first = ranks[0] if isinstance(ranks, list) and ranks and isinstance(ranks[0], dict) else env
    if not isinstance(first, dict):
        return
    for k in ENV_KEYS:
        v = first.get(k)
        if k == "mpi_library" and isinstance(v, str):
            v = v.split(",")[0].strip("\x00 ")  # "Open MPI v5.0.11, package: ..." -> first part
        out[f"env_{k}"] = v if isinstance(v, (str, int, float)) and not isinstance(v, bool) else None
    load = first.get("load_average")
    if isinstance(load, list) and load and isinstance(load[0], (int, float)):
        out["env_load_1m"] = float(load[0])


def record_row(rec: P2PRecord, source: str, line: int) -> dict:
    """One row: what was measured (spec_* columns), its summary, and where it came from."""
    extra = rec.model_extra or {}
    n = len(rec.samples_ms)
    model = rec.model or {}
    info = extra.get("transport_info")
    rss = extra.get("peak_rss_bytes")
    gpu = extra.get("peak_device_bytes")
    gpu = [x for x in gpu if isinstance(x, int)] if isinstance(gpu, list) else []
    row = {
        "source": source, "line": line, "run_id": rec.run_id, "spec_id": rec.spec_id,
        "order": rec.order, "transport": rec.transport, "pattern": rec.pattern,
        "variant": rec.variant, "granularity": rec.granularity, "layout": rec.layout,
        "dtype": rec.dtype, "device": rec.device, "model_name": model.get("name"),
        "prompt_tokens": rec.prompt_tokens, "payload_bytes": rec.bytes,
        "world_size": rec.world_size, "hosts": ",".join(rec.hosts), "block_size": rec.block_size,
        "iters": rec.iters, "n_samples": n, "wrong": rec.wrong, "fit_as_link": rec.fit_as_link,
        "not_link_reason": rec.not_link_reason,
        "p50_ms": rec.p50_ms, "p95_ms": _supported(rec.p95_ms, 0.95, n),
        "p99_ms": _supported(rec.p99_ms, 0.99, n), "mean_ms": _num(extra.get("mean_ms")),
        "min_ms": _num(extra.get("min_ms")), "max_ms": _num(extra.get("max_ms")),
        "cold_ms": rec.cold_ms, "notice_ms": _num(extra.get("notice_ms")),
        "transport_open_ms": _num(extra.get("transport_open_ms")),
        "p50_gbps": rate_gbps(rec.bytes, rec.p50_ms),
        "best_gbps": _num(extra.get("gbps_best")),
        "transport_path": info.get("path") if isinstance(info, dict) else None,
        "peak_rss_bytes": max(rss) if isinstance(rss, list) and rss and all(
            isinstance(x, int) for x in rss) else None,
        "peak_device_bytes": max(gpu) if gpu else None,  # on CUDA: torch's peak per rank
        "timestamp": extra.get("timestamp") if isinstance(extra.get("timestamp"), str) else None,
    }
    _env(extra, row)
    if rec.spec is not None:
        _flat("spec", rec.spec.model_dump(exclude_unset=True), row)
    for k in LEGACY_OPTIONS:  # what records without a spec say about how they were measured
        if k in extra:
            row[k] = extra[k]
    return row


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


SAMPLE_DROP = ("p50_ms", "p95_ms", "p99_ms", "mean_ms", "min_ms", "max_ms", "p50_gbps",
               "best_gbps")


def sample_rows(rec: P2PRecord, source: str, line: int) -> list[dict]:
    """One row per sample: the record's columns (less its summaries), sample, round, time_ms."""
    base = {k: v for k, v in record_row(rec, source, line).items() if k not in SAMPLE_DROP}
    rounds = rec.sample_rounds
    out = []
    for i, ms in enumerate(rec.samples_ms):
        out.append({**base, "sample": i, "round": rounds[i] if rounds is not None else None,
                    "time_ms": ms, "sample_gbps": rate_gbps(rec.bytes, ms)})
    return out
