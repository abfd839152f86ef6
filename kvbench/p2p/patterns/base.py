"""What every handoff pattern shares: the context it runs in, the data it moves, and the shape
of a declaration. A pattern declares, per point, its links (edges with their data and message
plans) and the handoffs built from them (`PointRun`); the engine (kvbench.p2p.engine) runs the
protocol, the harness the timing, and p2p the records."""

from __future__ import annotations

import argparse
import resource
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbench.kv.cut import Cut
from kvbench.model import DType, ModelSpec
from kvbench.p2p.engine import Engine, Handoff, Link
from kvbench.p2p.harness import LoopResult, LoopSettings, Progress, critical_paths
from kvbench.p2p.layout import KVCache, KVSpec, RawBuffer
from kvbench.p2p.transports.base import Transport


@dataclass
class Point:
    """One measured size: a prompt length in tokens (cut as `cut` says: block size, and for
    the page plan K/V pages, block ids and TP pair), or a raw byte count."""

    prompt_tokens: int | None = None
    raw_bytes: int | None = None
    cut: Cut | None = None

    @property
    def label(self) -> str:
        if not self.prompt_tokens:
            return f"{self.raw_bytes} B"
        return f"{self.prompt_tokens} tok" + (f" {self.cut.label}" if self.cut else "")

    def block_size(self, default: int) -> int:
        return self.cut.block_size if self.cut is not None else default


@dataclass
class PatternContext:
    comm: Any  # MPI world communicator
    args: argparse.Namespace
    transport: Transport
    model: ModelSpec
    dtype: DType
    device: str  # the Device's name
    settings: LoopSettings
    progress: Progress
    timeout_s: float
    engine: Engine | None = None
    clock: Any = None  # harness.Clock: every rank's offset onto rank 0's timeline

    @property
    def dev(self):
        return self.engine.device

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


def kv_spec(ctx: PatternContext, point: Point, heads: list[int] | None = None,
            origin: int = 0) -> KVSpec:
    """The KV geometry a rank holds for a token point (all heads unless `heads` is given)."""
    return KVSpec(ctx.model, ctx.dtype, point.prompt_tokens, list(heads or []),
                  ctx.args.layout, point.block_size(ctx.args.block_size), origin=origin)


def make_data(ctx: PatternContext, point: Point, heads: list[int] | None = None,
              table_seed: int = 0, origin: int = 0) -> KVCache | RawBuffer:
    """The KV (or raw buffer) one rank holds for a point; values seeded by the prefill side
    (`origin`: which one, when several send)."""
    where = ctx.dev.torch_device
    if point.raw_bytes is not None:
        return RawBuffer(point.raw_bytes, where, origin=origin)
    spec = kv_spec(ctx, point, heads, origin)
    return KVCache(spec, where, table_seed=table_seed,
                   pack_kernel=getattr(ctx.args, "pack_kernel", "torch"))


def posted_counts(ctx: PatternContext, links: list) -> list[list[int]] | None:
    """Per link (this pattern's list, the same order on every rank), the pieces each handoff
    over it posted to the transport: both ends' own counts added (only the end that moves
    the data counts, kvbench.p2p.transports.base.Channel). Collective; rank 0 gets the lists
    (one entry per handoff the link took part in: cold, warm-up, timed, data check), others None."""
    mine = []
    for k, lk in enumerate(links):
        if lk is not None:
            mine.append((k, list(lk.channel.posted_per_handoff)))
    every = ctx.comm.gather(mine, root=0)
    if ctx.rank != 0:
        return None
    out: list[list[int] | None] = [None] * len(links)
    for rank in every:
        for k, counts in rank:
            have = out[k]
            out[k] = counts if have is None else [a + b for a, b in zip(have, counts, strict=True)]
    return [c or [] for c in out]


def descriptors_of(counts: list[int]) -> dict:
    """`descriptors` of a record: the pieces one handoff over the link posted (the same every
    handoff; if not, the median, and `descriptors_range` says how far they spread)."""
    every = sorted(counts)
    if not every:
        return {"descriptors": None}
    out = {"descriptors": every[len(every) // 2]}
    if every[0] != every[-1]:
        out["descriptors_range"] = [every[0], every[-1]]
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_device_bytes() -> int | None:
    """Peak GPU memory torch allocated in this process (None without CUDA in use): on CUDA the
    KV lives there, and host RSS alone would report the staging and the interpreter."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def per_rank_or_none(values: list | None) -> list | None:
    """A gathered per-rank list, or None when no rank had a value (CPU runs)."""
    return values if values and any(v is not None for v in values) else None


@dataclass(frozen=True)
class SpecEntries:
    """The entries of one record's spec (kvbench.records.schema.p2p.HandoffSpec) that the
    pattern measuring it decides; the run's own (transport, layout, device, hosts, dtype,
    model) come from kvbench.p2p.spec. `block_size`: the point's own (a block-size sweep or a
    cut), taken where the run is paged; None keeps the run's. `compute`, `layer_poll`: a
    pattern's own settings (Pattern.spec_fields)."""

    granularity: str
    prefill_ranks: list[int]
    decode_ranks: list[int]
    variant: str | None = None
    pack_kernel: str | None = None
    block_size: int | None = None
    cut: dict | None = None
    compute: dict | None = None
    layer_poll: bool | None = None


@dataclass
class Measured:
    """One record a pattern measured at a point (rank 0): its timed loop, the record fields
    it writes (in the order written: the .csv's columns follow it), its spec's entries, and a
    line printed under its row of the table (never written)."""

    loop: LoopResult | None
    fields: dict
    spec: SpecEntries
    note: str | None = None

    @property
    def bytes(self) -> int:
        return self.fields["bytes"]


# (loops on rank 0 or None elsewhere, this rank's wrong count (a list when `checked` is one) or
# None) -> what was measured (rank 0; [] elsewhere)
RecordsFn = Callable[[list[LoopResult] | None, int | list[int] | None], list[Measured]]
# (comm, this rank's LocalLoops of the run's handoffs, clock offsets) -> `records`' loops (collective)
ReduceFn = Callable[[Any, list, list[float] | None], Any]


@dataclass
class PointRun:
    """One point of one pattern, set up on every rank and ready to time.

    `handoffs` are timed together in interleaved rounds (their LoopResults come back in the
    same order); `checked` is the handoff whose received data is verified afterwards (a list:
    each is checked, and `records` gets this rank's wrong count of each, in order);
    `records` (collective) turns the loops and the check into what was measured on rank 0.
    `points`: how many points' worth of --seconds-per-point the handoffs share (the matrix
    times each schedule round of a size as a point of its own)."""

    point: Point
    handoffs: list[Handoff]
    checked: Handoff | list[Handoff] | None
    links: list[Link | None]
    records: RecordsFn
    points: int = 1
    reduce: ReduceFn | None = None  # how its stamps become `records`' loops (critical_paths)


def reduce_runs(comm, runs: list[PointRun], local: list, offsets: list[float] | None) -> list:
    """Each run's loops for its `records` (collective): every rank's stamps gathered on rank 0
    and merged per handoff (critical_paths), or the run's own `reduce` (the matrix reduces
    each pair on its receiver, so rank 0 never holds the whole job's stamps)."""
    out, k = [], 0
    if not any(run.reduce for run in runs):
        loops = critical_paths(comm, local, offsets)
        for run in runs:
            out.append(loops[k:k + len(run.handoffs)] if loops else None)
            k += len(run.handoffs)
        return out
    for run in runs:
        part = local[k:k + len(run.handoffs)]
        k += len(run.handoffs)
        out.append((run.reduce or critical_paths)(comm, part, offsets))
    return out


NOT_LINK_COMPUTE = "includes the sender's compute: not a transfer"


class Pattern(ABC):
    """A handoff shape, declared: its pairs of ranks, their roles, the spec entries it adds, and
    per point (`setup`, collective) the links and handoffs the engine runs and how their loops
    become what was measured (one `Measured` per variant, on rank 0)."""

    name: ClassVar[str]
    description: ClassVar[str] = ""

    def __init__(self, ctx: PatternContext):
        self.ctx = ctx

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """This pattern's own flags."""

    @classmethod
    def layout_error(cls, args: argparse.Namespace, world_size: int, model: ModelSpec) -> str | None:
        """Why this world size / TP layout cannot run this pattern, or None."""
        return None if world_size == 2 else (
            f"pattern {cls.name} runs on exactly 2 ranks (prefill rank 0, decode rank 1); "
            f"got {world_size}: use mpirun -n 2")

    def prepare(self, points: list[Point]) -> str | None:
        """Collective set-up before the first point (e.g. calibration); every rank calls it.
        Returns why the run cannot go ahead (the same line on every rank), or None."""
        return None

    def pairs(self) -> list[tuple[int, int]]:
        """Every (src, dst) pair of ranks that exchange data (pre-connected by lazy transports)."""
        return [(0, 1)]

    def roles(self) -> tuple[list[int], list[int]]:
        """(prefill ranks, decode ranks), for the record's spec."""
        return [0], [1]

    def spec_fields(self) -> dict:
        """Spec entries this pattern adds to every record it measures, by SpecEntries' names
        (e.g. layerwise's `compute` and `layer_poll`)."""
        return {}

    def entries(self, granularity: str, *, variant: str | None = None, packed: bool = False,
                block_size: int | None = None, cut: dict | None = None,
                pair: tuple[int, int] | list[int] | None = None) -> SpecEntries:
        """One record's spec entries: its granularity and variant, the pack kernel when the
        messages were packed, the point's block size and cut, the roles (`pair`'s when the
        record names one, else the pattern's), and this pattern's own (spec_fields)."""
        prefill, decode = ([pair[0]], [pair[1]]) if pair else self.roles()
        return SpecEntries(granularity=granularity, prefill_ranks=prefill, decode_ranks=decode,
                           variant=variant, block_size=block_size, cut=cut,
                           pack_kernel=self.ctx.args.pack_kernel if packed else None,
                           **self.spec_fields())

    # Records name their own pair (`pair: [src, dst]`): the spec's roles are that pair's, and
    # each record's transport_info is the pair's own (Transport.info_by_pair).
    per_pair: ClassVar[bool] = False

    @abstractmethod
    def bytes_per_rank(self, point: Point) -> int:
        """Peak bytes one rank allocates for the point (checked before allocating)."""

    @abstractmethod
    def setup(self, point: Point) -> PointRun:
        """Allocate, fill and connect one point (collective); the data is settled on return."""
