"""What UCX says about a NIXL run: its version and the protocols it selected.

UCX prints its protocol selection (UCX_PROTO_INFO=y) into its log; kvbench points that log
at a private file per process (unless the user set UCX_PROTO_INFO or UCX_LOG_FILE), reads
the tables back, and names the path the bytes took ("RMA write: cma/memory (zero-copy)").
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import tempfile
from pathlib import Path

from kvbench.links.ucx_rows import path_category, summarize


def _ucx_version(mod) -> str | None:
    """UCX's own version string, from the libucp the NIXL wheel bundles (None if not found)."""
    try:
        root = Path(mod.__file__).resolve().parent  # e.g. site-packages/nixl_cu12
        libs = sorted(root.parent.glob(f"{root.name}.libs/libucp*.so*"))  # the wheel's own UCX
        lib = ctypes.CDLL(str(libs[0])) if libs else ctypes.CDLL("libucp.so.0")
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return lib.ucp_get_version_string().decode()
    except Exception:  # noqa: BLE001 - unknown is an answer
        return None


_UCX_LOG: Path | None = None  # this process's UCX log: UCX opens its log file once per process


def _remove_ucx_log() -> None:
    if _UCX_LOG is not None:
        _UCX_LOG.unlink(missing_ok=True)


def _ucx_probe() -> Path | None:
    """The file UCX logs its protocol selection into (UCX_PROTO_INFO), unless the user asked
    for UCX logging themselves; created once per process, removed at exit."""
    global _UCX_LOG
    if _UCX_LOG is None:
        if "UCX_PROTO_INFO" in os.environ or "UCX_LOG_FILE" in os.environ:
            return None
        _UCX_LOG = Path(tempfile.gettempdir()) / f"kvbench-ucx-{os.getpid()}.log"
        atexit.register(_remove_ucx_log)
    return _UCX_LOG


def _flush_c_stdio() -> None:
    """UCX writes its log through C stdio buffers: flush them before reading the file."""
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - then we read what is there
        pass


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")


def parse_ucx_proto_info(text: str) -> list[dict]:
    """The protocol tables UCX prints with UCX_PROTO_INFO=y, as rows:
    {"endpoint": "kv-0 intra-node cfg#1", "operation": "remote memory write by ucp_put* ...",
     "range": "0..inf", "protocol": "zero-copy", "transport": "cma/memory"}."""
    rows, cells_seen = [], []
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        if line.startswith("+"):
            continue
        if not (line.startswith("|") and line.endswith("|")):
            cells_seen = []
            continue
        cells = [c.strip() for c in line[1:-1].split("|")]
        if len(cells) == 1:  # a table's title lines: endpoint config, then the operation
            if len(cells_seen) >= 2:
                cells_seen = []
            cells_seen.append(cells[0])
        elif len(cells) == 3 and cells[0] != "Range" and len(cells_seen) == 2:
            rows.append({"endpoint": cells_seen[0], "operation": cells_seen[1], "range": cells[0],
                         "protocol": cells[1], "transport": cells[2]})
    return rows


def summarize_path(rows: list[dict], op: str, memory: str | None = None) -> str | None:
    """'RMA write: cma/memory (zero-copy); notifications (AM): tcp/lo': the protocols UCX
    selected on the peer endpoints for this run's operation and for the notifications. With
    `memory` ("cuda" or "host": where the KV lives) only the rows between that memory on both
    sides are the KV's path; the others are listed apart (kvbench.links.ucx_rows)."""
    return summarize(rows, op, memory)


# ---------------------------------------------------------------------------
# per peer: UCX's tables name an endpoint configuration ("kv-0 inter-node cfg#2"), never the
# peer. A table is printed once per configuration, when it is first used; the transport notes
# which peer it was working with when each table appeared (NIXLTransport.note_peer).


def read_complete_lines(path: Path, offset: int) -> tuple[str, int]:
    """The complete lines of a log from `offset` on, and the offset after them (a line UCX
    is still writing is left for the next read)."""
    _flush_c_stdio()
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return "", offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace"), offset + end


def _config_rows(rows: list[dict], op: str) -> dict[str, list[dict]]:
    """Rows by endpoint configuration, keeping only configurations that did `op`'s RMA."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["endpoint"], []).append(r)
    return {k: v for k, v in by.items()
            if any(path_category(r) == f"RMA {op}" for r in v)}


def peer_rows(noted: list[dict], every: list[dict], op: str) -> tuple[list[dict], str]:
    """The rows that describe this rank's endpoint to one peer, and how they were found.

    `noted`: the rows that appeared while this rank worked with that peer; `every`: all this
    rank's rows. The endpoint's configuration is the one whose `op` table was printed with the
    peer (the last one, when wire-up printed a first configuration and then the final one),
    and its rows are all the rows of that configuration, whenever UCX printed them (an active
    message table may come later, at the first notification). None printed: the peer's
    endpoint reused a configuration printed earlier, which is known only when this rank used
    one configuration in all."""
    configs = _config_rows(every, op)
    mine = [c for c in _config_rows(noted, op) if c in configs]
    if mine:
        return configs[mine[-1]], "printed while connecting to the peer"
    if len(configs) == 1:
        return next(iter(configs.values())), "the only endpoint configuration this rank used"
    if not configs:
        return [], "UCX reported no protocol selection"
    return [], (f"ambiguous: the endpoint reused one of {len(configs)} configurations printed "
                f"earlier ({', '.join(configs)})")
