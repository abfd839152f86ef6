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

This module holds the parts that need no NIXL: option parsing, the message plan (the page
plan of kvbench.kv.cut, where block tables and regions live), descriptor ids and the merged
count they should give, and the poll schedule. The NIXL side is
kvbench.p2p.transports.nixl.engine.
"""

from __future__ import annotations

import os
import random
import time

from kvbench.errors import UsageError, bounded_float
from kvbench.kv.cut import (  # noqa: F401  (block tables and regions live with the cut)
    BLOCK_IDS,
    KV_PAGES,
    Cut,
    Region,
    block_ids_label,
    block_table,
    file_digest,
    page_layout,
    pool_blocks,
    read_block_file,
)
from kvbench.p2p.layout import KVCache
from kvbench.p2p.messages import MessagePlan
from kvbench.p2p.pages import plan_pages
from kvbench.p2p.transports.nixl.profile import FLAG
from kvbench.records.schema.engine import MAX_STEP_MS, load_poll_file

# ---------------------------------------------------------------------------
# the message plan: the page plan of kvbench.kv.cut


def plan_engine(data: KVCache) -> MessagePlan:
    """One message per (region, block of the request), region-major, each a page of the
    cache itself (zero copy): the page plan of one cache with whole pages (TP 1:1).
    `plan.regions` and `plan.blocks` carry what the transport needs to build the engine's
    descriptor lists and ids."""
    s = data.spec
    if s.layout != "paged":
        raise ValueError("the engine-shaped handoff moves a paged KV (--layout paged)")
    cut = Cut(s.block_size, s.pages, "contiguous")
    return plan_pages([data], page_layout(s.model, s.dtype, cut), cut, "decode")


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
            self.period = bounded_float(arg, "poll fixed:MS (the period in ms)", 0.0,
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
        return f"draw#{file_digest(self.text[5:], 'poll file')}"


# How an engine's threads wait (the profile key waits): sleep, yield (sched_yield spinning), spin, or
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
            raise UsageError(f"waits {mode!r}: one of {', '.join(WAITS)}")
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
    """Idle time before each handoff (profile keys gap_ms MEAN, gaps fixed|exp, gap_seed):
    a fixed gap, or gaps drawn exponentially with that mean from a seeded generator, as an
    open-loop client with Poisson arrivals at 1000/MEAN requests/s spaces them (vLLM's `bench
    serve` at --burstiness 1, the lab's client). Every rank draws the same sequence."""

    KINDS = ("fixed", "exp")

    def __init__(self, mean_ms: float, kind: str = "fixed", seed: int = 0):
        if kind not in self.KINDS:
            raise UsageError(f"gaps {kind!r}: fixed or exp")
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


def usage_error(args) -> str | None:
    """Why the flags cannot run the engine-shaped handoff (or a poll schedule), else None.
    (The block ids are the cut's: kvbench.p2p.args.cuts_of checks them, files included;
    each profile key's own type and bounds are checked as it is parsed: .profile.)"""
    shape = getattr(args, "nixl_shape", "link")
    try:
        if getattr(args, "nixl_poll", None):
            PollSchedule(args.nixl_poll)
        why = _pacing_error(args)
        if why or shape != "engine":
            return why
        if args.transport != "nixl":
            return f"{FLAG} needs --transport nixl"
        if args.layout != "paged" or args.granularity != "block":
            return f"{FLAG} moves a paged KV block by block: add --layout paged --granularity block"
        if args.pattern.strip() != "sequential":
            return f"{FLAG} runs with --pattern sequential (one request, prefill -> decode)"
        if args.nixl_op == "write":
            return f"{FLAG} models vLLM's pull connector (decode READs): use --nixl-op read"
        if args.nixl_recreate or args.nixl_reregister or args.nixl_prep != "prepped" or args.nixl_batch:
            return (f"{FLAG} makes its own transfer requests: drop --nixl-recreate, "
                    "--nixl-reregister, --nixl-prep and --nixl-batch (see its key per_request=false)")
        if args.bytes is not None or args.minbytes is not None or args.maxbytes is not None:
            return f"{FLAG} moves a model's KV: give --sizes (tokens), not --bytes"
    except (ValueError, UsageError) as exc:
        return str(exc)
    return None


def _pacing_error(args) -> str | None:
    """Why the profile's pacing keys do not go together, else None. Only a key a profile
    layer set itself trips a check (a default never does): .profile.resolve."""
    given = set(getattr(args, "nixl_profile_given", None) or ())
    waits = getattr(args, "nixl_waits", None)
    if "spin_window_ms" in given and waits != "engine":
        return f"{FLAG}: spin_window_ms is the window of waits=engine: add it"
    if getattr(args, "nixl_gaps", "fixed") != "fixed" and not getattr(args, "nixl_gap_ms", 0.0):
        return f"{FLAG}: gaps=exp draws gaps with the mean gap_ms: give it (> 0)"
    if getattr(args, "nixl_busy_ms", 0.0) and not getattr(args, "nixl_gap_ms", 0.0):
        return f"{FLAG}: busy_ms is decode's work inside the gap between requests: give gap_ms"
    return None
