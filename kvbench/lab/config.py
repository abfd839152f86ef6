"""The plan's `lab:` section: how to stand up the local deployments and drive their load.

The `slo` plan checker passes `lab:` through unvalidated (CONTRACTS.md section 4);
this module owns its keys, defaults and refusals. Every key is optional:

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

from dataclasses import dataclass, field, fields

from kvbench.lab.tinymodel import TinyModelSpec

PORT_RANGE = (19000, 19999)
PORTS_PER_LAB = 300


class LabConfigError(ValueError):
    """One problem in the `lab:` section, with the dotted path of the field."""


@dataclass(frozen=True)
class Workarounds:
    """The two stack defects worked around in kvbench.lab.connector; each switchable off."""

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


def _int(v, path, lo=None):
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise LabConfigError(f"{path}: must be an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
    return v


def _flag(v, path):
    if not isinstance(v, bool):
        raise LabConfigError(f"{path}: must be true or false, got {v!r}")
    return v


def _mapping(v, path, known):
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise LabConfigError(f"{path}: must be a mapping")
    for key in v:
        if key not in known:
            raise LabConfigError(f"{path}.{key}: unknown key (known: {', '.join(known)})")
    return v


def _ints_of(cls, data: dict, path: str, lo: int = 0):
    """Build a dataclass whose fields are all ints from a mapping (unknown keys refused)."""
    names = [f.name for f in fields(cls)]
    _mapping(data, path, names)
    return cls(**{k: _int(v, f"{path}.{k}", lo) for k, v in data.items()})


def _load(v, path) -> LoadSpec:
    _mapping(v, path, [f.name for f in fields(LoadSpec)])
    kw = {}
    for key, value in v.items():
        if key in ("model", "tokenizer"):
            if not isinstance(value, str) or not value:
                raise LabConfigError(f"{path}.{key}: must be a non-empty string")
            kw[key] = value
        else:
            kw[key] = _int(value, f"{path}.{key}", 0)
    return LoadSpec(**kw)


def _cores(v, path):
    if not isinstance(v, list) or not v or len(set(v)) != len(v):
        raise LabConfigError(f"{path}: must be a non-empty list of distinct core numbers")
    return tuple(_int(c, f"{path}[{i}]", 0) for i, c in enumerate(v))


def _workarounds(v, path) -> Workarounds:
    _mapping(v, path, [f.name for f in fields(Workarounds)])
    out = Workarounds()
    if "nixl_poll_delay_us" in v:
        out = Workarounds(_int(v["nixl_poll_delay_us"], f"{path}.nixl_poll_delay_us", 0),
                          out.keep_model_thread_affinity)
    if "keep_model_thread_affinity" in v:
        out = Workarounds(out.nixl_poll_delay_us,
                          _flag(v["keep_model_thread_affinity"], f"{path}.keep_model_thread_affinity"))
    return out


TOP_KEYS = ("base_port", "cores", "aggregated", "disaggregated", "model", "max_model_len",
            "kv_cache_gib", "kv_load_failure_policy", "kv_lease_s", "workarounds", "load",
            "start_timeout_s")


def parse_lab(data, path: str = "lab") -> LabConfig:
    """Check a decoded `lab:` mapping; raises LabConfigError naming the first bad field."""
    data = _mapping(data, path, TOP_KEYS)
    kw: dict = {}
    if "base_port" in data:
        kw["base_port"] = _int(data["base_port"], f"{path}.base_port", 1)
    if "cores" in data:
        kw["cores"] = _cores(data["cores"], f"{path}.cores")
    agg = _mapping(data.get("aggregated"), f"{path}.aggregated", ["instances"])
    if "instances" in agg:
        kw["aggregated_instances"] = _int(agg["instances"], f"{path}.aggregated.instances", 1)
    dis = _mapping(data.get("disaggregated"), f"{path}.disaggregated", ["prefill", "decode"])
    for role in ("prefill", "decode"):
        if role in dis:
            kw[f"{role}_instances"] = _int(dis[role], f"{path}.disaggregated.{role}", 1)
    if "model" in data:
        kw["model"] = _ints_of(TinyModelSpec, data["model"], f"{path}.model", 1)
    for key in ("max_model_len", "kv_cache_gib", "kv_lease_s"):
        if key in data:
            kw[key] = _int(data[key], f"{path}.{key}", 1)
    if "kv_load_failure_policy" in data:
        if data["kv_load_failure_policy"] not in ("fail", "recompute"):
            raise LabConfigError(f"{path}.kv_load_failure_policy: must be fail or recompute, "
                                 f"got {data['kv_load_failure_policy']!r}")
        kw["kv_load_failure_policy"] = data["kv_load_failure_policy"]
    if "workarounds" in data:
        kw["workarounds"] = _workarounds(data["workarounds"], f"{path}.workarounds")
    if "load" in data:
        kw["load"] = _load(data["load"], f"{path}.load")
    if "start_timeout_s" in data:
        kw["start_timeout_s"] = float(_int(data["start_timeout_s"], f"{path}.start_timeout_s", 1))
    return _check_budget(LabConfig(**kw), path)


def _check_budget(cfg: LabConfig, path: str) -> LabConfig:
    n = len(cfg.cores)
    if cfg.aggregated_instances != n or cfg.prefill_instances + cfg.decode_instances != n:
        raise LabConfigError(
            f"{path}: not an equal core budget: aggregated runs {cfg.aggregated_instances} "
            f"instance(s), disaggregated {cfg.prefill_instances} prefill + {cfg.decode_instances} "
            f"decode, on {n} core(s) each (one instance per core)")
    lo, hi = PORT_RANGE
    if cfg.base_port < lo or cfg.base_port + PORTS_PER_LAB - 1 > hi:
        raise LabConfigError(f"{path}.base_port: the lab uses base_port..base_port+{PORTS_PER_LAB - 1}, "
                             f"which must lie in {lo}-{hi}")
    if cfg.load.output_len < 2:
        raise LabConfigError(f"{path}.load.output_len: must be >= 2 (TPOT needs two tokens)")
    if cfg.load.input_len + cfg.load.output_len > cfg.max_model_len:
        raise LabConfigError(f"{path}.load: input_len + output_len exceeds max_model_len "
                             f"{cfg.max_model_len}")
    return cfg
