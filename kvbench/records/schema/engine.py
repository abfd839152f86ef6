"""The side files of the engine-shaped handoff (`kvbench p2p --nixl-engine-profile`), typed.

    --block-ids file:PATH    {"prefill": [ids], "decode": [ids]}: a recorded allocation, each
                             side's block table (distinct ids in 0 .. 2^31 - 1; optional "meta")
    --nixl-poll draw:PATH    an engine's step times in ms: a list of them (each <= 10 s), or a
                             cumulative histogram {"le_ms": [bucket upper bounds, <= 100 s],
                             "count": [cumulative]} (what `kvbench lab agree` writes from
                             vLLM's inter-token histogram, with its "source")

Read like every other input: bounded (file size, depth, integer digits; NaN, Infinity and a
key given twice refused by kvbench.records.schema.read), then checked by the models below, so
a string, a null, a bool, an id out of range, a bucket bound of 10^308 ms or a count that falls
is one line naming the file and the key, before any rank allocates. How large a pool the ids
make is checked against memory where the pool is sized (kvbench.p2p.patterns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError, model_validator

from kvbench.errors import UsageError
from kvbench.records.schema.read import MiB, load_json
from kvbench.records.schema.types import AnyText, Count, Strict, one_line, refuse

MAX_SIDE_FILE_BYTES = 16 * MiB
MAX_BLOCK_ID = 2**31 - 1  # vLLM's block ids are int32
MAX_IDS = 1_000_000  # ids per side: a 10^9-token prompt in blocks of 1,000
MAX_STEP_MS = 10_000.0  # an engine step of 10 s is a stalled engine, not a cadence
MAX_BUCKET_MS = 100_000.0  # a histogram's bounds: vLLM's inter-token histogram ends at 80 s
MAX_STEPS = 1_000_000  # step times in a list, buckets in a histogram

BlockId = Annotated[int, Field(ge=0, le=MAX_BLOCK_ID)]
StepMs = Annotated[float, Field(ge=0, le=MAX_STEP_MS, allow_inf_nan=False)]
BoundMs = Annotated[float, Field(gt=0, le=MAX_BUCKET_MS, allow_inf_nan=False)]


def _distinct(ids: list[int]) -> list[int]:
    first: dict[int, int] = {}
    for i, b in enumerate(ids):
        if b in first:
            raise refuse(f"block id {b} is listed twice (at [{first[b]}] and [{i}]): a block "
                         "table holds each block once")
        first[b] = i
    return ids


BlockIds = Annotated[list[BlockId], Field(min_length=1, max_length=MAX_IDS), AfterValidator(_distinct)]


class BlockIdFile(Strict):
    """Each side's block table, in the order the request uses the blocks."""

    prefill: BlockIds
    decode: BlockIds
    meta: dict[str, Any] | None = None  # free-form: where the allocation was recorded


class PollHistogram(Strict):
    """Cumulative counts of step times at or below each bound (Prometheus' `le` buckets)."""

    le_ms: Annotated[list[BoundMs], Field(min_length=1, max_length=MAX_STEPS)]
    count: Annotated[list[Count], Field(min_length=1, max_length=MAX_STEPS)]
    source: AnyText | None = None  # what was observed (kvbench lab agree names its metric)
    meta: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _cumulative(self):
        if len(self.le_ms) != len(self.count):
            raise refuse(f"le_ms has {len(self.le_ms)} bounds and count {len(self.count)} counts: "
                         "one count per bound")
        for i in range(1, len(self.le_ms)):
            if self.le_ms[i] <= self.le_ms[i - 1]:
                raise refuse(f"le_ms[{i}]: bounds must ascend, got {self.le_ms[i]:g} after "
                             f"{self.le_ms[i - 1]:g}")
            if self.count[i] < self.count[i - 1]:
                raise refuse(f"count[{i}]: cumulative counts never fall, got {self.count[i]} after "
                             f"{self.count[i - 1]}")
        if self.count[-1] <= 0:
            raise refuse("count: no step was counted (the last cumulative count is 0)")
        return self


StepList = Annotated[list[StepMs], Field(min_length=1, max_length=MAX_STEPS)]
_STEPS = TypeAdapter(StepList, config={"strict": True})


def load_block_ids(path: str | Path) -> BlockIdFile:
    """A --block-ids file; any problem is one UsageError line naming the file and key."""
    doc = load_json(path, MAX_SIDE_FILE_BYTES, "block-id file", missing="no such block-id file",
                    regular=True)  # every rank reads it: a FIFO would block them
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected an object with 'prefill' and 'decode' lists of block ids")
    try:
        return BlockIdFile.model_validate(doc)
    except ValidationError as exc:
        raise UsageError(one_line(exc, f"block-id file {path}")) from None


def load_poll_file(path: str | Path) -> list[float] | PollHistogram:
    """An engine profile's poll=draw: file: step times (ms), or a cumulative histogram."""
    doc = load_json(path, MAX_SIDE_FILE_BYTES, "poll file", missing="no such poll file",
                    regular=True)
    try:
        if isinstance(doc, list):
            return [float(v) for v in _STEPS.validate_python(doc)]
        if isinstance(doc, dict):
            return PollHistogram.model_validate(doc)
    except ValidationError as exc:
        raise UsageError(one_line(exc, f"poll file {path}")) from None
    raise UsageError(f"poll file {path}: expected a list of step times in ms, or "
                     '{"le_ms": [...], "count": [...]}')
