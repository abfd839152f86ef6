"""Result records: schema, the environment that produced them, atomic never-overwriting writers.

A record carries everything needed to reproduce it. Files are written to a temporary
name and linked into place, so a reader never sees half a file and an existing file is
never replaced.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import socket
import tempfile
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

from kvbench.cli import UsageError, read_text

SCHEMA_P2P = "kvbench.p2p/1"
KNOWN_SCHEMAS = {SCHEMA_P2P}
ENV_PREFIXES = ("NCCL_", "UCX_", "OMPI_", "PMIX_", "PRTE_", "SLURM_", "CUDA_VISIBLE", "NIXL_",
                "GLOO_", "TORCH_DISTRIBUTED", "MASTER_")
# Secrets have no place in a results file even if someone exported them under these prefixes.
_REDACT = ("TOKEN", "SECRET", "PASSWORD", "KEY")


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def write_new_file(path: Path, content: str | bytes) -> Path:
    """Write text or bytes to path atomically; refuse to replace an existing file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if path exists
        except FileExistsError:
            raise UsageError(f"refusing to overwrite existing file {path}") from None
    finally:
        os.unlink(tmp)
    return path


def fresh_stem(out_dir: Path, prefix: str, suffixes: Sequence[str]) -> Path:
    """out_dir/prefix-<UTC stamp>[-N] such that no file with any of suffixes exists."""
    base = Path(out_dir) / f"{prefix}-{utc_stamp()}"
    stem, n = base, 0
    while any(stem.with_name(stem.name + s).exists() for s in suffixes):
        n += 1
        stem = base.with_name(f"{base.name}-{n}")
    return stem


def _csv_cell(value):
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"))
    return value


def records_to_csv(records: Sequence[dict]) -> str:
    """Flat CSV twin of the JSONL: scalars as they are, lists and objects as compact JSON."""
    columns: list[str] = []
    for rec in records:
        for key in rec:
            if key not in columns:
                columns.append(key)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for rec in records:
        writer.writerow({k: _csv_cell(v) for k, v in rec.items()})
    return buf.getvalue()


def write_records(out_dir: Path, records: Sequence[dict], prefix: str) -> tuple[Path, Path]:
    """Write records as a new <prefix>-<stamp>.jsonl plus its .csv twin."""
    stem = fresh_stem(Path(out_dir), prefix, (".jsonl", ".csv"))
    jsonl = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    jpath = write_new_file(stem.with_name(stem.name + ".jsonl"), jsonl)
    cpath = write_new_file(stem.with_name(stem.name + ".csv"), records_to_csv(records))
    return jpath, cpath


def load_records(paths: Iterable[str | Path], schemas: Iterable[str] = KNOWN_SCHEMAS) -> list[dict]:
    """Read JSONL records, each tagged with the file it came from; bad input is a UsageError."""
    allowed = set(schemas)
    out: list[dict] = []
    for path in paths:
        p = Path(path)
        lines = read_text(p).splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise UsageError(f"{p}:{lineno}: expected a JSON object")
            schema = rec.get("schema")
            if schema not in allowed:
                raise UsageError(f"{p}:{lineno}: unknown schema {schema!r} "
                                 f"(this kvbench reads {', '.join(sorted(allowed))})")
            rec["_source"] = str(p)
            out.append(rec)
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def relevant_env() -> dict[str, str]:
    return {
        k: ("<redacted>" if any(s in k for s in _REDACT) else v)
        for k, v in sorted(os.environ.items())
        if k.startswith(ENV_PREFIXES)
    }


def environment(extra: dict | None = None) -> dict:
    """What produced a result: host, library versions, devices, relevant variables."""
    env = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "kvbench": _version("kvbench"),
        "numpy": _version("numpy"),
        "torch": None,
        "mpi4py": _version("mpi4py"),
        "mpi_library": None,
        "nccl": None,
        "gpu": None,
        "nixl": _version("nixl-cu12") or _version("nixl-cu13") or _version("nixl"),
        "ucx": None,
        "variables": relevant_env(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cuda"] = torch.version.cuda
            try:
                env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # noqa: BLE001 - NCCL may be absent from the build
                env["nccl"] = None
    except ImportError:
        pass
    try:
        from mpi4py import MPI

        env["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - recorded as unknown
        pass
    if extra:
        env.update(extra)
    return env
