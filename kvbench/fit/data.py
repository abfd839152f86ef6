"""From p2p records to fit groups: which records are replicates, which are links, and which
samples share a moment's load.

Group key: the frozen `spec` a record carries (docs/contracts.md section 1: everything that defines
what was measured except the payload size), so no option can be pooled by omission. Records
without a spec (written before it existed) fall back to the legacy keys below.

Not a link (skipped, never fitted): a record that says `fit_as_link: false`, a payload of zero
bytes, and for records without that field the legacy rules: layerwise variants that include the
sender's compute (`compute`, and the overlapped handoff itself), and `sharded` `isolated` (bytes
summed over edges, time a maximum over edges that ran separately: a rate never observed).

Units of resampling: in `order: "rounds"` a unit is one round (run_id, round) with every sample
taken in it; otherwise (blocks order, or a record without `order`) a unit is the whole record,
one back-to-back block of one size. A stratum with more than MAX_UNITS units (a file of many
runs) has its units merged, in the order they were first seen, into MAX_UNITS runs of adjacent
units: a block bootstrap that keeps every dependence the round bootstrap keeps, at a bounded cost.

Reading streams: `read_groups` checks each line against the typed record
(kvbench.records.schema.p2p) and folds it into its group's columns (8 bytes per sample for the time,
its size and its unit), so memory follows the number of samples, not the file's text or one
Python object per record.
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

import numpy as np

from kvbench.errors import UsageError
from kvbench.fit.stats import GroupSamples
from kvbench.links import linkpath
from kvbench.p2p import transports
from kvbench.records.schema.job import Jobs, with_hosts
from kvbench.records.schema.p2p import (
    LEGACY_GROUP_KEYS,
    LEGACY_OPTIONAL_KEYS,
    P2PRecord,
    parse_p2p_line,
    spec_id_of,
)
from kvbench.records.schema.read import decode_line, iter_lines
from kvbench.records.select import LAYERWISE_LINK_VARIANTS, not_link_reason  # noqa: F401 (re-exported)

_OPTIONAL = frozenset(LEGACY_OPTIONAL_KEYS)
MAX_UNITS = 2000  # units per stratum beyond which adjacent units are merged (see above)
_ROUND_BITS = 40  # a rounds unit is (run index << 40) | round; round numbers are < 10^12 < 2^40

spec_id = spec_id_of  # (kept under its old name: tests and fit_sim import it from here)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested mappings as dotted keys ({"world": {"size": 2}} -> {"world.size": 2})."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


LABEL_LIST_ITEMS = 8  # a list longer than this (every host of a big job) is summarised
LABEL_VALUE_CHARS = 200  # one value's text beyond this is cut (the label stays one short line)


def label_of(fields: dict) -> str:
    """'key=value ...' of a group's fields, bounded whatever the world size: a long list
    (hosts of a 1,000-rank job) is summarised as its length, distinct values and ends."""
    parts = []
    for k, v in fields.items():
        if v is None or v == {} or v == []:
            continue
        if isinstance(v, (list, tuple)):
            v = _list_text(v)
        v = str(v)
        if len(v) > LABEL_VALUE_CHARS:
            v = v[:LABEL_VALUE_CHARS - 3] + "..."
        parts.append(f"{k}={v}")
    return " ".join(parts)


# a long list's text by the list's identity: a matrix's million pairs share one job's hosts list
# (kvbench.records.schema.job), whose text took O(N) each time (O(N^3) for the matrix). Held
# with the list (so its id is not reused) and its length; lists read are not changed in place.
_LONG_LISTS: dict[int, tuple] = {}


def _list_text(v: list | tuple) -> str:
    if len(v) <= LABEL_LIST_ITEMS:
        return ",".join(map(str, v))
    got = _LONG_LISTS.get(id(v))
    if got is not None and got[0] is v and len(v) == got[2]:
        return got[1]
    text = _summary_text(v)
    if len(_LONG_LISTS) >= 64:  # (a matrix's pairs share one job's hosts list: one entry)
        _LONG_LISTS.clear()
    _LONG_LISTS[id(v)] = (v, text, len(v))
    return text


def _summary_text(v: list | tuple) -> str:
    # strings (hosts): distinct as themselves, without a json.dumps each (a label per pair of
    # a 1,024-rank matrix named its 1,024 hosts: a million labels, a billion dumps)
    distinct = (len(set(v)) if set(map(type, v)) == {str}
                else len({json.dumps(x, sort_keys=True) for x in v}))
    return f"[{len(v)} values, {distinct} distinct: {v[0]} .. {v[-1]}]"


# ---------------------------------------------------------------------------
# a record, typed or not, as the fold reads it


class _Fields:
    """dict-like read access to a typed record (fields and kept extra keys) without copying it."""

    __slots__ = ("m", "extra")
    _FIELDS = frozenset(P2PRecord.model_fields)

    def __init__(self, m: P2PRecord):
        self.m, self.extra = m, m.model_extra or {}

    def get(self, key: str, default=None):
        if key in self._FIELDS:
            return self.m.__dict__.get(key, default)
        return self.extra.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.m.model_fields_set or key in self.extra


class _SpecsAsWritten:
    """The spec dict of a typed record, with its keys in the file's order (labels and the fit
    file show them in that order): asked once per group (a new spec_id), whose hash the
    schema checked. Read from the spec's own text in the line (a few hundred bytes, not the
    whole line: a matrix has one group per pair) and held to equal the typed spec, else
    from the whole line; a lean record's gets its job's hosts (kvbench.records.schema.job)."""

    SHARED_MAX = 1 << 14  # distinct values held for sharing (a matrix's: its few, and its ranks)

    def __init__(self):
        self._hosts: dict[tuple, list] = {}  # one list per distinct host list, shared
        self._values = Sharing(self.SHARED_MAX)  # (type, repr) -> the first such value read

    def of(self, rec: P2PRecord, raw: bytes, where: str) -> dict:
        lean = rec.job_in is not None
        spec = _spec_text(raw, rec, lean)
        if spec is None:
            spec = decode_line(raw, where)["spec"]
        spec = self._share(spec)
        if lean:
            return with_hosts(spec, rec.hosts)
        hosts = spec.get("hosts")
        if hosts is rec.hosts or hosts == rec.hosts:
            spec["hosts"] = rec.hosts  # (rec.hosts: the job's list where the job was lean)
        if isinstance(hosts, list) and all(type(h) is str for h in hosts):
            # a matrix's pairs share one job's hosts: held once, not once per pair
            spec["hosts"] = self._hosts.setdefault(tuple(hosts), spec["hosts"])
        return spec

    def _share(self, spec: dict, depth: int = 0) -> dict:
        """The spec with equal keys and values of other specs made one object (specs are read,
        never changed in place): a matrix's groups, one a pair, hold specs that differ only in
        the pair, and each would otherwise hold its own copy of the rest, its keys included
        (json's decoder shares keys within one document only): about 2 KB a pair."""
        out = {}
        for k, v in spec.items():
            t = type(v)
            if t is str:
                v = sys.intern(v)
            elif t is dict and depth == 0:  # (the world: its rank lists shared; itself, one
                v = self._share(v, 1)  # a pair, is not kept for sharing)
                v = v if k == "world" else self._one(v)
            elif (t is list or t is dict) and k != "hosts":
                v = self._one(v)
            out[sys.intern(k)] = v
        return out

    def _one(self, v):
        """The first value read equal to v (same type and repr), v itself beyond SHARED_MAX."""
        return self._values.one((type(v), repr(v)), v)


_SPEC_KEY = b'"spec":'
_DECODE = json.JSONDecoder()


def _spec_text(raw: bytes, rec: P2PRecord, lean: bool) -> dict | None:
    """The spec object as the line writes it (key order kept), or None when it cannot be
    shown to be the record's own (then the caller decodes the whole line)."""
    at = raw.find(_SPEC_KEY)
    if at < 0 or raw.find(_SPEC_KEY, at + 1) >= 0:  # (one "spec" key in the line, or unsure)
        return None
    try:
        spec, _ = _DECODE.raw_decode(raw[at + len(_SPEC_KEY):].decode("utf-8").lstrip())
    except (ValueError, UnicodeDecodeError):
        return None
    typed = rec.spec.model_dump(exclude_unset=True)
    if lean:
        typed.pop("hosts", None)
    return spec if isinstance(spec, dict) and spec == typed else None


_SCALARS = frozenset((str, int, float, bool, type(None)))


def _legacy_value(v):
    if isinstance(v, (list, tuple)):
        return tuple(json.dumps(x, sort_keys=True) if isinstance(x, (dict, list)) else x
                     for x in v)
    return json.dumps(v, sort_keys=True) if isinstance(v, dict) else v


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


# ---------------------------------------------------------------------------
# groups

@lru_cache(maxsize=4096, typed=True)
def one_of(value):
    """The first hashable value asked for that is equal to `value` (while among the 4,096 most
    recently asked): a matrix's pairs, a million at N = 1,024, hold a few kinds of path
    (LinkPath) and path sources, each pair's Counters and sets one object, not their own copy."""
    return value


# a size's meta when no record of it names prompt tokens or a model: one shared, read-only
# entry (two empty sets a size a group were a kilobyte a pair of a big matrix)
NO_META = MappingProxyType({"prompt_tokens": frozenset(), "models": frozenset()})


class Sharing:
    """Equal values held once: `one(key, value)` gives the first value given for `key` (while
    fewer than max_keys keys are held; beyond, `value` itself). What it gives is shared, so it is
    read, never changed: a sealed holder copies it before it adds (Group.add)."""

    def __init__(self, max_keys: int = 1 << 12):  # (a matrix's distinct parts: a few a layout)
        self.max_keys = max_keys  # a cap, not a leak
        self._by_key: dict = {}

    def one(self, key, value):
        got = self._by_key.get(key)
        if got is None:
            if len(self._by_key) >= self.max_keys:
                return value
            self._by_key[key] = got = value
        return got


class Sealer:
    """Seals (Group.seal, PairData.seal) what records touched, every EVERY records and at the
    end: a group sealed after each record would copy its columns back at each of its next
    records; sealed in batches, most groups are sealed once, after their last record. What
    waits to be sealed is at most EVERY groups' own copies."""

    EVERY = 8192

    def __init__(self):
        self.sharing = Sharing()
        self._touched: dict[int, object] = {}

    def touched(self, holder) -> None:
        self._touched[id(holder)] = holder
        if len(self._touched) >= self.EVERY:
            self.flush()

    def flush(self) -> None:
        for holder in self._touched.values():
            holder.seal(self.sharing)
        self._touched.clear()


SHARED_MAX_ITEMS = 1 << 12  # a longer part is a group's own (its key alone were 32 KB)


def _frozen(name: str, v):
    """A hashable key of a holder's part, equal for equal parts (None: not shared)."""
    t = type(v)
    if len(v) > SHARED_MAX_ITEMS:
        return None
    if t is array:
        return v.typecode, v.tobytes()
    if t is list:
        return tuple(v)
    if t is set:
        return frozenset(v)
    if name == "meta":  # only when every size's is the shared empty one (a size's own holds sets)
        return tuple(v) if all(m is NO_META for m in v.values()) else None
    if t is dict or t is Counter:
        return tuple(v.items())
    return None


def _own(v):
    """A shared part's own copy, of the same type."""
    return array(v.typecode, v) if type(v) is array else type(v)(v)


class SharedParts:
    """A holder whose parts named in SHARED can be sealed: each made the one object that
    every sealed holder with an equal part holds (a million pairs of a matrix hold one copy
    of their sizes, units and counts). A sealed holder is read-only; whatever adds to it
    calls `unsealed()` first, which gives it its own copies back."""

    __slots__ = ()
    SHARED: tuple[str, ...] = ()

    def seal(self, sharing: Sharing) -> None:
        for name in self.SHARED:
            v = getattr(self, name)
            key = _frozen(name, v)
            if key is not None:
                setattr(self, name, sharing.one((name, type(v), key), v))
        self.sealed = True

    def unsealed(self):
        if self.sealed:
            for name in self.SHARED:
                setattr(self, name, _own(getattr(self, name)))
            self.sealed = False
        return self


@dataclass(slots=True)
class Group(SharedParts):
    """Records measuring one thing (the same spec, or the same legacy key values), folded into
    columns as they are read: every usable sample's size, time and unit of resampling."""

    flat: dict | None  # flat key -> value (labels, --where); None: the spec's, made when asked
    spec: dict | None
    n_records: int = 0
    sources: list[str] = field(default_factory=list)
    not_link: str | None = None  # the first record's reason, when some record is not a link
    error: str | None = None  # a record whose samples cannot be used; raised if it is fitted
    n_wrong: int = 0
    n_empty: int = 0
    orders: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # bytes -> {"prompt_tokens": set, "models": set}
    paths: Counter = field(default_factory=Counter)  # LinkPath -> records (with keep_paths)
    cuts: list[dict] | None = None  # a link's cuts fitted together (merge_cuts), else None
    n_without_desc: int = 0  # records with samples but no `descriptors`
    # a store's mounted pool (store records' `store_pool_bytes`): plan's capacity in requests
    store_pools: set = field(default_factory=set)
    _bytes: array = field(default_factory=lambda: array("q"))
    _ms: array = field(default_factory=lambda: array("d"))
    _unit: array = field(default_factory=lambda: array("q"))  # >= 0 a round, < 0 a block
    _desc: array = field(default_factory=lambda: array("q"))  # descriptors (-1: not recorded)
    _desc_merged: array = field(default_factory=lambda: array("q"))  # the transport's merged count
    _member: array = field(default_factory=lambda: array("q"))  # merged groups: each sample's cut
    _runs: dict = field(default_factory=dict)  # run_id -> index, in first-seen order
    known_spec_id: str | None = None  # the records' spec_id, checked by the reader's schema
    sealed: bool = False  # its parts are shared with other groups' (seal): read-only

    # parts equal between the groups of a matrix (every pair: the same sizes, rounds, counts,
    # source, order, meta, paths): 3.5 of the 5 KB a pair held at N = 32, held once when sealed
    SHARED = ("_bytes", "_unit", "_desc", "_desc_merged", "_member", "_runs", "sources",
              "orders", "meta", "paths", "store_pools")

    @property
    def fields(self) -> dict:
        """The spec flattened ({"world.size": 2, ...}); a spec group's is made when first
        asked (by the fit), not while the records are read: a matrix holds one group per
        ordered pair (a million at N = 1,024) until its fit, their specs differing only in
        the pair."""
        if self.flat is None:
            self.flat = flatten(self.spec)
        return self.flat

    @fields.setter
    def fields(self, value: dict) -> None:
        self.flat = value

    @property
    def label(self) -> str:
        return label_of(self.fields)

    @property
    def spec_id(self) -> str | None:
        """The spec's hash: the records' own where the reader checked it (hashing a big job's
        spec, every host in it, once per pair grows as N^3), else computed."""
        if self.spec is None:
            return None
        if self.known_spec_id is None:
            self.known_spec_id = spec_id_of(self.spec)
        return self.known_spec_id

    def add(self, rec, source: str, keep_paths: bool = False, path=None) -> None:
        """`path`: the record's LinkPath where the caller classified it (once a record)."""
        self.unsealed()
        index = self.n_records
        self.n_records += 1
        if not self.sources or self.sources[-1] != source and source not in self.sources:
            self.sources.append(source)
        why = not_link_reason(rec)
        if why and self.not_link is None:
            self.not_link = why
        if keep_paths:
            self.paths[transports.classify_record(rec) if path is None else path] += 1
        if why or self.error:
            return  # a group with a record that is not a link is skipped whole
        try:
            self._add_samples(rec, index)
        except ValueError as exc:
            self.error = f"{source}: record {index + 1} of group [{self.label}]: {exc}"

    def _add_samples(self, rec, index: int) -> None:
        if rec.get("wrong"):  # a run that received wrong elements measured nothing worth fitting
            self.n_wrong += 1
            return
        # a typed record's bytes and samples were checked by its schema (and bytes 0 is no link)
        nbytes, samples = ((rec.m.bytes, rec.m.samples_ms) if type(rec) is _Fields
                           else samples_of(rec))
        if not samples:
            self.n_empty += 1
            return
        self._ms.extend(samples)
        self._bytes.extend([nbytes] * len(samples))
        self._unit.extend(self._units(rec, index, len(samples)))
        desc, merged = _count(rec.get("descriptors")), _count(rec.get("descriptors_merged",
                                                                      rec.get("nixl_desc_count")))
        self.n_without_desc += desc < 0
        self._desc.extend([desc] * len(samples))
        self._desc_merged.extend([merged] * len(samples))
        order = rec.get("order") or "blocks (no order recorded)"
        if order not in self.orders:
            self.orders.append(order)
        pool = rec.get("store_pool_bytes")
        if isinstance(pool, int) and not isinstance(pool, bool) and pool > 0:
            self.store_pools.add(pool)
        tokens, model = rec.get("prompt_tokens"), rec.get("model")
        name = model.get("name") if isinstance(model, dict) else None
        m = self.meta.get(nbytes)
        if tokens is None and not name:
            if m is None:
                self.meta[nbytes] = NO_META
            return
        if m is None or m is NO_META:
            m = self.meta[nbytes] = {"prompt_tokens": set(), "models": set()}
        if tokens is not None:
            m["prompt_tokens"].add(tokens)
        if name:
            m["models"].add(str(name))

    def _units(self, rec, index: int, n: int) -> list[int]:
        """Per sample: its unit as one integer (a round of a run, or the record's block)."""
        order = rec.get("order")
        if order == "rounds":
            rounds = rec.get("sample_rounds")
            if rounds is None or type(rec) is not _Fields and (  # (typed: counts, one a sample)
                    not isinstance(rounds, list) or len(rounds) != n
                    or not all(isinstance(r, int) and not isinstance(r, bool)
                               and 0 <= r < 1 << _ROUND_BITS for r in rounds)):
                raise ValueError("order 'rounds' needs 'sample_rounds', one round number "
                                 "(int >= 0) per sample")
            rid = rec.get("run_id")
            key = _run_key(rid) if type(rid) in _SCALARS else json.dumps(rid)
            run = self._runs.setdefault(key, len(self._runs))
            return [(run << _ROUND_BITS) | r for r in rounds]
        if order not in (None, "blocks"):
            raise ValueError(f"unknown order {order!r} (expected 'rounds' or 'blocks')")
        return [-(index + 1)] * n

    def collected(self) -> Collected:
        """The group's usable samples with their units; a deferred record error is raised here.
        A link's cuts fitted together (`cuts`) carry each sample's descriptors (what the
        transport was given), and where every record has it and some differ, the count the
        transport was left with after joining adjacent ones (NIXL's descriptors_merged)."""
        if self.error:
            raise UsageError(self.error)
        desc, which = None, None
        if self.cuts is not None and len(self._ms):
            desc = np.frombuffer(self._desc, dtype=np.int64)
            merged = np.frombuffer(self._desc_merged, dtype=np.int64)
            which = "descriptors"
            if np.all(merged >= 0) and np.any(merged != desc):  # the transport joined some
                desc, which = np.column_stack([desc, merged]), "descriptors, descriptors_merged"
        samples = (_group_samples(self._bytes, self._ms, self._unit, desc) if len(self._ms)
                   else None)
        member = np.frombuffer(self._member, dtype=np.int64).copy() if which else None
        return Collected(samples, self.n_wrong, self.n_empty, self.meta, self.sources,
                         self.orders, which, member)


@lru_cache(maxsize=4096, typed=True)
def _run_key(run_id) -> str:
    """A run id's key (its JSON text), made once per distinct id, not once per record."""
    return json.dumps(run_id)


def _count(v) -> int:
    """A record's descriptor count as an int, -1 when it has none."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else -1


# ---------------------------------------------------------------------------
# one link, several cuts: fitted together (the three-term fit)

# spec keys (flattened) that say how the KV was cut, not what link moved it
CUT_KEYS = ("block_size", "cut.kv", "cut.blocks", "cut.tp", "transport_options.kv",
            "transport_options.blocks")


def _link_key(group: Group) -> tuple | None:
    """The spec without its cut, for groups whose every record says how many descriptors it
    posted; None for groups that fit alone (legacy, not a link, no descriptors)."""
    if group.spec is None or group.not_link or group.n_without_desc or not len(group._ms):
        return None
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in group.fields.items()
                        if k not in CUT_KEYS))


def cut_label(fields: dict) -> str:
    """'bs 16 joint scattered tp 2:1' from a spec's cut keys."""
    f = {k.split(".")[-1]: v for k, v in fields.items() if k in CUT_KEYS and v is not None}
    parts = [f"bs {f['block_size']}"] if "block_size" in f else []
    parts += [str(f[k]) for k in ("kv", "blocks") if k in f]
    if f.get("tp") not in (None, "1:1"):
        parts.append(f"tp {f['tp']}")
    return " ".join(parts) or "-"


def merge_cuts(groups: list[Group]) -> list[Group]:
    """Groups of one link that differ only in how the KV was cut (block size, K/V pages,
    block ids, TP pair) and carry descriptors become one group, fitted with the
    per-descriptor term; every other group stays as it is. First-seen order is kept."""
    by_link: dict = {}
    for g in groups:
        key = _link_key(g)
        by_link.setdefault(("alone", id(g)) if key is None else key, []).append(g)
    return [members[0] if len(members) == 1 else _merged(members) for members in by_link.values()]


def _merged(members: list[Group]) -> Group:
    """One group holding every member's samples: a run's rounds stay one unit across cuts
    (they shared that moment's load), blocks stay their record's."""
    first = members[0]
    fields = {k: v for k, v in first.fields.items() if k not in CUT_KEYS}
    out = Group(fields, None, cuts=[])
    offset = 0
    for k, g in enumerate(members):
        out._member.extend([k] * len(g._ms))
        out.cuts.append({"spec_id": g.spec_id, "label": cut_label(g.fields),
                         "n_records": g.n_records,
                         **{k: g.fields[k] for k in CUT_KEYS if k in g.fields}})
        out.n_records += g.n_records
        out.sources += [src for src in g.sources if src not in out.sources]
        out.orders += [o for o in g.orders if o not in out.orders]
        out.n_wrong, out.n_empty = out.n_wrong + g.n_wrong, out.n_empty + g.n_empty
        out.paths.update(g.paths)
        out.store_pools |= g.store_pools
        out.error = out.error or g.error
        for nbytes, m in g.meta.items():
            have = out.meta.setdefault(nbytes, {"prompt_tokens": set(), "models": set()})
            have["prompt_tokens"] |= m["prompt_tokens"]
            have["models"] |= m["models"]
        run_ids = {i: rid for rid, i in g._runs.items()}
        remap = {i: out._runs.setdefault(rid, len(out._runs)) for i, rid in run_ids.items()}
        units = np.frombuffer(g._unit, dtype=np.int64)
        rounds = units >= 0
        new = units.copy()
        if rounds.any():
            runs = units[rounds] >> _ROUND_BITS
            new[rounds] = ((np.vectorize(remap.__getitem__, otypes=[np.int64])(runs) << _ROUND_BITS)
                           | (units[rounds] & ((1 << _ROUND_BITS) - 1)))
        new[~rounds] = units[~rounds] - offset  # -(record index + 1), records numbered on
        offset += g.n_records
        out._unit.extend(new.tolist())
        for a in ("_bytes", "_ms", "_desc", "_desc_merged"):
            getattr(out, a).extend(getattr(g, a))
    return out


def samples_of(rec) -> tuple[int, list[float]]:
    """(bytes, samples_ms) of a record; ValueError says what is wrong (record dicts are not
    typed: a file's records are, by kvbench.records.schema.p2p)."""
    nbytes = rec.get("bytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"'bytes' must be a positive integer, got {nbytes!r}")
    samples = rec.get("samples_ms")
    if not isinstance(samples, list):
        raise ValueError("'samples_ms' must be a list of milliseconds")
    for v in samples:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"'samples_ms' holds {v!r}, not a non-negative time in ms")
    return nbytes, [float(v) for v in samples]


class Grouper:
    """Folds records into groups in first-seen order; `groups()` when all are read."""

    def __init__(self, keep_paths: bool = False, sealer: Sealer | None = None):
        self.keep_paths = keep_paths
        self.sealer = sealer  # groups sealed as they are read (a matrix: one group a pair)
        self._groups: dict[tuple, Group] = {}
        self._legacy_present: set[str] = set()  # optional legacy keys some legacy record has
        self._jobs = Jobs()  # record dicts: lean matrix records made whole (by run_id)
        self._rules = transports.link_rules() if keep_paths else None
        self.n_records = 0

    def add(self, rec, source: str, spec: tuple[str, dict] | None = None) -> None:
        """rec: a record dict, or a typed record (kvbench.records.schema.p2p.P2PRecord) with its
        (spec_id, spec as written) when it has a spec."""
        if isinstance(rec, P2PRecord):
            rec = _Fields(rec)
        elif isinstance(rec.get("spec"), dict) or rec.get("job_in") is not None:
            rec = self._jobs.plain(rec, source)
            if isinstance(rec.get("spec"), dict):
                spec = spec_id_of(rec["spec"]), rec["spec"]
        if spec is not None:
            key = ("spec", spec[0])
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = Group(None, spec[1], known_spec_id=spec[0])
        else:
            group = self._legacy_group(rec)
        group.add(rec, source, self.keep_paths)
        self.n_records += 1

    def add_typed(self, rec: P2PRecord, source: str, spec_of: Callable[[], dict]):
        """A typed record (made whole: kvbench.records.schema.job) into its group; `spec_of()`
        is its spec as written, asked only when its spec_id starts a group. Returns (its group,
        its LinkPath when paths are kept: classified once a record)."""
        fields = _Fields(rec)
        if rec.spec is not None:
            sid = rec.spec_id or spec_id_of(rec.spec.model_dump(exclude_unset=True))
            group = self._groups.get(("spec", sid))
            if group is None:
                spec = spec_of()
                group = self._groups[("spec", sid)] = Group(None, spec, known_spec_id=sid)
        else:
            group = self._legacy_group(fields)
        path = one_of(linkpath.classify_record(fields, self._rules)) if self.keep_paths else None
        group.add(fields, source, self.keep_paths, path)
        if self.sealer is not None:
            self.sealer.touched(group)
        self.n_records += 1
        return group, path

    def _legacy_group(self, rec) -> Group:
        keys = LEGACY_GROUP_KEYS + LEGACY_OPTIONAL_KEYS
        if type(rec) is _Fields:  # (a typed record: its keys and values read without .get)
            self._legacy_present |= _OPTIONAL & (rec.m.__pydantic_fields_set__ | rec.extra.keys())
            d, extra = rec.m.__dict__, rec.extra
            values = [d[k] if k in _Fields._FIELDS else extra.get(k) for k in keys]
        else:
            self._legacy_present.update(k for k in LEGACY_OPTIONAL_KEYS if k in rec)
            values = [rec.get(k) for k in keys]
        key = ("legacy",) + tuple(v if type(v) in _SCALARS else _legacy_value(v) for v in values)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(dict(zip(keys, map(_plain, values), strict=True)),
                                              None)
        return group

    def groups(self) -> list[Group]:
        """Legacy groups keep the optional keys that some legacy record has (labels, --where)."""
        drop = set(LEGACY_OPTIONAL_KEYS) - self._legacy_present
        for g in self._groups.values():
            if g.spec is None:
                g.fields = {k: v for k, v in g.fields.items() if k not in drop}
        return list(self._groups.values())


def group_records(records: Iterable[dict], keep_paths: bool = False) -> list[Group]:
    """Spec groups and legacy groups of record dicts (each may name its file in `_source`)."""
    grouper = Grouper(keep_paths)
    for rec in records:
        grouper.add(rec, str(rec.get("_source", "?")))
    return grouper.groups()


def read_groups(paths: Iterable[str | Path], keep_paths: bool = False,
                each: Callable[[P2PRecord, dict | None, object], None] | None = None,
                sealer: Sealer | None = None) -> tuple[list[Group], int]:
    """Groups of the records in p2p result files, each line checked by the typed record (a
    lean matrix record made whole from its job's first record, kvbench.records.schema.job)
    and folded into its group as it is read; returns (groups, records read). `each(record,
    its group's spec as written or None, its LinkPath or None)` sees every record of the same
    single parse (kvbench matrix). `sealer`: the groups sealed as they are read (Group.seal:
    a matrix's million groups share their equal parts), every one sealed at the end."""
    grouper = Grouper(keep_paths, sealer)
    specs = _SpecsAsWritten()
    for path in paths:
        source, jobs = str(path), Jobs()
        for where, raw in iter_lines(path, "results file", missing="no such file"):
            rec = jobs.typed(parse_p2p_line(raw, where), where)
            group, lp = grouper.add_typed(rec, source, lambda: specs.of(rec, raw, where))  # noqa: B023
            if each is not None:
                each(rec, group.spec, lp)
    if sealer is not None:
        sealer.flush()
    return grouper.groups(), grouper.n_records


def group_not_link(group: Group) -> str | None:
    return group.not_link


def link_mismatch(group: Group, expect: str) -> str | None:
    """The fit's link_mismatch line for a group read with keep_paths (kvbench.links.linkpath)."""
    return linkpath.mismatch_of(group.paths, expect)


# ---------------------------------------------------------------------------
# samples and their units


@dataclass
class Collected:
    samples: GroupSamples | None
    n_wrong: int
    n_empty: int
    meta: dict  # bytes -> {"prompt_tokens": set, "models": set}
    sources: list[str]
    orders: list[str]
    descriptor_field: str | None = None  # the count the three-term fit uses (None: no term)
    member: np.ndarray | None = None  # per sample: the index of its cut in Group.cuts


def collect(group: Group) -> Collected:
    return group.collected()


def _first_seen_ids(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids numbered in order of first appearance, and each id's first position."""
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[inverse.reshape(-1)], first[order]


def _group_samples(b: array, ms: array, unit_code: array,
                   desc: np.ndarray | None = None) -> GroupSamples:
    nbytes = np.frombuffer(b, dtype=np.int64)
    codes = np.frombuffer(unit_code, dtype=np.int64)
    # stratum: all rounds together (-1); the blocks of one size (or point: bytes and
    # descriptors) together
    point = nbytes if desc is None else np.unique(np.column_stack([nbytes, desc]), axis=0,
                                                  return_inverse=True)[1].reshape(-1)
    stratum_code = np.where(codes >= 0, -1, point)
    units, unit_first = _first_seen_ids(codes)
    strata, stratum_first = _first_seen_ids(stratum_code)
    unit_stratum = strata[unit_first]
    kinds = ["rounds" if c < 0 else "blocks" for c in stratum_code[stratum_first]]
    merged = None
    if np.bincount(unit_stratum).max() > MAX_UNITS:
        units, unit_stratum, merged = _merge_units(units, unit_stratum)
    return GroupSamples(nbytes.copy(), np.frombuffer(ms, dtype=np.float64).copy(), units,
                        unit_stratum, kinds, merged, None if desc is None else desc.copy())


def _merge_units(units: np.ndarray, unit_stratum: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """Adjacent units of a stratum with more than MAX_UNITS units merged into MAX_UNITS runs."""
    new_code = np.empty(len(unit_stratum), dtype=np.int64)
    before, after = 0, 0
    for s in range(int(unit_stratum.max()) + 1):
        idx = np.flatnonzero(unit_stratum == s)  # this stratum's units, in first-seen order
        per = math.ceil(len(idx) / MAX_UNITS)
        new_code[idx] = (s << 32) | (np.arange(len(idx)) // per)
        before += len(idx)
        after += math.ceil(len(idx) / per)
    merged_ids, first = _first_seen_ids(new_code[units])
    new_stratum = unit_stratum[units[first]]
    return merged_ids, new_stratum, {"units_read": before, "units_resampled": after,
                                     "max_units_per_stratum": MAX_UNITS}
