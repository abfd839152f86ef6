"""The engine-shaped handoff: how a serving engine lays out and addresses the KV it moves.

A *link* handoff moves a buffer as fast as the transport allows. An *engine-shaped* one
moves it the way vLLM 0.32.0's NIXL connector does (read from its sources; docs/nixl.md
"Engine-shaped handoff" cites file and line), so that its cost is what the engine pays:

- regions: one per attention layer, K and V of a block in one page (`kv joint`, vLLM 0.32.0
  CPU/FlashAttention caches), or one per layer and part (`kv split`, older versions and other
  backends); every region holds the whole block pool;
- descriptors: one per block per region, ids region-major (`region * pool_blocks + block`),
  one block table shared by every layer, its ids contiguous, scattered, or read from a file
  (NIXL merges runs that are consecutive on both sides, so this changes the merged count);
- completion polled at an engine's step cadence (a fixed period, or step times drawn from
  a recorded distribution) instead of a busy loop.

This module holds the parts that need no NIXL: option parsing, block tables, the message
plan with its region table, descriptor ids and the merged count they should give, and the
poll schedule. The NIXL side is kvbench.p2p.transports.nixl_engine.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
from dataclasses import dataclass

from kvbench.cli import UsageError, bounded_float
from kvbench.p2p.layout import KVCache, as_bytes
from kvbench.p2p.messages import MessagePlan
from kvbench.records.schema.engine import (
    MAX_SIDE_FILE_BYTES,
    MAX_STEP_MS,
    load_block_ids,
    load_poll_file,
)
from kvbench.records.schema.read import read_bounded

KV_PAGES = ("joint", "split")
BLOCK_IDS = ("contiguous", "scattered")  # or file:PATH


@dataclass(frozen=True)
class Region:
    """One registered region as the initiator addresses it: `n_blocks` blocks of `block_len`
    bytes, `stride` bytes apart from `base`."""

    base: int
    stride: int
    n_blocks: int
    block_len: int

    def addr(self, block: int) -> int:
        return self.base + block * self.stride


# ---------------------------------------------------------------------------
# block tables


def read_block_file(path: str) -> dict[str, list[int]]:
    """{"prefill": [...], "decode": [...]} block ids (a recorded allocation), read through the
    typed, bounded model (kvbench.records.schema.engine): UsageError of one line."""
    doc = load_block_ids(path)
    return {"prefill": doc.prefill, "decode": doc.decode}


def block_ids_label(kind: str) -> str:
    """What goes into the spec: the kind, or for a file the hash of its content (a path says
    nothing about what was measured)."""
    if not kind.startswith("file:"):
        return kind
    return f"file#{_digest(kind[5:], 'block-id file')}"


def _digest(path: str, what: str) -> str:
    data = read_bounded(path, MAX_SIDE_FILE_BYTES, what, missing=f"no such {what}")
    return hashlib.sha256(data).hexdigest()[:8]


def pool_blocks(kind: str, need: int, side: str, slack: float = 0.125) -> int:
    """Blocks of the pool one side allocates for a request of `need` blocks (as KVCache sizes
    it): `need` plus slack, or up to the largest id the request uses from a block-id file."""
    pool = need + max(1, math.ceil(need * slack))
    if kind.startswith("file:"):
        pool = max(pool, max(block_table(kind, need, side)) + 1)
    return pool


def block_table(kind: str, need: int, side: str, seed: int = 0) -> list[int]:
    """The block ids one side's request uses (first `need` entries matter): contiguous from 0
    (a fresh engine's allocator), scattered (a random draw from a pool with 1/8 slack, seeded
    per side), or the recorded list from a file (file:PATH)."""
    if kind == "contiguous":
        return list(range(need))
    if kind == "scattered":  # ids two apart, shuffled: no neighbour is ever the next id, so
        # nothing merges (a random draw from a small pool often came out consecutive)
        slots = need + max(1, math.ceil(need / 8))
        rng = random.Random(10_007 + seed * 7919 + (side == "decode"))
        return rng.sample([2 * k + (side == "decode") for k in range(slots)], need)
    if kind.startswith("file:"):
        ids = read_block_file(kind[5:])[side]
        if len(ids) < need:
            raise UsageError(f"block-id file {kind[5:]}: {side}: lists {len(ids)} block ids, the "
                             f"largest request (--sizes) needs {need}")
        return ids[:need]
    raise UsageError(f"unknown block ids {kind!r}: contiguous, scattered or file:PATH")


# ---------------------------------------------------------------------------
# the message plan with its region table


def region_table(data: KVCache) -> list[Region]:
    """The cache's regions in registration order (layer, then part for split pages)."""
    s = data.spec
    out = []
    for layer in range(s.model.layers):
        pool = data.backing[layer]  # joint: [pool, parts, bs, H, W]; split: [parts, pool, ...]
        parts = [pool] if s.pages == "joint" else [pool[p] for p in range(s.parts)]
        for t in parts:
            page = t[0].numel() * t.element_size()
            out.append(Region(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0], page))
    return out


def plan_engine(data: KVCache) -> MessagePlan:
    """One message per (region, block of the request), region-major, each a page of the
    cache itself (zero copy). `plan.regions` and `plan.blocks` carry what the transport
    needs to build the engine's descriptor lists and ids."""
    s = data.spec
    if s.layout != "paged":
        raise ValueError("the engine-shaped handoff moves a paged KV (--layout paged)")
    regions = region_table(data)
    per_layer = 1 if s.pages == "joint" else s.parts
    bufs, layers, blocks = [], [], []
    for layer in range(s.model.layers):
        table = data.block_ids[layer]  # the host copy: no device read per block
        for p in range(per_layer):
            r = layer * per_layer + p
            src = data.backing[layer] if s.pages == "joint" else data.backing[layer, p]
            for b in table:
                bufs.append(as_bytes(src[b]))
                layers.append(layer)
                blocks.append((r, b))
    plan = MessagePlan(bufs, layers, _cache=data)
    plan.regions, plan.blocks = regions, blocks
    return plan


# ---------------------------------------------------------------------------
# descriptor ids and the count NIXL should merge them into


def desc_ids(regions: list[Region], blocks: list[tuple[int, int]]) -> list[int]:
    """Region-major ids into a dlist holding every region's whole pool, in region order
    (vLLM: region_offsets[r] + block)."""
    offsets = [0]
    for reg in regions[:-1]:
        offsets.append(offsets[-1] + reg.n_blocks)
    return [offsets[r] + b for r, b in blocks]


def check_region_major(blocks: list[tuple[int, int]]) -> None:
    """The ids must be region-ordered (vLLM asserts the same): every region's blocks together,
    regions ascending. Raises ValueError at the first violation."""
    seen, last = set(), None
    for i, (r, _b) in enumerate(blocks):
        if r != last:
            if r in seen or (last is not None and r < last):
                raise ValueError(f"descriptor {i}: region {r} after region {last}: the ids are "
                                 "not region-major")
            seen.add(r)
            last = r


def dlist_rows(regions: list[Region]) -> list[tuple[int, int]]:
    """(address, length) of every row of the full dlist, region-major."""
    return [(reg.addr(b), reg.block_len) for reg in regions for b in range(reg.n_blocks)]


def merged_count(local_rows, local_ids, remote_rows, remote_ids) -> int:
    """Descriptors left after NIXL merges neighbours: entry i joins entry i-1 when both its
    local and remote ids are the next ids and the rows are adjacent in memory on both sides."""
    if not local_ids:
        return 0
    n = 1
    for i in range(1, len(local_ids)):
        li, ri, lp, rp = local_ids[i], remote_ids[i], local_ids[i - 1], remote_ids[i - 1]
        joined = (li == lp + 1 and ri == rp + 1
                  and local_rows[li][0] == local_rows[lp][0] + local_rows[lp][1]
                  and remote_rows[ri][0] == remote_rows[rp][0] + remote_rows[rp][1])
        n += not joined
    return n


# ---------------------------------------------------------------------------
# the engine's completion poll


class PollSchedule:
    """When the engine looks at a transfer again: `busy` (every test), `fixed:MS` (an idle
    engine steps about every millisecond), or `draw:FILE` (step times drawn from a recorded
    distribution: a JSON list of step times in ms, or {"le_ms": [...], "count": [...]} with
    cumulative histogram counts, drawn uniformly inside the bucket)."""

    def __init__(self, text: str, seed: int = 0):
        self.text = text
        self.kind, _, arg = text.partition(":")
        self.rng = random.Random(seed)
        self.samples: list[float] = []
        self.buckets: list[tuple[float, float, float]] = []  # (lo, hi, cumulative fraction)
        if self.kind == "busy" and not arg:
            return
        if self.kind == "fixed":
            self.period = bounded_float(arg, "--nixl-poll fixed:MS (the period in ms)", 0.0,
                                        MAX_STEP_MS, lo_open=True)
            return
        if self.kind == "draw" and arg:
            self._load(arg)
            return
        raise UsageError(f"poll {text!r}: busy, fixed:MS or draw:FILE")

    def _load(self, path: str) -> None:
        doc = load_poll_file(path)
        if isinstance(doc, list):
            self.samples = doc
            return
        lo = 0.0
        for bound, c in zip(doc.le_ms, doc.count, strict=True):
            self.buckets.append((lo, bound, c / doc.count[-1]))
            lo = bound

    @property
    def busy(self) -> bool:
        return self.kind == "busy"

    def next_ms(self) -> float:
        """The time to the engine's next step, in ms."""
        if self.kind == "fixed":
            return self.period
        if self.samples:
            return self.rng.choice(self.samples)
        u = self.rng.random()
        for lo, hi, frac in self.buckets:
            if u <= frac:
                return self.rng.uniform(lo, hi)
        return self.buckets[-1][1]

    def label(self) -> str:
        """For the spec: a drawn schedule by the content of its file."""
        if self.kind != "draw":
            return self.text
        return f"draw#{_digest(self.text[5:], 'poll file')}"


# How an engine's threads wait (--nixl-waits): sleep, yield (sched_yield spinning), spin, or
# engine: what vLLM 0.32's worker does on its step queue, yield-spinning for a window after its
# last step and sleeping after it (vllm/distributed/device_communicators/shm_broadcast.py:138,
# :195-208: SpinCondition.wait, busy_loop_s = 1).
WAITS = ("sleep", "yield", "spin", "engine")
REQUEST_WAIT_S = 100e-6  # one nap of a sleeping wait (an idle engine wakes within ~0.1 ms)
ENGINE_SPIN_WINDOW_MS = 1000.0  # vLLM 0.32's busy_loop_s


class Waits:
    """How one rank's engine-shaped threads wait between two pieces of work. `engine` yields
    while the last work (`worked()`: a post, a look at NIXL, an engine step) is less than
    `window_ms` old and sleeps after that, so a post after a short idle comes from a
    yield-spinning thread and one after a long idle from a sleeping one, as in vLLM's worker
    (which of the two a post comes from decides whether it tends to lose the core to NIXL's
    progress thread: docs/nixl.md, "Why the waits matter")."""

    def __init__(self, mode: str, window_ms: float = ENGINE_SPIN_WINDOW_MS):
        if mode not in WAITS:
            raise UsageError(f"--nixl-waits {mode!r}: one of {', '.join(WAITS)}")
        self.mode, self.window_s = mode, window_ms / 1e3
        self.last_work = time.perf_counter()

    def worked(self) -> None:
        """The thread just did engine work (its spin window starts again)."""
        self.last_work = time.perf_counter()

    def idle_s(self) -> float:
        """Seconds since the last work."""
        return time.perf_counter() - self.last_work

    def _now(self) -> str:
        """The mode this wait uses now (engine: yield inside the window, sleep after it)."""
        if self.mode != "engine":
            return self.mode
        return "yield" if time.perf_counter() < self.last_work + self.window_s else "sleep"

    def pause(self) -> None:
        """One pause between two tests (spin: none)."""
        mode = self._now()
        if mode == "yield":
            os.sched_yield()
        elif mode == "sleep":
            time.sleep(REQUEST_WAIT_S)

    def until(self, t: float) -> None:
        """Wait until perf_counter time `t` (engine: yield to the window's end, then sleep)."""
        if self.mode in ("spin", "yield"):
            self._spin(t, yielding=self.mode == "yield")
            return
        if self.mode == "engine":
            self._spin(min(t, self.last_work + self.window_s), yielding=True)
        left = t - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def busy(self, t: float) -> None:
        """Engine work until perf_counter time `t`: the core kept busy without a yield or a
        sleep (a forward pass on this core), its spin window starting again at the end."""
        self._spin(t, yielding=False)
        self.worked()

    @staticmethod
    def _spin(t: float, yielding: bool) -> None:
        while time.perf_counter() < t:
            if yielding:
                os.sched_yield()

    def label(self) -> dict:
        """What goes into the spec: the mode, and the window when it has one."""
        out: dict = {"nixl_waits": self.mode}
        if self.mode == "engine":
            out["nixl_spin_window_ms"] = round(self.window_s * 1e3, 6)
        return out


class Gaps:
    """Idle time before each handoff (--nixl-gap-ms MEAN, --nixl-gaps fixed|exp, --nixl-gap-seed):
    a fixed gap, or gaps drawn exponentially with that mean from a seeded generator, as an
    open-loop client with Poisson arrivals at 1000/MEAN requests/s spaces them (vLLM's `bench
    serve` at --burstiness 1, the lab's client). Every rank draws the same sequence."""

    KINDS = ("fixed", "exp")

    def __init__(self, mean_ms: float, kind: str = "fixed", seed: int = 0):
        if kind not in self.KINDS:
            raise UsageError(f"--nixl-gaps {kind!r}: fixed or exp")
        self.mean_s, self.kind, self.seed = mean_ms / 1e3, kind, seed
        self.rng = random.Random(seed)

    def next_s(self) -> float:
        if self.kind == "fixed" or self.mean_s <= 0:
            return self.mean_s
        return self.rng.expovariate(1.0 / self.mean_s)

    def label(self) -> dict:
        """For the spec: the mean, and for drawn gaps the distribution and the seed."""
        if self.mean_s <= 0:
            return {}
        out: dict = {"nixl_gap_ms": round(self.mean_s * 1e3, 6)}
        if self.kind != "fixed":
            out.update(nixl_gaps=self.kind, nixl_gap_seed=self.seed)
        return out


def usage_error(args, need: int = 1) -> str | None:
    """Why the flags cannot run the engine-shaped handoff (or a poll schedule), else None.
    `need`: the blocks the largest request needs (a block-id file must list that many)."""
    shape = getattr(args, "nixl_shape", "link")
    try:
        if getattr(args, "nixl_poll", None):
            PollSchedule(args.nixl_poll)
        why = _pacing_error(args)
        if why or shape != "engine":
            return why
        if args.transport != "nixl":
            return "--nixl-shape engine needs --transport nixl"
        if args.layout != "paged" or args.granularity != "block":
            return "--nixl-shape engine moves a paged KV block by block: add --layout paged --granularity block"
        if args.pattern.strip() != "sequential":
            return "--nixl-shape engine runs with --pattern sequential (one request, prefill -> decode)"
        if args.nixl_op == "write":
            return "--nixl-shape engine models vLLM's pull connector (decode READs): use --nixl-op read"
        if args.nixl_recreate or args.nixl_reregister or args.nixl_prep != "prepped" or args.nixl_batch:
            return ("--nixl-shape engine makes its own transfer requests: drop --nixl-recreate, "
                    "--nixl-reregister, --nixl-prep and --nixl-batch (see --no-nixl-per-request)")
        if args.bytes is not None or args.minbytes is not None or args.maxbytes is not None:
            return "--nixl-shape engine moves a model's KV: give --sizes (tokens), not --bytes"
        for side in ("prefill", "decode"):  # enough ids for the largest request
            block_table(args.nixl_blocks, need, side)
    except (ValueError, UsageError) as exc:
        return str(exc)
    return None


def _pacing_error(args) -> str | None:
    """Why the waits and gap flags do not go together, else None."""
    waits = getattr(args, "nixl_waits", None)
    if getattr(args, "nixl_shape", "link") != "engine":
        if waits not in (None, "spin"):
            return "--nixl-waits models an engine's threads: it needs --nixl-shape engine"
        if getattr(args, "nixl_gaps", "fixed") != "fixed":
            return "--nixl-gaps models an engine's load: it needs --nixl-shape engine"
        if getattr(args, "nixl_announce", None) is not None:
            return "--nixl-announce is the engine shape's control plane: it needs --nixl-shape engine"
    if getattr(args, "nixl_spin_window_ms", None) is not None and waits != "engine":
        return "--nixl-spin-window-ms is the window of --nixl-waits engine: add it"
    if getattr(args, "nixl_gaps", "fixed") != "fixed" and not getattr(args, "nixl_gap_ms", 0.0):
        return "--nixl-gaps exp draws gaps with the mean --nixl-gap-ms: give it (> 0)"
    if getattr(args, "nixl_busy_ms", 0.0) and not getattr(args, "nixl_gap_ms", 0.0):
        return "--nixl-busy-ms is decode's work inside the gap between requests: give --nixl-gap-ms"
    if getattr(args, "nixl_busy_ms", 0.0) and getattr(args, "nixl_shape", "link") != "engine":
        return "--nixl-busy-ms models an engine's decode: it needs --nixl-shape engine"
    return None
