"""What every handoff pattern shares: the context it runs in, the data it moves, and the
one-pair handoff protocol (pre-posted receives, barrier, timed sends, completion notice)."""

from __future__ import annotations

import argparse
import resource
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbench.harness import LoopSettings, Notice, Progress, barrier, now, wait_request
from kvbench.layout import KVCache, KVSpec, RawBuffer
from kvbench.messages import MessagePlan
from kvbench.model import DType, ModelSpec
from kvbench.transports.base import Channel, Transport, wait_all


@dataclass
class Point:
    """One measured size: a prompt length in tokens, or a raw byte count."""

    prompt_tokens: int | None = None
    raw_bytes: int | None = None

    @property
    def label(self) -> str:
        return f"{self.prompt_tokens} tok" if self.prompt_tokens else f"{self.raw_bytes} B"


@dataclass
class PatternContext:
    comm: Any  # MPI world communicator
    args: argparse.Namespace
    transport: Transport
    model: ModelSpec
    dtype: DType
    device: str
    settings: LoopSettings
    progress: Progress
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


def kv_spec(ctx: PatternContext, point: Point, heads: list[int] | None = None) -> KVSpec:
    """The KV geometry a rank holds for a token point (all heads unless `heads` is given)."""
    return KVSpec(ctx.model, ctx.dtype, point.prompt_tokens, list(heads or []),
                  ctx.args.layout, ctx.args.block_size)


def make_data(ctx: PatternContext, point: Point, heads: list[int] | None = None,
              table_seed: int = 0) -> KVCache | RawBuffer:
    """The KV (or raw buffer) one rank holds for a point; values seeded by the prefill side."""
    if point.raw_bytes is not None:
        return RawBuffer(point.raw_bytes, ctx.device)
    spec = kv_spec(ctx, point, heads)
    return KVCache(spec, ctx.device, table_seed=table_seed,
                   pack_kernel=getattr(ctx.args, "pack_kernel", "torch"))


def device_sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class PairHandoff:
    """One prefill->decode handoff between two ranks; call it on both of them.

    On the sender it returns the handoff time in ms; on the receiver None. `before_layer`
    (sender only) runs before each layer's messages are posted: the layerwise pattern puts
    real compute there so sends overlap it."""

    def __init__(self, ctx: PatternContext, channel: Channel, plan: MessagePlan, peer: int,
                 is_sender: bool, sync_comm=None,
                 before_layer: Callable[[int], None] | None = None, layers: int = 0):
        self.ctx, self.ch, self.plan, self.peer, self.is_sender = ctx, channel, plan, peer, is_sender
        self.notice = Notice(ctx.comm, peer)
        self.sync_comm = sync_comm if sync_comm is not None else ctx.comm
        self.before_layer = before_layer
        self.layers = layers
        self.posted: list = []

    def __call__(self) -> float | None:
        ctx, ch, plan = self.ctx, self.ch, self.plan
        ch.begin_handoff()
        deadline = now() + ctx.timeout_s
        if not self.is_sender:
            reqs = [ch.post(i) for i in range(plan.n)]
            barrier(self.sync_comm, ctx.timeout_s, "handoff start")
            for i, r in enumerate(reqs):  # in order: the decode side can start per layer
                wait_all([r], deadline, "receive")
                if plan.packed:
                    plan.unpack(i)
            device_sync(ctx.device)
            self.notice.send()
            ch.end_handoff()
            return None
        note = self.notice.post_wait()
        barrier(self.sync_comm, ctx.timeout_s, "handoff start")
        t0 = now()
        reqs = []
        if self.before_layer is None:
            if plan.packed:
                plan.pack()
                device_sync(ctx.device)
            reqs = [ch.post(i) for i in range(plan.n)]
        else:
            self.posted = reqs  # sends posted so far: before_layer may poll them (progress)
            for layer in range(self.layers):
                self.before_layer(layer)
                for i in plan.messages_for_layer(layer):
                    if plan.packed:
                        plan.pack(i)
                    reqs.append(ch.post(i))
        wait_all(reqs, deadline, "send")
        wait_request(note, deadline, "completion notice from the decode rank")
        t1 = now()
        ch.end_handoff()
        return (t1 - t0) * 1e3


class Pattern(ABC):
    """A handoff shape. `run_point` is collective over the world and returns, on rank 0,
    the pattern's record fields for each measured variant of the point."""

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

    @abstractmethod
    def bytes_per_rank(self, point: Point) -> int:
        """Peak bytes one rank allocates for the point (checked before allocating)."""

    @abstractmethod
    def run_point(self, point: Point) -> list[dict]:
        """Measure one point; rank 0 returns record fields (one dict per variant)."""
