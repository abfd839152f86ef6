"""Result records: schema, the environment that produced them, atomic never-overwriting writers.

A record carries everything needed to reproduce it. Files are written to a temporary
name and linked into place, so a reader never sees half a file and an existing file is
never replaced.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import platform
import secrets
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kvbench.errors import LIVE_TEMPS, UsageError
from kvbench.records.schema.read import path_error, path_kind
from kvbench.records.schema.types import M, parse

ENV_PREFIXES = ("NCCL_", "UCX_", "OMPI_", "PMIX_", "PRTE_", "SLURM_", "CUDA_VISIBLE", "NIXL_",
                "GLOO_", "TORCH_DISTRIBUTED", "MASTER_",
                # whether CUDA memory can be exported over CUDA IPC (expandable segments: not)
                "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Secrets have no place in a results file even if someone exported them under these prefixes.
_REDACT = ("TOKEN", "SECRET", "PASSWORD", "KEY")
def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def dumps_json(obj, indent: int | None = 2) -> str:
    """The one JSON encoder of every file kvbench writes: NaN and infinities are refused.

    A non-finite number in an output is a missing bound somewhere upstream; it is reported
    with its key path instead of being written as `Infinity`, which is not JSON.
    """
    try:
        text = json.dumps(obj, indent=indent, allow_nan=False,
                          separators=None if indent is not None else (",", ":"))
        if "\\udc" in text:  # a name read from a non-UTF-8 path: write it as text readers take
            text = json.dumps(_valid_text(obj), indent=indent, allow_nan=False,
                              separators=None if indent is not None else (",", ":"))
        return text
    except ValueError:
        raise UsageError(f"refusing to write a non-finite number at {_nonfinite_path(obj) or '?'} "
                         "(an input or flag without a bound; please report it)") from None


def _utf8(text: str) -> bytes:
    """text as UTF-8; a non-UTF-8 file name inside it (lone surrogates) is written as \\xNN."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _valid_text(text).encode("utf-8")


def _valid_text(obj):
    """obj with every string valid Unicode: bytes a file name held that are not UTF-8 (Python
    keeps them as lone surrogates) are written as \\xNN, which every JSON reader takes."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return obj.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(obj, dict):
        return {_valid_text(k): _valid_text(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        kinds = set(map(type, obj))  # one pass in C: a record's long lists are flat
        if kinds <= _NUMBERS:  # samples: nothing to check
            return list(obj)
        if kinds == {str}:  # a job's hosts: checked as one text (lone surrogates stay lone)
            try:
                "\x00".join(obj).encode("utf-8")
                return list(obj)
            except UnicodeEncodeError:
                pass
        return [_valid_text(v) for v in obj]
    return obj


_NUMBERS = {int, float, bool, type(None)}


def _in_order(out: Any, src: Any) -> Any:
    """out (a model's dump) with every object's keys in src's order, where src has them: the
    file reads as its writer laid it out, fields the model added by name come after."""
    if isinstance(out, dict) and isinstance(src, dict):
        first = {k: _in_order(out[k], src[k]) for k in src if k in out}
        return {**first, **{k: v for k, v in out.items() if k not in first}}
    if isinstance(out, list) and isinstance(src, (list, tuple)) and len(out) == len(src):
        if not set(map(type, out)) & _CONTAINERS:  # flat (samples, hosts): no keys to order
            return out
        return [_in_order(o, s) for o, s in zip(out, src, strict=True)]
    return out


_CONTAINERS = {dict, list}


def as_contract(model: type[M], fields: dict, what: str) -> M:
    """fields built as `model`, a file format's one contract (the class its readers validate
    into): a writer that drifts from what its readers accept (a renamed key, a NaN, a count
    that disagrees with its samples) fails here, at the writer, as one line naming the
    field, instead of in a reader weeks later. Strings are taken as dumps_json writes them
    (a non-UTF-8 file name as \\xNN): what a reader will get."""
    return parse(model, _valid_text(fields), what)


def contract_dump(model: type[M], fields: dict, what: str) -> dict:
    """A file format's content as its writer puts it on disk: built as `model` (as_contract)
    and dumped from it. Only the keys the writer set are written (no defaults added), in the
    writer's order."""
    out = as_contract(model, fields, what).model_dump(mode="json", by_alias=True, exclude_unset=True)
    return {k: v for k, v in _in_order(out, fields).items() if k in fields}


def _nonfinite_path(obj, path: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return path or "(top level)"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _nonfinite_path(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def os_error(path: Path, exc: OSError, doing: str = "write") -> UsageError:
    """One line naming the path and the reason (kvbench.records.schema.read.path_error)."""
    return path_error(path, exc, doing)


def check_destination(directory: str | Path) -> Path:
    """Prove, before any measurement, that files can be created in directory.

    Creates the directory if needed, then creates and removes a probe file in it. Commands
    call this first so a bad --out costs a second, not a whole measurement.
    """
    d = Path(directory)
    if str(directory) == "":
        raise UsageError("an empty path is not a folder to write into")
    try:
        if path_kind(d, "write into") not in ("missing", "dir"):
            raise UsageError(f"cannot write into {d}: not a directory")
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvbench-probe.", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise os_error(d, exc, "write into") from None
    return d


def check_new_file(path: str | Path) -> Path:
    """check_destination for a file's folder, plus: the file must not exist yet."""
    if str(path) == "":
        raise UsageError("an empty path is not a file name")
    if str(path).endswith(os.sep):
        raise UsageError(f"{path} names a folder (it ends in {os.sep}); give a file name")
    p = Path(path)
    if path_kind(p, "write", follow=False) != "missing":
        raise UsageError(f"refusing to overwrite existing file {p}")
    check_destination(p.parent)
    return p


_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _umask() -> int:
    mask = os.umask(0o022)  # (reading the umask means setting it; set straight back)
    os.umask(mask)
    return mask


def _new_temp(path: Path) -> tuple[int, str]:
    """A hidden temp file beside path, registered in kvbench.errors.LIVE_TEMPS before Ctrl-C or
    SIGTERM can land (they are held off between its creation and its registration)."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS) if main else None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        LIVE_TEMPS.add(tmp)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs follow the umask like any file
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return fd, tmp


def _write_temp(path: Path, content: str | bytes | Iterable[str]) -> str:
    """content in a fresh temp file beside path, flushed to disk; returns the temp's name.
    content may be chunks of text, written as they come (a big job's records are never one
    string in memory)."""
    fd, tmp = _new_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            if isinstance(content, (str, bytes)):
                fh.write(content if isinstance(content, bytes) else _utf8(content))
            else:
                for chunk in content:
                    fh.write(_utf8(chunk))
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        _unlink_all([Path(tmp)])
        raise
    return tmp


class Staged:
    """A new file written over time into a hidden temp beside its final name, then committed
    by write_files with the rest of its group (or discarded): a big output (a matrix's draws
    and pairs at N = 1,024, GBs) is streamed to disk once, never held whole nor copied."""

    def __init__(self, path: str | Path):
        try:
            fd, self.tmp = _new_temp(Path(path))
        except OSError as exc:
            raise os_error(Path(path), exc) from None
        self.fh = os.fdopen(fd, "w+b")

    def done(self) -> str:
        """Flushed, synced and closed: the temp's name, for write_files to link."""
        if not self.fh.closed:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
        return self.tmp

    def discard(self) -> None:
        self.fh.close()
        _unlink_all([Path(self.tmp)])


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the files themselves are synced
    finally:
        os.close(fd)


def write_files(files: Sequence[tuple[str | Path, str | bytes | Iterable[str] | Staged]]
                ) -> list[Path]:
    """Write several new files so that all of them appear or none (a group commit); a
    Staged content is a temp written already, linked as it is.

    Every file is first written to a temp file beside its target and synced; only then are
    the temps linked to their names (os.link: atomic, and fails if the name exists). If a
    link fails, the names already linked are removed again. No temp file is left behind.
    """
    targets = [Path(p) for p, _ in files]
    temps: list[tuple[str, Path]] = []
    linked: list[Path] = []
    current = targets[0] if targets else Path(".")
    try:
        for (_, content), path in zip(files, targets, strict=True):
            current = path
            path.parent.mkdir(parents=True, exist_ok=True)
            temps.append((content.done() if isinstance(content, Staged)
                          else _write_temp(path, content), path))
        for tmp, path in temps:
            current = path
            os.link(tmp, path)
            linked.append(path)
        for d in {p.parent for p in targets}:
            _fsync_dir(d)
    except FileExistsError:
        _unlink_all(linked)
        raise UsageError(f"refusing to overwrite existing file {current}") from None
    except OSError as exc:
        _unlink_all(linked)
        raise os_error(current, exc) from None
    except BaseException:
        _unlink_all(linked)
        raise
    finally:
        _unlink_all([Path(t) for t, _ in temps])
    return targets


def _unlink_all(paths: Sequence[Path]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
        LIVE_TEMPS.discard(str(p))


@contextlib.contextmanager
def new_file_stream(path: str | Path):
    """A text file written over time (e.g. a scrape) that appears at path only when complete.

    Yields a handle on a temp file beside path; on a clean exit the temp is synced and
    linked to path (refusing an existing file); on any exit the temp is removed.
    """
    path = Path(path)
    try:
        fd, tmp = _new_temp(path)
    except OSError as exc:
        raise os_error(path, exc) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)
        _fsync_dir(path.parent)
    except FileExistsError:
        raise UsageError(f"refusing to overwrite existing file {path}") from None
    except OSError as exc:
        raise os_error(path, exc) from None
    finally:
        _unlink_all([Path(tmp)])


def write_new_file(path: Path, content: str | bytes) -> Path:
    """Write text or bytes to path atomically; refuse to replace an existing file."""
    return write_files([(path, content)])[0]


PLOT_FORMATS = ("png", "svg", "pdf")


def plot_format(path: str | Path, flag: str = "--plot") -> str:
    """matplotlib's savefig format for a plot file, from its suffix; anything else is refused."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in PLOT_FORMATS:
        raise UsageError(f"{flag} {path}: use a .png, .svg or .pdf file name")
    return fmt


def fresh_stem(out_dir: Path, prefix: str, suffixes: Sequence[str]) -> Path:
    """out_dir/prefix-<UTC stamp>-<6 random hex digits>, with no file of any suffix there yet.

    The random part keeps concurrent writers apart (six runs started in the same second on
    a shared folder get six names); write_records retries if a name is taken meanwhile.
    """
    while True:
        stem = Path(out_dir) / f"{prefix}-{utc_stamp()}-{secrets.token_hex(3)}"
        if all(path_kind(stem.with_name(stem.name + s), "write", follow=False) == "missing"
               for s in suffixes):
            return stem


def _csv_cell(value):
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"))
    return value


def records_to_csv(records: Sequence[dict]) -> str:
    """Flat CSV twin of the JSONL: scalars as they are, lists and objects as compact JSON."""
    return "".join(csv_lines(records))


def csv_lines(records: Sequence[dict]) -> Iterator[str]:
    """records_to_csv's text, a few records at a time (the columns are every record's keys,
    in first-seen order: one pass over the records for them, one to write)."""
    columns: dict[str, None] = {}
    for rec in records:
        columns.update(dict.fromkeys(rec))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for k, rec in enumerate(records):
        writer.writerow({key: _csv_cell(v) for key, v in rec.items()})
        if k % 256 == 255:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def write_records(out_dir: Path, records: Sequence[dict], prefix: str,
                  extra: Sequence[tuple[str, str | bytes]] = ()) -> tuple[Path, Path]:
    """Write records as a new <prefix>-<stamp>-<random>.jsonl plus its .csv twin, together.

    extra: more (suffix, content) files of the same run committed in the same group.
    """
    suffixes = (".jsonl", ".csv", *(s for s, _ in extra))
    for _ in range(5):  # a name taken between fresh_stem and the link: take another
        stem = fresh_stem(Path(out_dir), prefix, suffixes)
        jsonl = (dumps_json(r, indent=None) + "\n" for r in records)  # streamed, record by record
        contents = (jsonl, csv_lines(records), *(c for _, c in extra))
        files = [(stem.with_name(stem.name + s), c) for s, c in zip(suffixes, contents, strict=True)]
        try:
            paths = write_files(files)
        except UsageError as exc:
            if not str(exc).startswith("refusing to overwrite"):
                raise
            continue
        return paths[0], paths[1]
    raise UsageError(f"could not find a free file name in {out_dir}")


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


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages when the run started: a busy machine says so."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace ('pid:[4026531836]'), None where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


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
        "load_average": _load_average(),
        "variables": relevant_env(),
        # two ranks of one process, or in different containers, cannot use UCX's intra-node
        # transports (kvbench.links.linkcauses reads these)
        "pid": os.getpid(),
        "pid_namespace": _pid_namespace(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():  # this rank's GPU (p2p binds it first), not GPU 0
            env["gpu_index"] = torch.cuda.current_device()
            env["gpu"] = torch.cuda.get_device_name(env["gpu_index"])
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
