"""The plan's `lab:` section: how to stand up the local deployments and drive their load.

The `slo` plan checker passes `lab:` through unvalidated (docs/contracts.md section 4);
this module owns its keys, defaults and refusals, checked with kvbench.records.schema's strict,
bounded types (pydantic): a wrong type, an unknown key, a value past its bound or an
unfilled `<...>` placeholder is one line naming `lab.PATH`. Every key is optional:

    lab:
      base_port: 19000          # this lab's ports: base .. base+299 (127.0.0.1 only)
      cores: [0, 1]             # the core budget of EACH deployment, one instance per core
      aggregated: {instances: 2}
      disaggregated: {prefill: 1, decode: 1}
      model: {hidden: 256, layers: 4, heads: 4, kv_heads: 2, intermediate: 512, vocab: 4096}
      max_model_len: 1024
      kv_cache_gib: 1
      kv_load_failure_policy: fail        # or recompute (vLLM's KVTransferConfig)
      kv_lease_s: 30                      # NIXL kv_lease_duration on prefill
      workarounds: {nixl_poll_delay_us: 1000, keep_model_thread_affinity: true}
      load: {input_len: 256, output_len: 32, seed: 0}
      start_timeout_s: 240

Equal core budgets are enforced: aggregated.instances == prefill + decode == len(cores).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from kvbench.errors import UsageError
from kvbench.lab.venv.tinymodel import TinyModelSpec
from kvbench.p2p.transports.nixl.binding import MAX_PROGRESS_DELAY_US
from kvbench.records.schema.types import (
    MAX_TOKENS,
    Heads,
    Layers,
    PositiveTokens,
    Strict,
    Text,
    Width,
    parse,
    refuse,
    show,
)
from kvbench.slo.benchplan import PLACEHOLDER

PORT_RANGE = (19000, 19999)
PORTS_PER_LAB = 300


@dataclass(frozen=True)
class Workarounds:
    """The two stack defects worked around in kvbench.lab.venv.connector; each switchable off."""

    nixl_poll_delay_us: int = 1000  # 0 = NIXL's own busy-poll (pthrDelay 0)
    keep_model_thread_affinity: bool = True  # False = let vLLM re-pin to the last core


@dataclass(frozen=True)
class LoadSpec:
    """`vllm bench serve --dataset-name random` settings (one prompt shape for every run).

    model/tokenizer name what the load generator asks for and tokenizes with; for the
    local lab they default to the tiny model (served as "tiny", its own folder).
    """

    input_len: int = 256
    output_len: int = 32
    seed: int = 0
    model: str | None = None
    tokenizer: str | None = None


@dataclass(frozen=True)
class LabConfig:
    base_port: int = 19000
    cores: tuple[int, ...] = (0, 1)
    aggregated_instances: int = 2
    prefill_instances: int = 1
    decode_instances: int = 1
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    max_model_len: int = 1024
    kv_cache_gib: int = 1
    kv_load_failure_policy: str = "fail"
    kv_lease_s: int = 30
    workarounds: Workarounds = field(default_factory=Workarounds)
    load: LoadSpec = field(default_factory=LoadSpec)
    start_timeout_s: float = 240.0

    def port(self, offset: int) -> int:
        if not 0 <= offset < PORTS_PER_LAB:
            raise ValueError(f"port offset {offset} outside the lab's block")
        return self.base_port + offset


# ---------------------------------------------------------------------------
# the `lab:` section as read from a plan: strict, bounded types of kvbench.records.schema. Every
# field defaults to None, so the defaults above stay the only ones: a field the plan sets
# replaces the dataclass default, the rest keep it.

MAX_CORES = 1024
MAX_POLL_DELAY_US = MAX_PROGRESS_DELAY_US  # what kvbench p2p --nixl-progress-delay-us takes
MAX_LEASE_S = 86_400
MAX_START_S = 3_600
Core = Annotated[int, Field(ge=0, le=MAX_CORES - 1)]
Instances = Annotated[int, Field(ge=1, le=MAX_CORES)]
Positive = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


def _filled(text: str) -> str:
    found = PLACEHOLDER.search(text)
    if found:
        raise refuse(f"placeholder {found.group(0)!r} not filled in")
    return text


LabText = Annotated[Text, AfterValidator(_filled)]


def _port_block(base: int) -> int:
    lo, hi = PORT_RANGE
    if base < lo or base + PORTS_PER_LAB - 1 > hi:
        raise refuse(f"the lab uses base_port..base_port+{PORTS_PER_LAB - 1}, which must lie in "
                     f"{lo}-{hi}, got {base}")
    return base


def _distinct(cores: list[int]) -> list[int]:
    if len(set(cores)) != len(cores):
        raise refuse(f"must list distinct core numbers, got {show(cores)}")
    return cores


class _AggregatedIn(Strict):
    instances: Instances | None = None


class _DisaggregatedIn(Strict):
    prefill: Instances | None = None
    decode: Instances | None = None


class _ModelIn(Strict):
    hidden: Width | None = None
    layers: Layers | None = None
    heads: Heads | None = None
    kv_heads: Heads | None = None
    intermediate: Width | None = None
    vocab: Width | None = None
    max_positions: PositiveTokens | None = None
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None


class _WorkaroundsIn(Strict):
    nixl_poll_delay_us: Annotated[int, Field(ge=0, le=MAX_POLL_DELAY_US)] | None = None
    keep_model_thread_affinity: bool | None = None


class _LoadIn(Strict):
    input_len: PositiveTokens | None = None
    output_len: Annotated[int, Field(ge=2, le=MAX_TOKENS)] | None = None  # TPOT needs two tokens
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    model: LabText | None = None
    tokenizer: LabText | None = None


class LabIn(Strict):
    """The `lab:` mapping of a plan, key for key (docs/lab.md section 6)."""

    base_port: Annotated[int, AfterValidator(_port_block)] | None = None
    cores: Annotated[list[Core], Field(min_length=1, max_length=MAX_CORES),
                     AfterValidator(_distinct)] | None = None
    aggregated: _AggregatedIn | None = None
    disaggregated: _DisaggregatedIn | None = None
    model: _ModelIn | None = None
    max_model_len: Positive | None = None
    kv_cache_gib: Annotated[int, Field(ge=1, le=2**20)] | None = None
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None
    kv_lease_s: Annotated[int, Field(ge=1, le=MAX_LEASE_S)] | None = None
    workarounds: _WorkaroundsIn | None = None
    load: _LoadIn | None = None
    start_timeout_s: Annotated[int, Field(ge=1, le=MAX_START_S)] | None = None


def _given(model, cls):
    """cls (a dataclass) with the fields model sets; the rest at the dataclass defaults."""
    return cls(**({} if model is None else model.model_dump(exclude_none=True)))


def parse_lab(data: object, where: str = "plan") -> LabConfig:
    """Check a decoded `lab:` mapping; any problem is one UsageError line naming lab.PATH."""
    m = parse(LabIn, {} if data is None else data, where, prefix="lab")
    kw = {k: v for k, v in m.model_dump(exclude_none=True, include={
        "base_port", "max_model_len", "kv_cache_gib", "kv_load_failure_policy", "kv_lease_s"}).items()}
    if m.cores is not None:
        kw["cores"] = tuple(m.cores)
    if m.aggregated and m.aggregated.instances is not None:
        kw["aggregated_instances"] = m.aggregated.instances
    for role in ("prefill", "decode"):
        value = getattr(m.disaggregated, role) if m.disaggregated else None
        if value is not None:
            kw[f"{role}_instances"] = value
    if m.start_timeout_s is not None:
        kw["start_timeout_s"] = float(m.start_timeout_s)
    cfg = LabConfig(**kw, model=_given(m.model, TinyModelSpec),
                    workarounds=_given(m.workarounds, Workarounds), load=_given(m.load, LoadSpec))
    return _check_budget(cfg, where)


def _check_budget(cfg: LabConfig, where: str) -> LabConfig:
    """What no single field says: equal core budgets, a model geometry that divides, a
    prompt that fits the model."""
    n = len(cfg.cores)
    if cfg.aggregated_instances != n or cfg.prefill_instances + cfg.decode_instances != n:
        raise UsageError(
            f"{where}: lab: not an equal core budget: aggregated runs {cfg.aggregated_instances} "
            f"instance(s), disaggregated {cfg.prefill_instances} prefill + {cfg.decode_instances} "
            f"decode, on {n} core(s) each (one instance per core)")
    m = cfg.model
    if m.hidden % m.heads or m.heads % m.kv_heads:
        raise UsageError(f"{where}: lab.model: hidden ({m.hidden}) must be a multiple of heads ({m.heads}) "
                         f"and heads a multiple of kv_heads ({m.kv_heads})")
    if cfg.load.input_len + cfg.load.output_len > cfg.max_model_len:
        raise UsageError(f"{where}: lab.load: input_len + output_len = "
                         f"{cfg.load.input_len + cfg.load.output_len} exceeds max_model_len {cfg.max_model_len}")
    return cfg
