"""The matrix document as people read it: a heatmap (PNG), a Markdown report and a CSV table.

Every figure here is read from the document (kvbench.records.schema.matrix); nothing is
recomputed. GB/s are decimal (1e9 bytes per second), times in ms.
"""

from __future__ import annotations

import csv
import io

from kvbench.matrix.table import PairTable, of_doc
from kvbench.records.schema.matrix import MatrixDocument, PairEntry

SUFFIXES = (".json", ".png", ".md", ".csv")  # the report's files (kvbench matrix writes them)
CODES = {"slow": "SLOW", "path_differs": "PATH", "expect_link": "LINK", "wrong_data": "DATA",
         "no_fit": "NO FIT"}
MAX_ANNOTATED = 16  # ranks beyond which the heatmap's cells carry no text
MAX_GRID = 16  # ranks beyond which the Markdown has a per-node summary, not an N-column grid
MAX_PAIR_ROWS = 240  # pairs beyond which the Markdown lists the named ones only (all: the CSV)
MAX_LISTED = 100  # named pairs listed in the Markdown and beside the heatmap
MAX_CELLS = 64  # ranks beyond which the heatmap shows nodes (when there are fewer nodes)


def _num(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def _ci(ci) -> str:
    if not ci:
        return "-"
    return f"[{_num(ci[0])}, {'unbounded' if ci[1] is None else _num(ci[1])}]"


def _rank(doc: MatrixDocument, r: int) -> str:
    return f"{r} ({doc.hosts[r]})"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _codes(p: PairEntry) -> str:
    return ", ".join(CODES[f.code] for f in p.findings)


def _row_codes(t: PairTable, k: int) -> str:
    return ", ".join(CODES[f["code"]] for f in t.findings.get(k, ()))


def _table(doc: MatrixDocument, t: PairTable | None) -> PairTable:
    """Every pair's row: the one given (a streamed report's), or the document's pairs'."""
    return t if t is not None else of_doc(doc)


def markdown(doc: MatrixDocument, t: PairTable | None = None) -> str:
    """The findings first (verdict, each named pair's finding in a sentence), then the
    rules, then the grid (a per-node summary beyond MAX_GRID ranks) and the pairs (the named
    ones only beyond MAX_PAIR_ROWS: every pair is in the CSV). `t`: every pair's row (a
    streamed report's document holds the named pairs only)."""
    t = _table(doc, t)
    n = doc.world_size
    lines = [f"# kvbench matrix: {doc.transport}, {n} ranks on {len(set(doc.hosts))} host(s)", "",
             f"**Verdict:** {_md(doc.verdict)}", ""]
    named = t.named()
    for k in named[:MAX_LISTED]:
        for f in t.findings[k]:
            lines.append(f"- **{CODES[f['code']]}** [{t.src[k]},{t.dst[k]}] "
                         f"{doc.hosts[t.src[k]]} -> {doc.hosts[t.dst[k]]}: {_md(f['message'])}")
    if len(named) > MAX_LISTED:
        lines.append(f"- ... and {len(named) - MAX_LISTED} more named pairs: the CSV's "
                     "`findings` column")
    lines += ["" if named else "- no pair named", f"- {rates_line(doc, t)}"]
    for kind, path in doc.majority_path.items():
        lines.append(f"- majority path {kind}: " + (f"`{_md(path)}`" if path else
                                                     "none (no path held by more than half)"))
    lines += [f"- schedule: {doc.schedule or 'unknown'}; rules: slow = {doc.rules.slow} "
              f"(slow_fraction {doc.rules.slow_fraction:g}); expected link: "
              f"{doc.rules.expect_link or 'not given'}"
              + (f", within a host {doc.rules.expect_local_link}" if doc.rules.expect_local_link
                 else "")]
    lines += _grid(doc, t) if n <= MAX_GRID else _node_summary(doc, t)
    lines += _pair_table(doc, t, range(len(t)) if len(t) <= MAX_PAIR_ROWS else named)
    lines += ["", "GB/s = 1e9 bytes/s; each pair fitted as `kvbench fit` fits a group "
              f"(time_ms = setup_ms + bytes / (GB/s x 1e9) x 1000), {doc.fit_method.get('resamples')}"
              " bootstrap resamples of whole rounds.", ""]
    return "\n".join(lines)


def rates_line(doc: MatrixDocument, t: PairTable | None = None) -> str:
    """The pairs' fitted rates in one line: how many, median, slowest and fastest."""
    import numpy as np

    t = _table(doc, t)
    rated = np.flatnonzero(~np.isnan(t.rate))
    if not len(rated):
        return f"no pair of {len(t)} has a fitted rate"
    order = rated[np.lexsort((t.dst[rated], t.src[rated], t.rate[rated]))]
    lo, hi, mid = int(order[0]), int(order[-1]), int(order[len(order) // 2])
    return (f"{len(rated)} of {len(t)} pairs with a fitted rate: median {t.rate[mid]:.4g} "
            f"GB/s, slowest {t.rate[lo]:.4g} GB/s [{t.src[lo]},{t.dst[lo]}], fastest "
            f"{t.rate[hi]:.4g} GB/s [{t.src[hi]},{t.dst[hi]}]")


def _grid(doc: MatrixDocument, t: PairTable) -> list[str]:
    n = doc.world_size
    at = t.index()
    lines = ["", "## Effective GB/s (rows: sender, columns: receiver)", "",
             "| sender \\ receiver | " + " | ".join(_rank(doc, j) for j in range(n)) + " |",
             "|---|" + "---|" * n]
    for i in range(n):
        cells = []
        for j in range(n):
            k = at.get((i, j))
            cell = "—" if i == j or k is None else _num(t.value("rate", k))
            if k is not None and k in t.findings:
                cell += f" **{_row_codes(t, k)}**"
            cells.append(cell)
        lines.append(f"| {_rank(doc, i)} | " + " | ".join(cells) + " |")
    return lines


def nodes_of(doc: MatrixDocument) -> tuple[list[str], list[int]]:
    """(the hosts in first-seen order, each rank's index among them)."""
    index: dict[str, int] = {}
    of_rank = [index.setdefault(h, len(index)) for h in doc.hosts]
    return list(index), of_rank


def _node_summary(doc: MatrixDocument, t: PairTable) -> list[str]:
    """One row per node: its ranks, and the rates of the pairs it sends and receives in."""
    import numpy as np

    hosts, of_rank = nodes_of(doc)
    node = np.asarray(of_rank)
    rated = ~np.isnan(t.rate)
    by_sender, by_receiver = _split(node[t.src[rated]], t.rate[rated], len(hosts)), \
        _split(node[t.dst[rated]], t.rate[rated], len(hosts))
    named = [0] * len(hosts)
    for k in t.named():
        a, b = of_rank[t.src[k]], of_rank[t.dst[k]]
        named[a] += 1
        named[b] += a != b
    ranks = [[] for _ in hosts]
    for r, k in enumerate(of_rank):
        ranks[k].append(r)

    def stats(v) -> str:
        return "- | -" if not len(v) else f"{np.median(v):.4g} | {v.min():.4g}"

    lines = ["", "## Nodes (every pair: the CSV)", "",
             "| node | ranks | sends: median GB/s | slowest | receives: median GB/s | slowest "
             "| named pairs |", "|---|---|---|---|---|---|---|"]
    for k, h in enumerate(hosts):
        rs = ranks[k]
        span = f"{rs[0]}" if len(rs) == 1 else f"{rs[0]}..{rs[-1]} ({len(rs)})"
        lines.append(f"| {_md(h)} | {span} | {stats(by_sender[k])} | {stats(by_receiver[k])} | "
                     f"{named[k] or '-'} |")
    return lines


def _split(keys, values, n: int) -> list:
    """values grouped by key 0..n-1 (one sort, not n masks over every pair)."""
    import numpy as np

    order = np.argsort(keys, kind="stable")
    cuts = np.searchsorted(keys[order], np.arange(1, n))
    return np.split(values[order], cuts)


def _pair_table(doc: MatrixDocument, t: PairTable, rows) -> list[str]:
    head = "## Pairs" if len(rows) == len(t) else "## Named pairs (every pair: the CSV)"
    lines = ["", head, "",
             "| pair | sender | receiver | GB/s | 95% CI | setup ms | 95% CI | samples | path "
             "| link | findings |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in rows:
        s, r = int(t.src[k]), int(t.dst[k])
        lines.append(f"| [{s},{r}] | {_rank(doc, s)} | {_rank(doc, r)} | "
                     f"{_num(t.value('rate', k))} | {_ci(t.ci('rate', k))} | "
                     f"{_num(t.value('setup', k))} | {_ci(t.ci('setup', k))} | "
                     f"{t.n_samples[k]} | `{_md(t.paths[t.path[k]])}` | "
                     f"{_md(t.links[t.link[k]])} | {_row_codes(t, k) or '-'} |")
    return lines


CSV_COLUMNS = ("sender_rank", "sender_host", "receiver_rank", "receiver_host", "same_host",
               "effective_gb_s", "effective_gb_s_ci95_lo", "effective_gb_s_ci95_hi", "setup_ms",
               "setup_ms_ci95_lo", "setup_ms_ci95_hi", "n_samples", "n_sizes", "bytes_min",
               "bytes_max", "wireup_ms", "wrong_elements", "path", "link", "findings",
               "finding_messages")
CSV_ROWS = 8192  # rows rendered at a time (a million-pair CSV is never one string)


def csv_table(doc: MatrixDocument, t: PairTable | None = None) -> str:
    return "".join(csv_lines(doc, t))


def csv_lines(doc: MatrixDocument, t: PairTable | None = None):
    """The CSV, one row per pair, CSV_ROWS rows at a time."""
    t = _table(doc, t)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for at in range(0, len(t), CSV_ROWS):
        rows = range(at, min(at + CSV_ROWS, len(t)))
        c = _csv_columns(t, rows)
        for x, k in enumerate(rows):
            found = t.findings.get(k, ())
            s, r = c["src"][x], c["dst"][x]
            w.writerow(["" if v is None else v for v in (
                s, doc.hosts[s], r, doc.hosts[r], *(c[name][x] for name in _CSV_CELLS),
                t.paths[c["path"][x]], t.links[c["link"][x]],
                ";".join(f["code"] for f in found), " | ".join(f["message"] for f in found))])
        yield buf.getvalue()
        buf.seek(0)
        buf.truncate()
    yield buf.getvalue()


_CSV_CELLS = ("same_host", "rate", "rate_lo", "rate_hi", "setup", "setup_lo", "setup_hi",
              "n_samples", "n_sizes", "bytes_min", "bytes_max", "wireup", "wrong")


def _csv_columns(t: PairTable, rows: range) -> dict[str, list]:
    """The chunk's columns as Python values (None where missing)."""
    import numpy as np

    sl = slice(rows.start, rows.stop)

    def floats(c):
        v = t.cols[c][sl]
        return [None if m else x for x, m in zip(v.tolist(), np.isnan(v).tolist(), strict=True)]

    def ints(c):
        return [None if x < 0 else x for x in t.cols[c][sl].tolist()]

    def ci(which, end):
        has = t.cols[f"has_{which}_ci"][sl].tolist()
        return [x if h else None for x, h in zip(floats(f"{which}_{end}"), has, strict=True)]

    out = {c: t.cols[c][sl].tolist() for c in ("src", "dst", "same_host", "n_samples",
                                                "n_sizes", "path", "link")}
    return {**out, "rate": floats("rate"), "rate_lo": ci("rate", "lo"),
            "rate_hi": ci("rate", "hi"), "setup": floats("setup"),
            "setup_lo": ci("setup", "lo"), "setup_hi": ci("setup", "hi"),
            "bytes_min": ints("bytes_min"), "bytes_max": ints("bytes_max"),
            "wireup": floats("wireup"), "wrong": ints("wrong")}


def heatmap_png(doc: MatrixDocument, t: PairTable | None = None) -> bytes:
    """Effective GB/s per ordered pair, rows the sender and columns the receiver; a named
    pair framed in red (with its finding's code while cells carry text) and listed beside
    the map with its ranks and hosts. Beyond MAX_CELLS ranks on fewer nodes, a cell is a
    pair of nodes holding the slowest of its pairs, so a slow pair is never averaged away."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t = _table(doc, t)
    hosts, of_rank = nodes_of(doc)
    by_node = doc.world_size > MAX_CELLS and len(hosts) < doc.world_size
    n = len(hosts) if by_node else doc.world_size
    cell = np.asarray(of_rank) if by_node else np.arange(doc.world_size)
    src, dst = cell[t.src], cell[t.dst]
    rates = np.where(np.isnan(t.rate), np.inf, t.rate)
    grid = np.full((n, n), np.inf)
    np.minimum.at(grid, (src, dst), rates)
    grid[~np.isfinite(grid)] = np.nan
    named = t.named()
    size = min(4.0 + 0.9 * n, 24.0)
    fig, ax = plt.subplots(figsize=(size + (7.5 if named else 1.5), size))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="effective GB/s (1e9 B/s)" + (", slowest pair of the two "
                 "nodes" if by_node else ""), shrink=0.8)
    _ticks(ax, doc, hosts, by_node, n)
    _mark_named(ax, plt, doc, t, named, src, dst, grid, n, by_node)
    what = f" on {len(hosts)} nodes (a cell: the slowest pair between two nodes)" if by_node \
        else ""
    ax.set_title(f"kvbench matrix: {doc.transport}, {doc.world_size} ranks{what}\n"
                 f"{len(named)} pair(s) named (red)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _ticks(ax, doc: MatrixDocument, hosts: list[str], by_node: bool, n: int) -> None:
    step = max(1, n // 32)  # at most ~32 labels an axis
    where = list(range(0, n, step))
    labels = [hosts[k] if by_node else f"{k}\n{doc.hosts[k]}" if n <= MAX_ANNOTATED else str(k)
              for k in where]
    ax.set_xticks(where, labels, fontsize=8, rotation=90 if by_node or n > MAX_ANNOTATED else 0)
    ax.set_yticks(where, labels, fontsize=8)
    who = "node" if by_node else "rank (host)" if n <= MAX_ANNOTATED else "rank"
    ax.set_xlabel(f"receiver {who}")
    ax.set_ylabel(f"sender {who}")


def _mark_named(ax, plt, doc, t: PairTable, named: list[int], src, dst, grid, n: int,
                by_node: bool) -> None:
    """Red frames on the named pairs' cells (at least ~1% of the map wide, so one cell of
    a thousand is seen), their codes in the cells while cells carry text, and a list."""
    import numpy as np

    top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
    if n <= MAX_ANNOTATED and not by_node:
        for k in range(len(t)):
            i, j = int(t.src[k]), int(t.dst[k])
            v = grid[i, j]
            text = ("-" if np.isnan(v) else f"{v:.3g}") + (f"\n{_row_codes(t, k)}"
                                                           if k in t.findings else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="black" if np.isnan(v) or v >= 0.5 * top else "white")
        for r in range(n):
            ax.text(r, r, "—", ha="center", va="center", fontsize=8, color="black")
    w = max(1.0, n / 100)
    for cell in {(int(src[k]), int(dst[k])) for k in named}:
        i, j = cell
        ax.add_patch(plt.Rectangle((j - w / 2, i - w / 2), w, w, fill=False, ec="red",
                                   lw=2 if n > MAX_ANNOTATED else 3))
    if named:
        shown = named[:30]
        lines = [f"[{t.src[k]},{t.dst[k]}] {doc.hosts[t.src[k]]} -> {doc.hosts[t.dst[k]]}: "
                 f"{_row_codes(t, k)}" for k in shown]
        if len(named) > len(shown):
            lines.append(f"... and {len(named) - len(shown)} more (the .md, the .csv)")
        ax.text(1.25, 1.0, "named pairs (sender -> receiver)\n" + "\n".join(lines),
                transform=ax.transAxes, va="top", ha="left", fontsize=8, family="monospace",
                color="darkred")
