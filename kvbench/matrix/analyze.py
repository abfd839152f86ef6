"""From a matrix run's records to the matrix document: one fit per ordered pair, each pair's
path in the transport's words, and the verdict that names outliers.

The verdict's rules (every setting is written into the document):

  slow          a pair whose rate's 95% interval lies wholly below the other pairs' (its
                upper end under the median of their lower ends) AND whose rate is below
                `slow_fraction` (default 0.8) of the median of their rates: below the others
                beyond the intervals, and by enough to matter. A pair without an interval is
                not judged (its `no_fit` or warnings say why).
  path_differs  a pair whose path, as the transport named it (devices included), is not the
                majority's among the pairs of its kind: pairs across hosts and pairs within one
                host are compared separately (an NVLink pair inside a node is no outlier among
                network pairs). No path held by more than half of a kind: no majority, and no
                pair of that kind is named by this rule.
  expect_link   a pair whose path cannot be shown to be the kind of link expected
                (`--expect-link`, `--expect-local-link` for pairs within one host), by
                the transport's own link rule (kvbench.p2p.transports.classify_record).
  wrong_data    the pair's receiver counted wrong elements in the data check.
  no_fit        no rate could be fitted (the fit's warning says why).
"""

from __future__ import annotations

import bisect
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbench.errors import UsageError
from kvbench.fit.batch import fit_groups_batched
from kvbench.fit.data import Group, Sealer, SharedParts, one_of, read_groups
from kvbench.fit.fitting import METHOD, draw_rows
from kvbench.links import linkpath
from kvbench.p2p import transports
from kvbench.records.schema.matrix import (
    DRAW_COLUMNS,
    DRAWS_SUFFIX,
    PAIRS_SUFFIX,
    SCHEMA_MATRIX,
    MatrixDocument,
)

DEFAULT_SLOW_FRACTION = 0.8
MAX_NAMED_IN_VERDICT = 20  # the verdict is one line at any N: beyond, a count
ACROSS, WITHIN = "across hosts", "same host"
SPEC_PER_PAIR = ("world", "variant")  # spec keys that differ between the pairs of one matrix


@dataclass(slots=True)
class PairData(SharedParts):
    """What the records say about one pair, gathered before the fit (its counts sealed:
    shared with every pair that counted the same, kvbench.fit.data.SharedParts)."""

    pair: tuple[int, int]
    hosts: tuple[str, str]
    paths: Counter = field(default_factory=Counter)  # transport_info.path -> records
    kinds: Counter = field(default_factory=Counter)  # LinkPath -> records
    sources: frozenset = frozenset()  # transport_info.path_source (shared while empty)
    n_records: int = 0
    wrong: int | None = None
    wireup_ms: float | None = None
    sealed: bool = False

    SHARED = ("paths", "kinds")

    @property
    def same_host(self) -> bool:
        return self.hosts[0] == self.hosts[1]


@dataclass
class Run:
    """The matrix records of the inputs: one configuration, its pairs and their groups."""

    transport: str
    world_size: int
    hosts: list[str]
    schedules: set
    pairs: dict[tuple[int, int], PairData]
    groups: dict[tuple[int, int], Group]
    skipped: int  # records of other patterns, left out


def _matrix_key(spec: dict, hosts_text: dict | None = None) -> str:
    """What the pairs of one matrix share (the spec less its pair), as text. `hosts_text`:
    {id(hosts list): its JSON} of specs alive for the caller's loop, so a job's shared host
    list (kvbench.records.schema.job) is encoded once, not once per pair."""
    if hosts_text is None or not isinstance(spec.get("hosts"), list):
        return json.dumps({k: v for k, v in spec.items() if k not in SPEC_PER_PAIR},
                          sort_keys=True)
    hosts = spec["hosts"]
    text = hosts_text.get(id(hosts))
    if text is None:
        text = hosts_text[id(hosts)] = json.dumps(hosts)
    rest = json.dumps({k: v for k, v in spec.items() if k not in SPEC_PER_PAIR and k != "hosts"},
                      sort_keys=True)
    return f"{rest} hosts {text}"


def _pair_of_spec(spec: dict | None) -> tuple[int, int] | None:
    if not spec or spec.get("pattern") != "matrix":
        return None
    w = spec.get("world") or {}
    src, dst = w.get("prefill_ranks") or [], w.get("decode_ranks") or []
    return (src[0], dst[0]) if len(src) == 1 and len(dst) == 1 else None


def read_run(paths: Sequence[str]) -> Run:
    """The matrix records of the files (others are counted and left out); refuses files that
    hold no matrix, or records of more than one configuration (transport, sizes' kind,
    hosts, ...): a matrix compares pairs measured alike. Each file is parsed once: the
    fit's groups and each pair's paths, data check and wire-up come from the same pass."""
    pairs, schedules, skipped = {}, set(), [0]
    sealer = Sealer()  # (each pair's group and data: their equal parts held once)

    def each(rec, spec: dict | None, path) -> None:
        pair = _pair_of_spec(spec)
        if pair is None:
            skipped[0] += 1
            return
        sealer.touched(_add_record(pairs, pair, rec, spec["hosts"], path))
        schedules.add(((rec.model_extra or {}).get("schedule") or {}).get("name"))

    groups, _ = read_groups(paths, keep_paths=True, each=each, sealer=sealer)
    by_pair, keys, hosts_text = {}, {}, {}
    for g in groups:  # (every g.spec is alive through the loop: hosts_text's ids stay theirs)
        pair = _pair_of_spec(g.spec)
        if pair is not None:
            by_pair[pair] = g
            keys.setdefault(_matrix_key(g.spec, hosts_text), []).append(pair)
    if not by_pair:
        raise UsageError(f"no matrix records in {', '.join(paths)} (records of kvbench matrix, "
                         "pattern matrix)")
    if len(keys) > 1:
        raise UsageError(f"{', '.join(paths)} hold {len(keys)} different matrices (transport, "
                         "layout, dtype, hosts or world differ); give the files of one run")
    spec = next(iter(by_pair.values())).spec
    return Run(spec["transport"], spec["world"]["size"], list(spec["hosts"]), schedules - {None},
               pairs, by_pair, skipped[0])


def _add_record(pairs: dict, pair: tuple[int, int], rec, hosts: list[str], path=None
                ) -> PairData:
    """One record into its pair's data (returned); `path`: its LinkPath, classified once by
    the reader (read_groups) with its record's own facts, else here."""
    extra = rec.model_extra or {}
    d = pairs.get(pair)
    if d is None:
        d = pairs[pair] = PairData(pair, (hosts[pair[0]], hosts[pair[1]]))
    d.unsealed()
    info = extra.get("transport_info") if isinstance(extra.get("transport_info"), dict) else {}
    d.paths[sys.intern(str(info.get("path") or "no path recorded"))] += 1  # (one text, a million pairs)
    d.kinds[path if path is not None else transports.classify_record({
        "transport": rec.transport, "transport_info": info, "device": rec.device,
        "hosts": rec.hosts, "pair": list(pair), "gpus": extra.get("gpus"),
        "env": extra.get("env")})] += 1
    source = info.get("path_source")
    if source and source not in d.sources:  # (a pair's records name one source, most often)
        d.sources = one_of(d.sources | {sys.intern(str(source))})
    d.n_records += 1
    if rec.wrong is not None:
        d.wrong = (d.wrong or 0) + rec.wrong
    w = extra.get("wireup_ms")
    if isinstance(w, (int, float)) and not isinstance(w, bool):
        d.wireup_ms = w if d.wireup_ms is None else min(d.wireup_ms, w)
    return d


# ---------------------------------------------------------------------------
# the fits


def fit_pairs(run: Run, n_boot: int, seed: int, raw_draws: bool = False
              ) -> dict[tuple[int, int], dict]:
    """Each pair's group fitted as kvbench fit fits a group: {pair: fit record, or
    {"not_fitted": why}}; `raw_draws`: each fit's draws left as an array (the draws file)."""
    out = {}
    pairs = sorted(run.groups.items())
    links = [(pair, g) for pair, g in pairs if not g.not_link]
    fits = dict(zip([p for p, _ in links], fit_groups_batched(  # each as fit_group fits it
        [g for _, g in links], n_boot, seed, raw_draws), strict=True))
    for pair, g in pairs:
        if g.not_link:
            out[pair] = {"not_fitted": f"not a link: {g.not_link}"}
            continue
        rec = fits[pair]
        if isinstance(rec, UsageError):  # e.g. every record of the pair received wrong data
            out[pair] = {"not_fitted": str(rec)}
            continue
        if rec["effective_gb_s"] is None:
            codes = [w["message"] for w in rec["warnings"]
                     if w["code"] in ("no_rate", "fewer_than_two_sizes", "excluded_wrong")]
            rec["not_fitted"] = "; ".join(codes) or "no rate fitted"
        out[pair] = rec
    return out


# ---------------------------------------------------------------------------
# the verdict's rules, each on plain per-pair entries (dicts shaped like PairEntry)


def fmt_ci(ci) -> str:
    return "no interval" if not ci else (f"[{ci[0]:.4g}, "
                                         f"{'unbounded' if ci[1] is None else format(ci[1], '.4g')}]")


def slow_pairs(entries: list[dict], fraction: float) -> dict[tuple, str]:
    """{pair: why} for the pairs below the others beyond the intervals (module doc).

    "The others" of a pair are every other rated pair: their medians are read from two
    sorted arrays (all rates; all lower ends) with the pair's own value taken out, so the
    rule costs O(P log P) for P pairs, not a rebuilt list and two medians per pair."""
    rated = [e for e in entries if e.get("effective_gb_s") is not None]
    rates = Sorted(e["effective_gb_s"] for e in rated)
    lows = Sorted(_low(e) for e in rated if _low(e) is not None)
    out = {}
    for e in rated:
        ci = e.get("effective_gb_s_ci95")
        own_low = _low(e)
        n_lows = len(lows) - (own_low is not None)
        if not ci or ci[1] is None or not n_lows:
            continue
        ref_lo = lows.median_without(own_low)
        rate = e["effective_gb_s"]
        ref = rates.median_without(rate)
        if ci[1] < ref_lo and rate < fraction * ref:
            out[tuple(e["pair"])] = (
                f"{rate:.4g} GB/s {fmt_ci(ci)} is below the other {len(rated) - 1} pairs beyond "
                f"the intervals (their median {ref:.4g} GB/s, median lower end {ref_lo:.4g}): "
                f"{rate / ref:.0%} of their median")
    return out


def _low(e: dict) -> float | None:
    ci = e.get("effective_gb_s_ci95")
    return ci[0] if ci and ci[0] is not None else None


class Sorted:
    """Values sorted once; the median of all of them but one (statistics.median's value)."""

    def __init__(self, values):
        self.v = sorted(values)

    def __len__(self) -> int:
        return len(self.v)

    def median_without(self, x: float | None) -> float:
        """The median of the values with one copy of x taken out (x None: none taken out)."""
        n = len(self.v) - (x is not None)
        if x is None:
            return self._at_median(n, lambda k: self.v[k])
        cut = bisect.bisect_left(self.v, x)  # the copy taken out sits at index cut
        return self._at_median(n, lambda k: self.v[k if k < cut else k + 1])

    @staticmethod
    def _at_median(n: int, at) -> float:
        if n % 2:
            return at(n // 2)
        return (at(n // 2 - 1) + at(n // 2)) / 2


def majority_paths(entries: list[dict]) -> dict[str, str | None]:
    """Per kind of pair (across hosts, same host): the path more than half of them took, or
    None when none did (kinds with no pair are left out)."""
    out = {}
    for kind in (ACROSS, WITHIN):
        paths = Counter(e["path"] for e in entries if (e["same_host"]) == (kind == WITHIN))
        if paths:
            path, n = paths.most_common(1)[0]
            out[kind] = path if n * 2 > sum(paths.values()) else None
    return out


def odd_paths(entries: list[dict], majority: dict[str, str | None]) -> dict[tuple, str]:
    out = {}
    for e in entries:
        kind = WITHIN if e["same_host"] else ACROSS
        want = majority.get(kind)
        if want is not None and e["path"] != want:
            n = sum(1 for o in entries if o["same_host"] == e["same_host"] and o["path"] == want)
            total = sum(1 for o in entries if o["same_host"] == e["same_host"])
            out[tuple(e["pair"])] = (f"path {e['path']!r} differs from the one {n} of {total} "
                                     f"pairs {kind} took: {want!r}")
    return out


def link_failures(entries: list[dict], kinds: dict[tuple, linkpath.LinkPath],
                  expect: str | None, expect_local: str | None) -> dict[tuple, str]:
    """Pairs whose KV path is not the expected kind (or is UCX's software emulation), each
    with the causes and fixes its records show (kvbench.links.linkcauses)."""
    out = {}
    for e in entries:
        want = expect_local if e["same_host"] and expect_local else expect
        lp = kinds[tuple(e["pair"])]
        if want and lp.fails(want):
            emu = ", software emulation" if lp.emulated else ""
            why = lp.explain(want)
            kv = (f"; the KV's own rows: {lp.evidence!r}" if lp.evidence.startswith("UCX RMA")
                  and lp.evidence != e["path"] else "")
            out[tuple(e["pair"])] = (f"expected the bytes on {want}, the transport's own words "
                                     f"say {e['path']!r}{kv} ({e['link']}{emu})"
                                     + (f"; {why}" if why else ""))
    return out


# ---------------------------------------------------------------------------
# the document


def _entry(d: PairData, fit: dict) -> dict:
    path, _ = d.paths.most_common(1)[0]
    kinds, _ = d.kinds.most_common(1)[0]
    source = "; ".join(sorted(d.sources)) or None
    if len(d.paths) > 1:  # records of one pair that named different paths (several runs)
        others = ", ".join(f"{p!r} in {n}" for p, n in d.paths.items() if p != path)
        source = f"{source or ''}; other records said {others}".lstrip("; ")
    fitted = "not_fitted" not in fit
    for part in ("group", "spec"):  # every pair's would repeat the document's `hosts`
        v = fit.get(part)
        if isinstance(v, dict) and "hosts" in v:
            v = dict(v)  # (a copy: the spec is its group's own; a C copy, then one key out)
            del v["hosts"]
            fit[part] = v
    e = {"pair": list(d.pair), "sender": {"rank": d.pair[0], "host": d.hosts[0]},
         "receiver": {"rank": d.pair[1], "host": d.hosts[1]}, "same_host": d.same_host,
         "path": path, "link": kinds.label, "path_source": source, "n_records": d.n_records,
         "wrong_elements": d.wrong, "wireup_ms": d.wireup_ms,
         "fit": {k: v for k, v in fit.items() if k != "not_fitted"} if fit.get("sizes") else None,
         "not_fitted": fit.get("not_fitted"), "findings": []}
    for k in ("setup_ms", "setup_ms_ci95", "effective_gb_s", "effective_gb_s_ci95"):
        e[k] = fit.get(k) if fitted else None
    return e


def _findings(entries: list[dict], run: Run, slow_fraction: float, expect: str | None,
              expect_local: str | None) -> dict[str, str | None]:
    """Each entry's findings added in place; returns the majority paths."""
    kinds = {d.pair: d.kinds.most_common(1)[0][0] for d in run.pairs.values()}
    majority = majority_paths(entries)
    rules = {"slow": slow_pairs(entries, slow_fraction),
             "path_differs": odd_paths(entries, majority),
             "expect_link": link_failures(entries, kinds, expect, expect_local)}
    for e in entries:
        key = tuple(e["pair"])
        for code, found in rules.items():
            if key in found:
                e["findings"].append({"code": code, "message": found[key]})
        if e["wrong_elements"]:
            e["findings"].append({"code": "wrong_data", "message": f"{e['wrong_elements']} wrong "
                                  "elements received in the data check: the pair measured "
                                  "nothing worth fitting"})
        if e["not_fitted"]:
            e["findings"].append({"code": "no_fit", "message": e["not_fitted"]})
    return majority


def verdict_line(entries: list[dict], n_expected: int) -> str:
    named = [e for e in entries if e["findings"]]
    head = f"{len(entries)} of {n_expected} ordered pairs measured"
    if not named:
        return head + "; no pair named: no rate below the others beyond the intervals, no odd path"
    parts = [f"[{e['pair'][0]},{e['pair'][1]}] {e['sender']['host']} -> {e['receiver']['host']}: "
             + ", ".join(f["code"] for f in e["findings"]) for e in named[:MAX_NAMED_IN_VERDICT]]
    more = len(named) - MAX_NAMED_IN_VERDICT
    tail = f"; and {more} more (the report's pairs)" if more > 0 else ""
    return f"{head}; named {len(named)}: " + "; ".join(parts) + tail


def take_draws(entries: list[dict]) -> tuple[np.ndarray | None, dict | None]:
    """The pairs' joint draws out of the document, into one (pairs, draws, 2) float64 array
    written beside it (kvbench.records.schema.matrix.DrawsFile): inline they made the
    document grow past its read bound near 100 ranks, and their text was most of its
    writing. Pairs whose draw count differs from the most common one keep theirs inline."""
    counts = Counter(len(e["fit"]["draws"]["values"]) for e in entries
                     if e["fit"] and e["fit"].get("draws") and len(e["fit"]["draws"]["values"]))
    if not counts:
        return None, None
    n = counts.most_common(1)[0][0]
    rows = []
    for e in entries:
        d = e["fit"].get("draws") if e["fit"] else None
        if not d:
            continue
        if len(d["values"]) == n and d.get("columns") == DRAW_COLUMNS:
            e["draws_row"] = len(rows)
            rows.append(d["values"])
            e["fit"]["draws"] = None
        elif isinstance(d["values"], np.ndarray):  # kept inline: written as kvbench fit does
            d["values"] = draw_rows(d["values"])
    arr = np.asarray(rows, dtype=np.float64).reshape(len(rows), n, 2)
    return arr, {"file": "kvbench-matrix" + DRAWS_SUFFIX, "shape": list(arr.shape),
                 "columns": DRAW_COLUMNS, "dtype": "float64"}


def pairs_file_of(entries: list[dict]) -> dict:
    """The pairs file's entry in the document (records.schema.matrix.PairsFile): how many
    pairs, how many fitted, and the slowest fitted one (what plan --pair slowest reads)."""
    fitted = [e for e in entries if e["fit"] is not None and e["effective_gb_s"] is not None]
    slowest = min(fitted, key=lambda e: e["effective_gb_s"])["pair"] if fitted else None
    return {"file": "kvbench-matrix" + PAIRS_SUFFIX, "count": len(entries),
            "n_fitted": len(fitted), "slowest_fitted": slowest}


DRAWS_CHOICES = ("auto", "inline", "file")
MAX_INLINE_DRAW_PAIRS = 240  # auto: draws inline up to 16 ranks' pairs (~6 MB of text)


def analyze(paths: Sequence[str], *, expect_link: str | None = None,
            expect_local_link: str | None = None, slow_fraction: float = DEFAULT_SLOW_FRACTION,
            n_boot: int = 1000, seed: int = 0, draws: str = "inline",
            draws_out: list | None = None, run: Run | None = None) -> MatrixDocument:
    """The matrix document of a run's records (typed: the model checks what is written),
    every pair's entry held (kvbench.matrix.stream writes a big run's report instead).
    `draws`: each pair's draws inline in its fit (as kvbench fit writes a group), in the
    draws file (`file`: the array is appended to `draws_out` for the writer), or `auto`
    (the file beyond MAX_INLINE_DRAW_PAIRS pairs). `run`: the records read already."""
    from kvbench.records.schema.types import parse

    run = run if run is not None else read_run(paths)
    apart = draws == "file" or (draws == "auto" and len(run.pairs) > MAX_INLINE_DRAW_PAIRS)
    fits = fit_pairs(run, n_boot, seed, raw_draws=apart)
    entries = [_entry(run.pairs[p], fits.get(p, {"not_fitted": "no group"}))
               for p in sorted(run.pairs)]
    arr, draws_file = take_draws(entries) if apart else (None, None)
    if draws_out is not None and arr is not None:
        draws_out.append(arr)
    majority = _findings(entries, run, slow_fraction, expect_link, expect_local_link)
    n = run.world_size
    pairs_file = pairs_file_of(entries) if apart and len(entries) > MAX_INLINE_DRAW_PAIRS \
        else None
    doc = {
        **document_head(paths, run, slow_fraction, expect_link, expect_local_link, n_boot, seed),
        "majority_path": majority,
        "pairs": entries,
        "verdict": verdict_line(entries, n * (n - 1)),
        "draws_file": draws_file,
        "pairs_file": pairs_file,
    }
    return parse(MatrixDocument, doc, "the matrix document (kvbench matrix)")


def document_head(paths: Sequence[str], run: Run, slow_fraction: float, expect_link: str | None,
                  expect_local_link: str | None, n_boot: int, seed: int) -> dict:
    """The document's fields that are not its pairs nor their verdict."""
    return {
        "schema": SCHEMA_MATRIX, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": [str(p) for p in paths],
        "transport": run.transport, "world_size": run.world_size, "hosts": run.hosts,
        "schedule": ",".join(sorted(run.schedules)) or None,
        "rules": {"slow": "rate's 95% interval wholly below the median of the other pairs' "
                          "lower ends, and rate below slow_fraction x the median of their rates",
                  "slow_fraction": slow_fraction,
                  "path": "the transport's own words (devices included), compared with the "
                          "majority of the pairs of the same kind (across hosts / same host)",
                  "expect_link": expect_link, "expect_local_link": expect_local_link},
        "fit_method": {**METHOD, "resamples": n_boot, "seed": seed,
                       "per_pair": "one kvbench fit group per ordered pair (its spec names the "
                                   "pair's roles)"},
    }
