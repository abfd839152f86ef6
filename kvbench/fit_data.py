"""From p2p records to fit groups: which records are replicates, which are links, and which
samples share a moment's load.

Group key: the frozen `spec` a record carries (CONTRACTS.md section 1: everything that defines
what was measured except the payload size), so no option can be pooled by omission. Records
without a spec (written before it existed) fall back to the legacy keys below.

Not a link (skipped, never fitted): a record that says `fit_as_link: false`, a payload of zero
bytes, and for records without that field the legacy rules: layerwise variants that include the
sender's compute (`compute`, and the overlapped handoff itself), and `sharded` `isolated` (bytes
summed over edges, time a maximum over edges that ran separately: a rate never observed).

Units of resampling: in `order: "rounds"` a unit is one round (run_id, round) with every sample
taken in it; otherwise (blocks order, or a record without `order`) a unit is the whole record,
one back-to-back block of one size.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from kvbench.cli import UsageError
from kvbench.fit_stats import GroupSamples

LEGACY_GROUP_KEYS = ("transport", "pattern", "granularity", "layout", "dtype", "device",
                     "world_size", "hosts")
LEGACY_OPTIONAL_KEYS = ("variant", "nixl_op", "nixl_mode", "nixl_prep", "nixl_batch",
                        "nixl_progress_thread", "tp", "prefill_tp", "decode_tp", "block_size")
LAYERWISE_LINK_VARIANTS = ("xfer", "seq")  # pure transfers measured inside a layerwise run


def spec_id(spec: dict) -> str:
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested mappings as dotted keys ({"world": {"size": 2}} -> {"world.size": 2})."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def label_of(fields: dict) -> str:
    parts = []
    for k, v in fields.items():
        if v is None or v == {} or v == []:
            continue
        if isinstance(v, (list, tuple)):
            v = ",".join(map(str, v))
        parts.append(f"{k}={v}")
    return " ".join(parts)


@dataclass
class Group:
    """Records measuring one thing: the same spec, or the same legacy key values."""

    fields: dict  # flat key -> value: labels and --where
    spec: dict | None
    records: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        return label_of(self.fields)

    @property
    def spec_id(self) -> str | None:
        return None if self.spec is None else spec_id(self.spec)


def _legacy_value(rec: dict, key: str):
    v = rec.get(key)
    if isinstance(v, list):
        return tuple(json.dumps(x, sort_keys=True) if isinstance(x, (dict, list)) else x
                     for x in v)
    return json.dumps(v, sort_keys=True) if isinstance(v, dict) else v


def group_records(records: list[dict]) -> list[Group]:
    """Spec groups (keyed by the canonical spec) and legacy groups, in first-seen order."""
    legacy = [r for r in records if not isinstance(r.get("spec"), dict)]
    keys = list(LEGACY_GROUP_KEYS) + [k for k in LEGACY_OPTIONAL_KEYS
                                      if any(k in r for r in legacy)]
    groups: dict[tuple, Group] = {}
    for rec in records:
        spec = rec.get("spec")
        if isinstance(spec, dict):
            key = ("spec", json.dumps(spec, sort_keys=True, separators=(",", ":")))
            make = lambda spec=spec: Group(flatten(spec), spec)  # noqa: E731
        else:
            key = ("legacy",) + tuple(_legacy_value(rec, k) for k in keys)
            make = lambda rec=rec: Group({k: _plain(rec.get(k)) for k in keys}, None)  # noqa: E731
        groups.setdefault(key, make()).records.append(rec)
    return list(groups.values())


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def not_link_reason(rec: dict) -> str | None:
    """Why a record's time is not bytes over a link, or None when it is a link."""
    if rec.get("bytes") == 0:
        return "zero bytes (compute only)"
    if "fit_as_link" in rec:
        if rec["fit_as_link"] is False:
            return str(rec.get("not_link_reason") or "declared not a link by its pattern")
        return None
    pattern, variant = rec.get("pattern"), rec.get("variant")
    if pattern == "layerwise" and variant not in LAYERWISE_LINK_VARIANTS:
        what = "overlapped handoff" if variant is None else f"variant '{variant}'"
        return f"layerwise {what} includes the sender's compute"
    if pattern == "sharded" and variant == "isolated":
        return ("sharded isolated: bytes summed over edges, time a maximum over edges run "
                "separately (a rate never observed)")
    return None


def group_not_link(group: Group) -> str | None:
    for rec in group.records:
        why = not_link_reason(rec)
        if why:
            return why
    return None


# ---------------------------------------------------------------------------
# samples and their units


def samples_of(rec: dict, where: str) -> tuple[int, list[float]]:
    nbytes = rec.get("bytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise UsageError(f"{where}: 'bytes' must be a positive integer, got {nbytes!r}")
    samples = rec.get("samples_ms")
    if not isinstance(samples, list):
        raise UsageError(f"{where}: 'samples_ms' must be a list of milliseconds")
    out = []
    for v in samples:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UsageError(f"{where}: 'samples_ms' holds {v!r}, not a non-negative time in ms")
        out.append(float(v))
    return nbytes, out


def unit_keys(rec: dict, index: int, n: int, where: str) -> tuple[list[tuple], list[tuple]]:
    """Per sample: the unit key and the stratum key it is resampled in."""
    order = rec.get("order")
    if order == "rounds":
        rounds = rec.get("sample_rounds")
        if (not isinstance(rounds, list) or len(rounds) != n
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                           for r in rounds)):
            raise UsageError(f"{where}: order 'rounds' needs 'sample_rounds', one round number "
                             "(int >= 0) per sample")
        run = json.dumps(rec.get("run_id"))
        return [("round", run, r) for r in rounds], [("rounds",)] * n
    if order not in (None, "blocks"):
        raise UsageError(f"{where}: unknown order {order!r} (expected 'rounds' or 'blocks')")
    return [("block", index)] * n, [("blocks", rec["bytes"])] * n


@dataclass
class Collected:
    samples: GroupSamples | None
    n_wrong: int
    n_empty: int
    meta: dict  # bytes -> {"prompt_tokens": set, "models": set}
    sources: list[str]
    orders: list[str]


def collect(group: Group) -> Collected:
    """The group's usable samples with their units; records with wrong bytes are left out."""
    b, ms, ukeys, skeys = [], [], [], []
    out = Collected(None, 0, 0, {}, [], [])
    for i, rec in enumerate(group.records):
        src = rec.get("_source", "?")
        if src not in out.sources:
            out.sources.append(src)
        if rec.get("wrong"):  # a run that received wrong elements measured nothing worth fitting
            out.n_wrong += 1
            continue
        where = f"{src}: record {i + 1} of group [{group.label}]"
        nbytes, samples = samples_of(rec, where)
        if not samples:
            out.n_empty += 1
            continue
        u, s = unit_keys(rec, i, len(samples), where)
        order = rec.get("order") or "blocks (no order recorded)"
        if order not in out.orders:
            out.orders.append(order)
        b += [nbytes] * len(samples)
        ms += samples
        ukeys += u
        skeys += s
        _note_meta(out.meta, nbytes, rec)
    if ms:
        out.samples = _group_samples(b, ms, ukeys, skeys)
    return out


def _note_meta(meta: dict, nbytes: int, rec: dict) -> None:
    m = meta.setdefault(nbytes, {"prompt_tokens": set(), "models": set()})
    if rec.get("prompt_tokens") is not None:
        m["prompt_tokens"].add(rec["prompt_tokens"])
    model = rec.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if name:
        m["models"].add(str(name))


def _group_samples(b, ms, ukeys, skeys) -> GroupSamples:
    unit_index: dict[tuple, int] = {}
    stratum_index: dict[tuple, int] = {}
    unit_stratum: list[int] = []
    units = []
    for uk, sk in zip(ukeys, skeys, strict=True):
        s = stratum_index.setdefault(sk, len(stratum_index))
        if uk not in unit_index:
            unit_index[uk] = len(unit_index)
            unit_stratum.append(s)
        units.append(unit_index[uk])
    kinds = [sk[0] for sk in stratum_index]
    return GroupSamples(np.array(b, dtype=np.int64), np.array(ms, dtype=float),
                        np.array(units), np.array(unit_stratum), kinds)
