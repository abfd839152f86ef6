"""Which of UCX's protocol rows carried the KV (a pure reader: rows in, facts out).

UCX prints one table per (endpoint configuration, operation), and the operation names the
memory on both sides: "remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1]",
"remote memory read by ucp_get* into host memory from host". A NIXL run's endpoint has rows
for every pair of memory types UCX wired up, most of which the run never used for its KV
(host -> host for NIXL's own buffers, host -> cuda for staging). The KV's path is the rows
whose memory on *both* sides is where the KV lives (cuda for VRAM, host for DRAM); the rest
is kept apart (other memory, notifications), never merged into the KV's path.

Torch-free and MPI-free (imported by kvbench.links.linkpath and the NIXL transport alike).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RMA = re.compile(r"^remote memory (?P<op>write|read) by ucp_(?:put|get)\*(?:\(multi\))? "
                  r"(?:from|into) (?P<local>.+?) (?:to|from) (?P<remote>\S+)\s*$")


def path_category(row: dict) -> str | None:
    """What a UCX protocol row is for, on an endpoint to a peer (not the loopback one)."""
    if " self " in f" {row['endpoint']} ":
        return None
    op = row["operation"]
    if op.startswith("remote memory write"):
        return "RMA write"
    if op.startswith("remote memory read"):
        return "RMA read"
    if op.startswith("active message by ucp_am_send* from"):
        return "notifications (AM)"
    return None


def memory_type(text: str) -> str:
    """'host memory' / 'host' -> host; 'cuda/GPU0', 'cuda/dev[1]' -> cuda; 'rocm/..' -> rocm."""
    text = text.strip()
    if text.startswith("host"):
        return "host"
    return text.split("/", 1)[0].split()[0]


def row_memory(row: dict) -> tuple[str, str] | None:
    """(this side's, the peer's) memory type of an RMA row; None for any other row."""
    m = _RMA.match(row.get("operation", ""))
    if not m:
        return None
    return memory_type(m["local"]), memory_type(m["remote"])


def lanes(row: dict) -> list[str]:
    """The transport/device lanes of a row's Config cell ('rc_mlx5/mlx5_0:1, cuda_copy/cuda',
    '50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1')."""
    return re.findall(r"[a-z][a-z0-9_]*/[^\s,]+", row.get("transport", ""))


@dataclass(frozen=True)
class RowSplit:
    """A run's UCX rows for one operation, split by what they carried."""

    kv: tuple[dict, ...]  # the op's rows with the KV's memory on both sides
    other: tuple[dict, ...]  # the op's rows between other memory types (not the KV's bytes)
    notifications: tuple[dict, ...]  # active messages: NIXL's notifications


def split_rows(rows: list[dict], op: str, memory: str | None) -> RowSplit:
    """Split the rows of RMA `op` by memory type; memory None: every row of the op is the KV's
    (a record that does not say where its KV lived)."""
    kv, other, notif = [], [], []
    for r in rows:
        cat = path_category(r)
        if cat == "notifications (AM)":
            notif.append(r)
        elif cat == f"RMA {op}":
            mem = row_memory(r)
            (kv if memory is None or mem is None or mem == (memory, memory) else other).append(r)
    return RowSplit(tuple(kv), tuple(other), tuple(notif))


def _what(r: dict, with_memory: bool = False) -> str:
    mem = row_memory(r) if with_memory else None
    where = f", {mem[0]}->{mem[1]}" if mem else ""
    return f"{r['transport']} ({r['protocol']}{where})"


def _unique(items) -> list[str]:
    out: list[str] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def summarize(rows: list[dict], op: str, memory: str | None = None) -> str | None:
    """'RMA write: cuda_ipc/cuda (zero-copy); other memory (not the KV): cma/memory
    (zero-copy, host->host); notifications (AM): tcp/lo'. With memory None every row of the
    op is listed under 'RMA op' (the summary of records written before the split)."""
    s = split_rows(rows, op, memory)
    parts = []
    if s.kv:
        parts.append(f"RMA {op}: " + ", ".join(_unique(_what(r) for r in s.kv)))
    elif memory is not None and s.other:
        parts.append(f"RMA {op}: no {memory}->{memory} row")
    if s.other:
        parts.append("other memory (not the KV): "
                     + ", ".join(_unique(_what(r, True) for r in s.other)))
    if s.notifications:
        parts.append("notifications (AM): " + ", ".join(_unique(r["transport"]
                                                                 for r in s.notifications)))
    return "; ".join(parts) or None
