"""Every pair of a matrix as a few columns, and the verdict's rules over them.

At N = 1,024 a matrix has 1,047,552 ordered pairs: their typed entries (fit, sizes,
warnings, spec: a few KB each) would be GBs held until the end. What the rules, the
verdict, the heatmap, the Markdown and the CSV read of a pair is a row of numbers and three
names, so a big report keeps that row only (PairTable: ~150 bytes a pair, numpy arrays;
paths, links and no-fit reasons interned) while each pair's whole entry is streamed to the
pairs file. The rules here give the verdicts of kvbench.matrix.analyze's rules on entries
(slow_pairs, odd_paths, link_failures; tests/matrix/test_matrix_stream.py holds them to the
same answers), from sorted arrays and counts instead of per-pair Python work.

A missing number (no rate, no interval end, no wire-up) is NaN in a float column and -1 in
an integer one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ACROSS, WITHIN = "across hosts", "same host"  # (kvbench.matrix.analyze's, which imports us)
FLOATS = ("rate", "rate_lo", "rate_hi", "setup", "setup_lo", "setup_hi", "wireup")
INTS = ("src", "dst", "n_samples", "n_sizes", "bytes_min", "bytes_max", "wrong", "path",
        "link", "kind", "not_fitted")
BOOLS = ("same_host", "has_rate_ci", "has_setup_ci", "fitted")


@dataclass
class PairTable:
    """The pairs in the document's order (sorted by sender, receiver), one array a column."""

    cols: dict[str, np.ndarray]
    paths: list[str] = field(default_factory=list)  # path id -> the transport's words
    links: list[str] = field(default_factory=list)  # link id -> label ("tcp", ...)
    kinds: list = field(default_factory=list)  # kind id -> linkpath.LinkPath (expect_link)
    reasons: list[str] = field(default_factory=list)  # not_fitted id -> why
    findings: dict[int, list[dict]] = field(default_factory=dict)  # row -> [{code, message}]

    def __len__(self) -> int:
        return len(self.cols["src"])

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["cols"][name]
        except KeyError:
            raise AttributeError(name) from None

    def named(self) -> list[int]:
        """The rows with a finding, in order."""
        return sorted(self.findings)

    def value(self, name: str, k: int):
        """One cell as the entry holds it (None for a missing number)."""
        v = self.cols[name][k]
        if name in FLOATS:
            return None if np.isnan(v) else float(v)
        return bool(v) if name in BOOLS else (None if v < 0 else int(v))

    def ci(self, which: str, k: int) -> list | None:
        """An entry's interval: [lo, hi] (either end None), or None when it has none."""
        if not self.cols[f"has_{which}_ci"][k]:
            return None
        return [self.value(f"{which}_lo", k), self.value(f"{which}_hi", k)]

    def index(self) -> dict[tuple[int, int], int]:
        """(sender, receiver) -> row (for the small grids only: a dict of every pair)."""
        return {(int(s), int(r)): k for k, (s, r) in enumerate(zip(self.src, self.dst, strict=True))}


class TableBuilder:
    """Rows filled one pair at a time into preallocated columns (the pair count is known
    before the fits): no Python object per pair is kept."""

    def __init__(self, n_pairs: int):
        self.cols = {**{c: np.full(n_pairs, np.nan) for c in FLOATS},
                     **{c: np.full(n_pairs, -1, dtype=np.int64) for c in INTS},
                     **{c: np.zeros(n_pairs, dtype=bool) for c in BOOLS}}
        self._ids: dict[str, dict] = {"path": {}, "link": {}, "kind": {}, "not_fitted": {}}
        self.findings: dict[int, list[dict]] = {}

    def _id(self, col: str, value) -> int:
        ids = self._ids[col]
        return ids.setdefault(value, len(ids))

    def add(self, k: int, p, kind) -> None:
        """Row k from a typed PairEntry `p` and its LinkPath `kind`."""
        c = self.cols
        c["src"][k], c["dst"][k] = p.pair
        c["same_host"][k] = p.same_host
        for name, v in (("rate", p.effective_gb_s), ("setup", p.setup_ms),
                        ("wireup", p.wireup_ms)):
            if v is not None:
                c[name][k] = v
        for which, ci in (("rate", p.effective_gb_s_ci95), ("setup", p.setup_ms_ci95)):
            if ci is not None:
                c[f"has_{which}_ci"][k] = True
                for end, v in zip(("lo", "hi"), ci, strict=True):
                    if v is not None:
                        c[f"{which}_{end}"][k] = v
        f = p.fit
        c["fitted"][k] = f is not None
        c["n_samples"][k], c["n_sizes"][k] = (f.n_samples, f.n_sizes) if f else (0, 0)
        for name in ("bytes_min", "bytes_max"):
            v = f.model_extra.get(name) if f else None
            if v is not None:
                c[name][k] = v
        if p.wrong_elements is not None:
            c["wrong"][k] = p.wrong_elements
        c["path"][k] = self._id("path", p.path)
        c["link"][k] = self._id("link", p.link)
        c["kind"][k] = self._id("kind", kind)
        if p.not_fitted is not None:
            c["not_fitted"][k] = self._id("not_fitted", p.not_fitted)
        if p.findings:
            self.findings[k] = [f.model_dump() for f in p.findings]

    def table(self) -> PairTable:
        names = {col: list(ids) for col, ids in self._ids.items()}
        return PairTable(self.cols, names["path"], names["link"], names["kind"],
                         names["not_fitted"], dict(self.findings))


def of_doc(doc) -> PairTable:
    """The table of a document's pairs (the inline path: the document holds every pair).
    The link kinds are not in a document: each pair's kind is its link label."""
    b = TableBuilder(len(doc.pairs))
    for k, p in enumerate(doc.pairs):
        b.add(k, p, p.link)
    return b.table()


# ---------------------------------------------------------------------------
# the rules (kvbench.matrix.analyze's module doc), same verdicts as theirs on entries


def _median_without(v: np.ndarray, x: np.ndarray, present: np.ndarray) -> np.ndarray:
    """For each x: the median of sorted v with one copy of x taken out (where `present`;
    elsewhere nothing taken out): analyze.Sorted.median_without, for many x at once."""
    n = len(v) - present.astype(np.int64)
    cut = np.where(present, np.searchsorted(v, np.where(present, x, 0.0), side="left"),
                   len(v) + 1)

    def at(k):
        k = np.clip(k, 0, None)
        return v[np.minimum(k + (k >= cut), len(v) - 1)]

    hi, lo = at(n // 2), at(n // 2 - 1)
    return np.where(n % 2 == 1, hi, (lo + hi) / 2)


def slow_rows(t: PairTable, fraction: float) -> dict[int, str]:
    """{row: why}: analyze.slow_pairs over the columns."""
    from kvbench.matrix.analyze import fmt_ci

    rated = ~np.isnan(t.rate)
    has_low = rated & t.has_rate_ci & ~np.isnan(t.rate_lo)
    rates, lows = np.sort(t.rate[rated]), np.sort(t.rate_lo[has_low])
    cand = np.flatnonzero(rated & t.has_rate_ci & ~np.isnan(t.rate_hi)
                          & (len(lows) - has_low > 0))
    if not len(cand):
        return {}
    rate, own = t.rate[cand], has_low[cand]
    ref_lo = _median_without(lows, t.rate_lo[cand], own)
    ref = _median_without(rates, rate, np.ones(len(cand), dtype=bool))
    hit = (t.rate_hi[cand] < ref_lo) & (rate < fraction * ref)
    out = {}
    for k, r, rl in zip(cand[hit], ref[hit], ref_lo[hit], strict=True):
        v = float(t.rate[k])
        out[int(k)] = (f"{v:.4g} GB/s {fmt_ci(t.ci('rate', k))} is below the other "
                       f"{int(rated.sum()) - 1} pairs beyond the intervals (their median "
                       f"{float(r):.4g} GB/s, median lower end {float(rl):.4g}): "
                       f"{v / float(r):.0%} of their median")
    return out


def majority(t: PairTable) -> dict[str, tuple[int, int, int] | None]:
    """Per kind of pair with any pair: (path id, pairs on it, pairs of the kind) of the path
    more than half took, or None (analyze.majority_paths)."""
    out = {}
    for kind in (ACROSS, WITHIN):
        mask = t.same_host == (kind == WITHIN)
        total = int(mask.sum())
        if total:
            counts = np.bincount(t.path[mask], minlength=len(t.paths))
            top = int(np.argmax(counts))
            out[kind] = (top, int(counts[top]), total) if counts[top] * 2 > total else None
    return out


def odd_rows(t: PairTable, major: dict) -> dict[int, str]:
    """{row: why}: analyze.odd_paths over the columns."""
    out = {}
    for kind, m in major.items():
        if m is None:
            continue
        want, n, total = m
        for k in np.flatnonzero((t.same_host == (kind == WITHIN)) & (t.path != want)):
            out[int(k)] = (f"path {t.paths[t.path[k]]!r} differs from the one {n} of {total} "
                           f"pairs {kind} took: {t.paths[want]!r}")
    return out


def link_rows(t: PairTable, expect: str | None, expect_local: str | None) -> dict[int, str]:
    """{row: why}: analyze.link_failures over the columns (each kind of link judged once)."""
    out = {}
    for local in (False, True):
        want = expect_local if local and expect_local else expect
        if not want:
            continue
        mask = t.same_host == local
        for kid in np.unique(t.kind[mask]):
            lp = t.kinds[kid]
            if not lp.fails(want):
                continue
            emu = ", software emulation" if lp.emulated else ""
            why = lp.explain(want)
            for k in np.flatnonzero(mask & (t.kind == kid)):
                path = t.paths[t.path[k]]
                kv = (f"; the KV's own rows: {lp.evidence!r}" if lp.evidence.startswith(
                    "UCX RMA") and lp.evidence != path else "")
                out[int(k)] = (f"expected the bytes on {want}, the transport's own words say "
                               f"{path!r}{kv} ({t.links[t.link[k]]}{emu})"
                               + (f"; {why}" if why else ""))
    return out


def judge(t: PairTable, slow_fraction: float, expect: str | None, expect_local: str | None
          ) -> dict[str, str | None]:
    """Every row's findings into t.findings (the codes in analyze._findings' order);
    returns the majority paths as the document writes them."""
    major = majority(t)
    rules = {"slow": slow_rows(t, slow_fraction), "path_differs": odd_rows(t, major),
             "expect_link": link_rows(t, expect, expect_local)}
    rows: dict[int, list[dict]] = {}
    for code, found in rules.items():
        for k, why in found.items():
            rows.setdefault(k, []).append({"code": code, "message": why})
    for k in np.flatnonzero(t.wrong > 0):
        rows.setdefault(int(k), []).append({
            "code": "wrong_data", "message": f"{int(t.wrong[k])} wrong elements received in "
            "the data check: the pair measured nothing worth fitting"})
    for k in np.flatnonzero(t.not_fitted >= 0):
        why = t.reasons[t.not_fitted[k]]
        if why:
            rows.setdefault(int(k), []).append({"code": "no_fit", "message": why})
    order = ("slow", "path_differs", "expect_link", "wrong_data", "no_fit")
    t.findings = {k: sorted(v, key=lambda f: order.index(f["code"])) for k, v in rows.items()}
    return {kind: None if m is None else t.paths[m[0]] for kind, m in major.items()}


def verdict_line(t: PairTable, hosts: list[str], n_expected: int, most: int) -> str:
    """analyze.verdict_line over the columns."""
    named = t.named()
    head = f"{len(t)} of {n_expected} ordered pairs measured"
    if not named:
        return head + "; no pair named: no rate below the others beyond the intervals, no odd path"
    parts = [f"[{t.src[k]},{t.dst[k]}] {hosts[t.src[k]]} -> {hosts[t.dst[k]]}: "
             + ", ".join(f["code"] for f in t.findings[k]) for k in named[:most]]
    more = len(named) - most
    tail = f"; and {more} more (the report's pairs)" if more > 0 else ""
    return f"{head}; named {len(named)}: " + "; ".join(parts) + tail


def pairs_file_fields(t: PairTable) -> dict:
    """count, n_fitted and slowest_fitted of records.schema.matrix.PairsFile."""
    fitted = np.flatnonzero(t.fitted & ~np.isnan(t.rate))
    slowest = None
    if len(fitted):
        k = int(fitted[np.argmin(t.rate[fitted])])
        slowest = [int(t.src[k]), int(t.dst[k])]
    return {"count": len(t), "n_fitted": len(fitted), "slowest_fitted": slowest}
