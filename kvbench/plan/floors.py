"""Handoff floors, budget verdicts and the routing decision, from fitted (or given) link numbers.

    kvbench plan --fit FITTED.json --model M --prompt-tokens 300,2000,8192 --budget-ms 20
    kvbench plan --gbps 100,25,10 --setup-ms 1 --prompt-tokens 2000
    kvbench plan route --gbps 10 --setup-ms 1 --prompt-tokens 300 \\
        --local-interference-ms 2 --itl-p95-ms 35 --itl-target-ms 50

    KV_bytes           from kvbench.model (geometry x dtype x tokens, scales, blocks)
    bandwidth_floor_ms = KV_bytes / (effective_gb_s x 1e9) x 1000
    handoff_floor_ms   = setup_ms + bandwidth_floor_ms

A fitted rate excludes setup by construction. A rate given with --includes-setup was
measured end to end and already contains it: setup is then never added again.
See docs/fit-and-plan.md for every output field.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvbench.errors import (
    UsageError,
    bounded_float,
    parse_int_pair,
    parse_positive_floats,
)
from kvbench.kv.geometry import (
    KVSizing,
)
from kvbench.plan.route import (
    LinkCost,
)
from kvbench.records.schema.fit import (
    SCHEMA_FIT,
    Draws,
    FitDocument,
    FitGroup,
    Regime,
    SizeRow,
    TwoRegimes,
)
from kvbench.records.schema.matrix import load_fit_or_matrix
from kvbench.records.schema.types import MAX_GBPS, MAX_US_PER_DESC, MIN_GBPS
from kvbench.records.select import matches, min_samples_for, not_link_reason, parse_where
from kvbench.units import round_places

MAX_MS = 1e7  # any time given in ms (setup, budget, interference, ITL): ~3 hours


# ---------------------------------------------------------------------------
# links: from a fit file or from the command line


class PayloadCost(NamedTuple):
    """A link's cost for one payload: the regime's setup and rate, and what qualifies them."""

    cost: LinkCost
    regime: str  # "single", or "small"/"large" of a two-regime fit
    notes: list[str]
    setup_ci95: list | None  # the regime's marginal 95% intervals (a band: FittedLink.band)
    rate_ci95: list | None


@dataclass(frozen=True, eq=False)
class FittedLink:
    """One link the planner computes with: a fitted group of a `kvbench.fit` file (read
    through its contract, FitGroup) or a rate the user gave. Frozen: every plan, route and
    export of one run sees the same numbers."""

    label: str
    source: str  # "fit" or "user"
    effective_gb_s: float
    setup_ms: float | None
    includes_setup: bool = False
    group: dict | None = None
    setup_ci95: list | None = None
    rate_ci95: list | None = None
    sizes: tuple[SizeRow, ...] = ()
    two_regimes: TwoRegimes | None = None
    fit_warnings: tuple[str, ...] = ()
    draws: np.ndarray | None = None  # (B, 2) joint draws of (setup_ms, ms_per_gb) from the fit
    no_band: str | None = None  # why there are no draws
    # the per-descriptor term (a link's cuts fitted together, or --us-per-desc)
    us_per_desc: float | None = None
    us_per_merged_desc: float | None = None  # per descriptor left after the transport joined
    descriptor_field: str | None = None  # the counts the fit used
    desc_draws: np.ndarray | None = None  # (B, 3 or 4): setup, ms/GB, us_per_desc[, merged]
    no_descriptor_term: str | None = None  # why the fit has no us_per_desc
    store_pool_bytes: int | None = None  # a store link's mounted pool (kvbench p2p --pattern store)

    @property
    def shape(self) -> str | None:
        """What the fitted records measured: "engine" (the handoff an engine performs,
        kvbench p2p --nixl-engine-profile) or "link" (a buffer moved as fast as the transport
        allows); None for a rate the user gave."""
        if self.source != "fit":
            return None
        return str((self.group or {}).get("transport_options.shape") or "link")

    def _regime(self, kv_bytes: int) -> tuple[str, Regime | None]:
        tr = self.two_regimes
        if not tr:
            return "single", None
        regime = "large" if kv_bytes >= tr.break_bytes else "small"
        part = getattr(tr, regime)
        return (regime, part) if part.effective_gb_s else ("single", None)

    def for_payload(self, kv_bytes: int) -> PayloadCost:
        """The link cost for this payload: the right regime, setup never negative; with that
        regime's setup and rate intervals (marginal: for a band use `band`)."""
        notes: list[str] = []
        rate, setup = self.effective_gb_s, self.setup_ms
        s_ci, r_ci = self.setup_ci95, self.rate_ci95
        regime, part = self._regime(kv_bytes)
        if part is not None:
            rate, setup = part.effective_gb_s, part.setup_ms
            s_ci, r_ci = part.setup_ms_ci95, part.effective_gb_s_ci95
            notes.append(f"two regimes: used the {regime}-message fit "
                         f"(break near {self.two_regimes.break_bytes:,} B)")
        if setup is not None and setup < 0:
            notes.append(f"fitted setup {setup:.4g} ms is negative; used 0")
            setup = 0.0
        lo, hi = (part.bytes_min, part.bytes_max) if part else (None, None)
        if self.source == "fit" and self.sizes:
            lo = lo if lo is not None else min(r.bytes for r in self.sizes)
            hi = hi if hi is not None else max(r.bytes for r in self.sizes)
            if kv_bytes > hi or kv_bytes < lo:
                notes.append(f"payload outside the measured sizes ({lo:,} .. {hi:,} B): "
                             "extrapolated")
        return PayloadCost(LinkCost(rate, setup, self.includes_setup), regime, notes, s_ci, r_ci)

    def band(self, kv_bytes: int) -> list[float] | None:
        """95% band of the handoff floor at this payload from the fit's joint draws of
        (setup, slope): each draw's floor (its setup used as 0 when negative, like the point
        estimate's), then the 2.5 and 97.5 percentiles. None without draws."""
        _, part = self._regime(kv_bytes)
        draws = _draws(part.draws) if part is not None else self.draws
        if draws is None or not len(draws):
            return None
        floor = np.maximum(draws[:, 0], 0.0) + draws[:, 1] * kv_bytes / 1e9
        lo, hi = np.percentile(floor, [2.5, 97.5])
        return [round_places(float(lo)), round_places(float(hi))]

    def measured(self, kv_bytes: int, descriptors: int | None = None,
                 merged: int | None = None) -> SizeRow | None:
        """The fit's row for exactly this payload (and descriptor counts, when the fit has
        the term): nothing is interpolated."""
        for row in self.sizes:
            if row.bytes == kv_bytes and (
                    descriptors is None or getattr(row, "descriptors", None) == descriptors) and (
                    merged is None or getattr(row, "descriptors_merged", None) == merged):
                return row
        return None


Link = FittedLink  # the name older callers use


def _draws(d: Draws | None) -> np.ndarray | None:
    if d is None or not d.values:
        return None
    arr = np.asarray(d.values, dtype=float)
    return arr[np.all(np.isfinite(arr), axis=1)]


def load_fit(path: str, pair: str | None = None, notes: list[str] | None = None) -> FitDocument:
    """A fit file through its contract (kvbench.records.schema.fit.FitDocument): every field
    plan computes with is finite and of its type, so no NaN, infinity, denormal rate or
    string reaches the arithmetic or the table; any problem is one line naming the key path.
    A kvbench matrix file is read as the fit of one of its pairs: `pair` ("I,J"), or the
    slowest (kvbench.records.schema.matrix.as_fit_document); a note names the pair (printed,
    or kept in `notes` for a caller that prints its notes only once nothing is refused)."""
    doc, note = load_fit_or_matrix(path, pair)
    if note:
        _note(note, notes)
    return doc


def _note(text: str, notes: list[str] | None) -> None:
    if notes is None:
        print(f"kvbench plan: note: {text}", file=sys.stderr)
    else:
        notes.append(text)


def _group_not_link(g: FitGroup) -> str | None:
    """A kvbench.fit/1 file fitted every group; the link rules of kvbench fit apply here too."""
    if g.fit_as_link is False:
        return "not a link"
    return not_link_reason({k: v for k, v in g.group.items() if k != "bytes"})


def _descriptor_term(g: FitGroup) -> dict:
    """A fit group's per-descriptor term for FittedLink (nothing for a group without it)."""
    term = g.descriptor_term
    if term is None:
        return {}
    us, why = g.us_per_desc, None if term.separable else term.reason
    cols = [g.draws.values if g.draws else [], g.us_per_desc_draws or []]
    merged = g.us_per_merged_desc
    if merged is not None:
        cols.append(g.us_per_merged_desc_draws or [])
    both = None
    if us is not None and cols[0] and all(len(c) == len(cols[0]) for c in cols):
        both = np.column_stack([np.asarray(c, dtype=float) for c in cols])
        both = both[np.all(np.isfinite(both), axis=1)]
    return {"us_per_desc": us, "us_per_merged_desc": merged,
            "descriptor_field": g.descriptor_field, "desc_draws": both,
            "no_descriptor_term": why}


def _link_of(g: FitGroup, schema: str) -> FittedLink:
    draws = _draws(g.draws)
    why = None
    if draws is None:
        why = (g.no_interval or "no joint draws") if schema == SCHEMA_FIT else \
            f"{schema} fit file has no joint draws: run kvbench fit again for a band"
    return FittedLink(**_descriptor_term(g),
        label=g.label, source="fit", effective_gb_s=float(g.effective_gb_s),
        setup_ms=float(g.setup_ms or 0.0), group=dict(g.group),
        setup_ci95=g.setup_ms_ci95, rate_ci95=g.effective_gb_s_ci95,
        sizes=tuple(g.sizes), two_regimes=g.two_regimes,
        fit_warnings=tuple(w.code for w in g.warnings), draws=draws, no_band=why,
        store_pool_bytes=g.store_pool_bytes)


def _chosen_groups(doc: FitDocument, path: str, where: dict[str, str]) -> list[FitGroup]:
    groups = doc.groups
    if not groups:
        raise UsageError(f"{path}: the fit holds no groups")
    keys = sorted({k for g in groups for k in g.group})
    unknown = [k for k in where if k not in keys]
    if unknown:
        raise UsageError(f"--where: unknown key {unknown[0]!r}; group keys are {', '.join(keys)}")
    chosen = [g for g in groups if matches(g.group, where)]
    if not chosen:
        raise UsageError(f"no group in {path} matches "
                         f"{' '.join(f'{k}={v}' for k, v in where.items())} (groups: "
                         + "; ".join(g.label for g in groups) + ")")
    return chosen


def pair_flag(text: str | None) -> str | None:
    """--pair through the one integer rule (kvbench.errors.parse_int_pair: ASCII digits, so
    '²,1' is one line naming the flag, not int()'s traceback), as canonical 'I,J' text."""
    if text is None or text.strip() == "slowest":
        return text
    i, j = parse_int_pair(text, "--pair", ",", 0, 10**7 - 1, "'slowest' or two ranks I,J (e.g. 0,3)")
    return f"{i},{j}"


def links_from_fit(path: str, where: dict[str, str], pair: str | None = None,
                   notes: list[str] | None = None) -> list[FittedLink]:
    """Every matching group that is a link with a fitted rate; the rest named in one note.
    A matrix file gives one link: its slowest pair's, or `pair`'s. `notes`: see load_fit."""
    doc = load_fit(path, pair_flag(pair), notes)
    links, skipped = [], [f"[{s.label}] ({s.reason})" for s in doc.skipped
                          if not where or matches(s.group, where)]
    for g in _chosen_groups(doc, path, where):
        rate, why = g.effective_gb_s, _group_not_link(g)
        if why is None and not (rate is not None and rate > 0):
            why = "no fitted rate: " + (", ".join(w.code for w in g.warnings) or "no rate")
        if why:
            skipped.append(f"[{g.label}] ({why})")
            continue
        links.append(_link_of(g, doc.schema_))
    if not links:
        raise UsageError(f"no matching group in {path} is a link with a fitted rate: "
                         f"{'; '.join(skipped)}")
    if skipped:
        _note(f"skipped group(s): {'; '.join(skipped)}", notes)
    return links


def user_links(effective_gb_s: str, setup_ms: str | None, includes_setup: bool,
               us_per_desc: str | None = None) -> list[FittedLink]:
    """Links from the rates the user typed (--gbps, decimal GB/s, comma-separated)."""
    rates = parse_positive_floats(effective_gb_s, "--gbps", MIN_GBPS, MAX_GBPS)
    if includes_setup:
        if setup_ms is not None:
            raise UsageError("--setup-ms with --includes-setup would count setup twice: an "
                             "end-to-end rate already contains it")
        return [FittedLink(f"{r:g} GB/s end to end (includes setup)", "user", r, None, True)
                for r in rates]
    if setup_ms is None:
        raise UsageError("--gbps needs --setup-ms (or --includes-setup for a rate measured "
                         "end to end)")
    setup = bounded_float(setup_ms, "--setup-ms", 0, MAX_MS)
    us = None if us_per_desc is None else bounded_float(us_per_desc, "--us-per-desc", 0,
                                                        MAX_US_PER_DESC)  # as a fit's bound
    term = "" if us is None else f" + {us:g} us per descriptor"
    return [FittedLink(f"{r:g} GB/s + {setup:g} ms setup{term}", "user", r, setup, us_per_desc=us)
            for r in rates]


def resolve_links(args, notes: list[str] | None = None) -> list[FittedLink]:
    """The links to plan with (--fit or --gbps); `notes`: see load_fit."""
    where = parse_where(args.where)
    if args.fit and args.gbps:
        raise UsageError("use either --fit or --gbps, not both")
    if args.fit:
        if args.includes_setup:
            raise UsageError("--includes-setup is for a user-supplied end-to-end rate; a fitted "
                             "rate excludes setup by construction")
        if args.setup_ms is not None:
            raise UsageError("--setup-ms is for --gbps; with --fit the fitted setup is used")
        if getattr(args, "us_per_desc", None) is not None:
            raise UsageError("--us-per-desc is for --gbps; with --fit the fitted term is used")
        return links_from_fit(args.fit, where, getattr(args, "pair", None), notes)
    if where:
        raise UsageError("--where selects groups of a --fit file")
    if getattr(args, "pair", None) is not None:
        raise UsageError("--pair picks a pair of a --fit matrix file (kvbench matrix)")
    if not args.gbps:
        raise UsageError("give the link: --fit FITTED.json, or --gbps R[,R...] with --setup-ms S")
    us = getattr(args, "us_per_desc", None)
    if us is not None and args.includes_setup:
        raise UsageError("--us-per-desc with --includes-setup: an end-to-end rate already "
                         "contains every per-handoff cost")
    return user_links(args.gbps, args.setup_ms, args.includes_setup, us)


# ---------------------------------------------------------------------------
# the floors


def descriptor_term_left_out(link: FittedLink) -> list[str]:
    """A link's per-descriptor term with no cut to count descriptors for: never dropped in
    silence. A term the user typed (--us-per-desc) with no cut is a dead flag: refused. A
    fitted one (a fit over a descriptor sweep, planned at other sizes) gets a note on every
    row that the floor leaves it out, which `kvbench plan export` refuses outright."""
    if link.us_per_desc is None:
        return []
    if link.source == "user":
        raise UsageError(f"--us-per-desc {link.us_per_desc:g} needs the deployment's cut to count "
                         "descriptors: add --block-size (and --kv-pages/--block-ids/--tp-pair if "
                         "not joint, contiguous, 1:1)")
    return [f"per-descriptor term left out: the fit carries {link.us_per_desc:.4g} us per "
            "descriptor and no cut was given (--block-size): this floor is setup and bytes only, "
            "below the fitted model"]


def _descriptor_part(link: FittedLink, sz: KVSizing, budget_ms: float, planned) -> tuple[dict, list[str]]:
    """(row fields, notes) of the per-descriptor term for one prompt, if planned and known."""
    from kvbench.plan.descriptors import descriptor_fields

    if planned is None:
        return {}, descriptor_term_left_out(link)
    if link.us_per_desc is None:
        why = link.no_descriptor_term or ("this link's fit has no per-descriptor term (measure "
                                          "several cuts of it: docs/descriptors.md)")
        return {}, [f"no per-descriptor term: {why}"]
    f = descriptor_fields(link, sz.model, sz.dtype, sz.tokens, planned, budget_ms,
                          (sz.scale_mode, sz.scale_dtype))
    notes = []
    if link.us_per_desc < 0:
        notes.append(f"fitted us_per_desc {link.us_per_desc:.4g} is negative; used 0")
    if f["tp_pair"] != "1:1":
        notes.append(f"TP {f['tp_pair']}: bytes and descriptors of one decode rank")
    group = link.group or {}
    if (group.get("transport") == "nixl" and link.us_per_merged_desc is None
            and f["block_ids"] == "contiguous"):
        notes.append("NIXL joins contiguous ids itself, and this fit did not separate that join "
                     "(measure --block-ids scattered,contiguous): every posted entry is counted")
    return f, notes


def plan_rows(links: list[FittedLink], sizings: list[KVSizing], budget_ms: float,
              planned=None) -> list[dict]:
    """One row per link and prompt; with a planned cut (kvbench.plan.descriptors) on a link
    with the per-descriptor term, the floor includes it and the row names the cut."""
    rows = []
    for link in links:
        for sz in sizings:
            desc, dnotes = _descriptor_part(link, sz, budget_ms, planned)
            kv = desc.get("kv_bytes", sz.kv_bytes)
            cost, regime, notes, _, _ = link.for_payload(kv)  # a PayloadCost
            band = desc["band"] if desc else (link.band(kv) if link.source == "fit" else None)
            if link.source == "fit" and band is None:
                notes = notes + [f"no band: {link.no_band}"]
            notes = notes + dnotes
            bw, floor = cost.handoff_floor(kv)
            floor = desc.get("floor_ms", floor)
            m = link.measured(kv, desc.get("descriptors"), desc.get("descriptors_merged"))
            rows.append({
                "link": link.label,
                "source": link.source,
                "shape": link.shape,
                "group": link.group,
                "prompt_tokens": sz.tokens,
                "kv_bytes": kv,
                "effective_gb_s": cost.effective_gb_s,
                "includes_setup": cost.includes_setup,
                "setup_ms": None if cost.includes_setup else round_places(cost.setup_ms),
                "bandwidth_floor_ms": round_places(bw),
                "handoff_floor_ms": round_places(floor),
                "handoff_floor_ms_band95": band,
                "budget_ms": budget_ms,
                "within_budget": floor <= budget_ms,
                "measured_p50_ms": m.p50_ms if m else None,
                "measured_p99_ms": m.p99_ms if m and m.n >= min_samples_for(0.99) else None,
                "measured_n": m.n if m else None,
                "regime": regime,
                "fit_warnings": list(link.fit_warnings),
                "notes": notes,
                **{k: v for k, v in desc.items() if k not in ("kv_bytes", "floor_ms", "band")},
                **_store_capacity(link, kv),
            })
    return rows


def _store_capacity(link: FittedLink, kv: int) -> dict:
    """A store link's capacity: whole requests of this prompt's KV its mounted pool holds,
    one replica each, before any eviction (nothing for a direct link)."""
    pool = link.store_pool_bytes
    if pool is None:
        return {}
    return {"store_pool_bytes": pool, "store_capacity_requests": pool // kv if kv else None}


def _store_line(r: dict) -> str | None:
    if r.get("store_capacity_requests") is None:
        return None
    return (f"      store holds {r['store_capacity_requests']:,} requests of "
            f"{r['prompt_tokens']} tokens (pool {r['store_pool_bytes'] / 2**30:.4g} GiB)")


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _band_text(band) -> str:
    return "-" if not band else f"{band[0]:.4f}..{band[1]:.4f}"


def _p99_text(r: dict) -> str:
    if r["measured_p99_ms"] is None and r["measured_n"]:
        return f"n<{min_samples_for(0.99)}"
    return _f(r["measured_p99_ms"], ".4f")


def _plan_row_line(r: dict) -> str:
    setup = "in rate" if r["includes_setup"] else _f(r["setup_ms"], ".4f")
    return (f"  {r['prompt_tokens']:>7} {r['kv_bytes']:>15,} {_f(r['effective_gb_s'], '.4g'):>9} "
            f"{setup:>9} {_f(r['bandwidth_floor_ms'], '.4f'):>12} "
            f"{_f(r['handoff_floor_ms'], '.4f'):>11} "
            f"{_band_text(r['handoff_floor_ms_band95']):>19} "
            f"{'ok' if r['within_budget'] else 'OVER':>7} "
            f"{_f(r['measured_p50_ms'], '.4f'):>9} {_p99_text(r):>9} "
            f"{_f(r['measured_n'], 'd'):>5}")


def _descriptor_line(r: dict) -> str | None:
    """Under a row with the per-descriptor term: the count, its time, and what fits the budget."""
    if r.get("descriptors") is None:
        return None
    bs = r["smallest_block_size_within_budget"]
    fits = (f"smallest block size within budget {bs}" if bs is not None else
            "no block size up to 1024 fits the budget")
    merged = (f"merged ids: {r['merged_descriptors']:,} descriptors, "
              f"{r['merged_handoff_floor_ms']:.4f} ms ({'ok' if r['merged_within_budget'] else 'OVER'})")
    joined = ("" if r.get("descriptors_merged") is None else
              f" + {r['descriptors_merged']:,} left after NIXL's join x {r['us_per_merged_desc']:.4g} us")
    return (f"      cut bs {r['block_size']} {r['kv_pages']} {r['block_ids']} tp {r['tp_pair']}: "
            f"{r['descriptors']:,} descriptors x {r['us_per_desc']:.4g} us{joined} = "
            f"{r['descriptor_ms']:.4f} ms in the floor; {fits}; {merged}")


def format_plan_table(doc: dict) -> str:
    """One block per link; a note every row of a link shares is printed once under its header."""
    lines = [f"kvbench plan: {doc['model']} {doc['dtype']}, budget {doc['budget_ms']:g} ms; "
             "handoff_floor_ms = setup_ms + bandwidth_floor_ms (a lower bound); 95% band from "
             "the fit's joint draws"]
    if any(r.get("descriptors") is not None for r in doc["rows"]):
        lines[0] += "; with the per-descriptor term: + descriptors x us_per_desc / 1000"
    by_link: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        by_link.setdefault(r["link"], []).append(r)
    for link, rows in by_link.items():
        common = [n for n in rows[0]["notes"] if all(n in r["notes"] for r in rows)]
        warn = rows[0]["fit_warnings"]
        lines += ["", f"link: {link}" + (f"  [fit warnings: {', '.join(warn)}]" if warn else "")]
        lines += [f"  note: {n}" for n in common]
        lines.append(f"  {'tokens':>7} {'KV bytes':>15} {'GB/s':>9} {'setup ms':>9} "
                     f"{'bw floor ms':>12} {'handoff ms':>11} {'95% band ms':>19} "
                     f"{'budget':>7} {'meas p50':>9} {'meas p99':>9} {'n':>5}")
        for r in rows:
            lines.append(_plan_row_line(r))
            extra = [_descriptor_line(r), _store_line(r)]
            lines += [x for x in extra if x]
            lines += [f"      note: {n}" for n in r["notes"] if n not in common]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI
