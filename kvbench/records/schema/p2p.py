"""A `kvbench.p2p/1` result record, typed (ready for `fit` and `results.load` to adopt).

Fields are today's records (docs/p2p.md) plus the ones docs/contracts.md section 1 adds
(`spec`, `spec_id`, `run_id`, `order`, `sample_rounds`, `fit_as_link`, `not_link_reason`,
`n_samples`), optional so old records stay readable. Only what a consumer computes with is
typed strictly (bytes, samples, tokens, the spec); descriptive fields (env, transport_info,
breakdowns) are kept as they are. `iter_p2p_records` streams a results file one line at a
time, so a 10^6-line file never sits in memory as text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from kvbench.errors import UsageError
from kvbench.records.schema.job import Jobs
from kvbench.records.schema.read import decode_line, iter_lines
from kvbench.records.schema.types import (
    MAX_TEXT,
    Bytes,
    Count,
    ExactInt,
    Finite,
    Open,
    PositiveTokens,
    Text,
    TimeMs,
    Tokens,
    UtcStamp,
    parse,
    parse_line_fast,
    refuse,
    show,
)

SCHEMA_P2P = "kvbench.p2p/1"
Scalar = Annotated[str, Field(max_length=MAX_TEXT)] | bool | ExactInt | Finite | None
Rank = Annotated[int, Field(ge=0, le=2**20)]
# cpu-async: the ordering-test device (CPU memory behind a CUDA-stream-like queue; its times
# mean nothing, docs/p2p.md "Device ordering"); its records are test records, readable all the same
Device = Literal["cpu", "cuda", "cpu-async"]

# Group keys of records written before the spec existed (fit and the readers group by them).
LEGACY_GROUP_KEYS = ("transport", "pattern", "granularity", "layout", "dtype", "device",
                     "world_size", "hosts")
LEGACY_OPTIONAL_KEYS = ("variant", "nixl_op", "nixl_mode", "nixl_prep", "nixl_batch",
                        "nixl_progress_thread", "tp", "prefill_tp", "decode_tp", "block_size")


LAYOUTS = ("contiguous", "paged", "raw")
# the order a record lays out its spec in (kvbench p2p has written it so since the spec existed)
WRITTEN_ORDER = ("transport", "pattern", "granularity", "layout", "device", "world", "hosts",
                 "transport_options", "variant", "block_size", "dtype", "pack_kernel", "model",
                 "compute", "layer_poll", "cut")


def _hosts_required(schema: dict) -> None:
    """The JSON schema of a whole record (what every reader hands on): `hosts` required. Only a
    lean matrix record in a file leaves them out (kvbench.records.schema.job), and readers
    fill them from its job's first record."""
    schema.setdefault("required", []).append("hosts")
    hosts = schema["properties"]["hosts"]
    hosts.pop("default", None)
    lists = [x for x in hosts.pop("anyOf", []) if x.get("type") != "null"]
    hosts.update(lists[0] if lists else {})


class World(Open):
    size: Annotated[int, Field(ge=1, le=2**20)]
    prefill_ranks: list[Rank]
    decode_ranks: list[Rank]


class HandoffSpec(Open):
    """The frozen description of *what* a p2p record measured, apart from the measurement:
    the one spec class, which `kvbench p2p` builds (kvbench.p2p.spec) and every reader
    validates records into (docs/contracts.md section 1).

    Every record carries its spec (as `spec`) and the spec's short hash (`spec_id`). Records
    with the same spec_id are replicates of one configuration and may be merged (the fit's
    group key); records with different ones must never be pooled. So every option that
    changes what is measured belongs here: transport and its options, pattern and variant,
    granularity, layout, block size, dtype, device, pack kernel, the layerwise compute
    settings and polling, the world's roles and hosts, and for the page plan the cut (K/V
    pages, block ids, TP pair: kvbench.kv.cut). The payload size is not in it: it is the x of
    a fit. Not in it, on purpose: how the samples were taken (`order`, iteration counts,
    warm-up), which is recorded beside it and does not change the quantity being estimated.

    Reading is lenient where writing is strict (`build`), so files written before a check
    stay readable. The fields' order is the readers' (a table's spec.* columns); a record
    lays its spec out in WRITTEN_ORDER, as it always has."""

    model_config = ConfigDict(json_schema_extra=_hosts_required)

    transport: Text
    transport_options: dict[str, Scalar] = {}
    pattern: Text
    variant: Text | None = None
    granularity: Text
    layout: Literal["contiguous", "paged", "raw"]
    block_size: PositiveTokens | None = None
    dtype: Text | None = None
    device: Device
    pack_kernel: Text | None = None
    model: Text | None = None
    compute: dict[str, Any] | None = None
    layer_poll: Any = None
    world: World
    # None only in a lean matrix record's spec: its job's first record holds them
    # (kvbench.records.schema.job; P2PRecord refuses a missing one elsewhere)
    hosts: list[Text] | None = None
    cut: dict[str, Scalar] | None = None  # the page plan's cut (absent from older specs)

    @classmethod
    def build(cls, **fields: Any) -> HandoffSpec:
        """The spec a writer makes: its own checks first, each one plain line (one host per
        rank, the world's three keys, scalar transport options), then the contract's."""
        layout = fields.get("layout")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        for k, v in (fields.get("transport_options") or {}).items():
            if not isinstance(v, (str, int, float, bool)) and v is not None:
                raise ValueError(f"transport option {k!r} must be a scalar, got {type(v).__name__}")
        world = fields["world"]
        if set(world) != {"size", "prefill_ranks", "decode_ranks"}:
            raise ValueError(f"world needs size, prefill_ranks, decode_ranks; got {sorted(world)}")
        if len(fields["hosts"]) != world["size"]:
            raise ValueError(f"one host per rank: {len(fields['hosts'])} hosts, {world['size']} ranks")
        return cls(**fields)

    def as_dict(self) -> dict:
        """The spec as a record carries it: every field, `cut` only where there is one (specs
        without a cut keep the ids they always had)."""
        d = self.model_dump()
        if d["cut"] is None:
            del d["cut"]
        return {**{k: d[k] for k in WRITTEN_ORDER if k in d}, **d}

    @property
    def spec_id(self) -> str:
        return spec_id_of(self.as_dict())


def canonical_json(obj: Any) -> str:
    """Sorted keys, no spaces: the text a spec id hashes (and any other content hash)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def spec_id_of(spec: dict) -> str:
    """First 12 hex digits of sha256 over the spec's canonical JSON (docs/contracts.md section 1)."""
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()[:12]


class P2PRecord(Open):
    """One measured point: a payload size under one spec, with every raw sample."""

    model_config = ConfigDict(json_schema_extra=_hosts_required)

    schema_: Literal["kvbench.p2p/1"] = Field(alias="schema")
    transport: Text
    pattern: Text
    variant: Text | None = None
    granularity: Text
    layout: Literal["contiguous", "paged", "raw"]
    dtype: Text | None = None
    device: Device
    model: dict[str, Any] | None = None
    block_size: PositiveTokens | None = None
    world_size: Annotated[int, Field(ge=1, le=2**20)]
    hosts: list[Text] | None = None  # required, but in a lean record (job_in): see _whole
    timestamp: UtcStamp | None = None  # (report turns it into a table's time column)
    prompt_tokens: Tokens | None = None
    bytes: Bytes
    wrong: Count | None = None
    iters: Count
    samples_ms: list[TimeMs]
    cold_ms: TimeMs | None = None
    p50_ms: TimeMs | None = None
    p95_ms: TimeMs | None = None
    p99_ms: TimeMs | None = None
    # docs/contracts.md section 1 (absent from records written before it)
    spec: HandoffSpec | None = None
    spec_id: Annotated[str, Field(pattern=r"^[0-9a-f]{12}$")] | None = None
    run_id: Text | None = None
    order: Literal["rounds", "blocks"] | None = None
    sample_rounds: list[Count] | None = None
    fit_as_link: bool | None = None
    not_link_reason: Text | None = None
    n_samples: Count | None = None
    # pieces one handoff posted to the transport (NIXL transfer-list entries, MPI/Gloo sends,
    # ipc copies), and NIXL's own count after it joined adjacent ones (written as
    # nixl_desc_count before the field had this name: read as the same)
    descriptors: Count | None = None
    descriptors_merged: Count | None = None
    # a lean matrix record: what is per job (hosts, spec.hosts, gpus, env.ranks, its round's
    # pairs) is in its job's first record (kvbench.records.schema.job fills it on reading)
    job_in: Literal["the first record"] | None = None

    @model_validator(mode="after")
    def _counts_agree(self):
        self._legacy_names()
        self._whole()
        self._spec_id_matches()
        n = len(self.samples_ms)
        if self.n_samples is not None and self.n_samples != n:
            raise refuse(f"n_samples is {self.n_samples} but samples_ms holds {n} samples")
        if self.sample_rounds is not None and len(self.sample_rounds) != n:
            raise refuse(f"sample_rounds has {len(self.sample_rounds)} entries for {n} samples_ms")
        return self

    def _legacy_names(self) -> None:
        """nixl_desc_count (descriptors_merged's name before it had one) read as it. Checked
        after validation, not before: a before-validator makes pydantic build every line as
        Python objects first (a quarter of a record's check)."""
        extra = self.__pydantic_extra__
        if (not extra or "nixl_desc_count" not in extra
                or "descriptors_merged" in self.__pydantic_fields_set__):
            return
        try:
            value = _COUNT.validate_python(extra["nixl_desc_count"])
        except ValidationError:
            raise refuse(f"descriptors_merged (written nixl_desc_count): must be a count "
                         f"(an integer >= 0), got {show(extra['nixl_desc_count'])}") from None
        self.__dict__["descriptors_merged"] = value
        self.__pydantic_fields_set__.add("descriptors_merged")

    def _whole(self) -> None:
        """hosts (and spec.hosts) are left out only by a lean record, which names its run."""
        if self.job_in is None:
            if self.hosts is None:
                raise refuse("hosts: required (only a lean matrix record, job_in, leaves them "
                             "to its job's first record)")
            if self.spec is not None and self.spec.hosts is None:
                raise refuse("spec.hosts: required (only a lean matrix record, job_in, leaves "
                             "them to its job's first record)")
        elif self.run_id is None:
            raise refuse("a lean matrix record (job_in) needs the run_id of its job")

    def _spec_id_matches(self) -> None:
        """spec_id must be the hash of spec. Checked after validation (a check before it would
        make pydantic build the whole record as Python objects first: 3x slower), once per
        distinct (spec_id, spec): a file of 10^6 records repeats a few specs."""
        if self.spec is None or self.spec_id is None or self.spec.hosts is None:
            return  # (a lean record's: checked once its job's hosts are in, job.Jobs)
        key = (self.spec_id, self.spec.model_dump_json(exclude_unset=True))
        if key in _CHECKED_SPECS:
            return
        actual = spec_id_of(self.spec.model_dump(exclude_unset=True))
        if actual != self.spec_id:
            raise refuse(f"spec_id {self.spec_id!r} is not the hash of spec ({actual}): the "
                         "record was edited or mixed up")
        if len(_CHECKED_SPECS) >= 4096:
            _CHECKED_SPECS.clear()
        _CHECKED_SPECS.add(key)


_COUNT = TypeAdapter(Count, config=ConfigDict(strict=True))
_CHECKED_SPECS: set[tuple[str, str]] = set()  # (spec_id, the spec as pydantic writes it)


def parse_p2p_record(raw: object, where: str) -> P2PRecord:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a JSON object")
    if raw.get("schema") != SCHEMA_P2P:
        raise UsageError(f"{where}: unknown schema {raw.get('schema')!r} (this kvbench reads {SCHEMA_P2P})")
    return parse(P2PRecord, raw, where)


def parse_p2p_line(raw: bytes, where: str) -> P2PRecord:
    """One line of a results file: pydantic's own JSON parser when that loses no check
    (kvbench.records.schema.types.parse_line_fast), else the careful path that words the message."""
    rec = parse_line_fast(P2PRecord, raw)
    return rec if rec is not None else parse_p2p_record(decode_line(raw, where), where)


def iter_p2p_records(paths: Iterable[str | Path]) -> Iterator[tuple[str, P2PRecord]]:
    """(FILE:LINE, record) for every record of the files, read and checked one line at a time;
    a lean matrix record made whole from its job's first record (kvbench.records.schema.job)."""
    for path in paths:
        jobs = Jobs()
        for where, raw in iter_lines(path, "results file", missing="no such file"):
            yield where, jobs.typed(parse_p2p_line(raw, where), where)
