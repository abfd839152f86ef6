"""The matrix document as people read it: a heatmap (PNG), a Markdown report and a CSV table.

Every figure here is read from the document (kvbench.records.schema.matrix); nothing is
recomputed. GB/s are decimal (1e9 bytes per second), times in ms.
"""

from __future__ import annotations

import csv
import io

from kvbench.records.schema.matrix import MatrixDocument, PairEntry

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


def markdown(doc: MatrixDocument) -> str:
    """The findings first (verdict, each named pair's finding in a sentence), then the
    rules, then the grid (a per-node summary beyond MAX_GRID ranks) and the pairs (the named
    ones only beyond MAX_PAIR_ROWS: every pair is in the CSV)."""
    n = doc.world_size
    lines = [f"# kvbench matrix: {doc.transport}, {n} ranks on {len(set(doc.hosts))} host(s)", "",
             f"**Verdict:** {_md(doc.verdict)}", ""]
    named = [p for p in doc.pairs if p.findings]
    for p in named[:MAX_LISTED]:
        for f in p.findings:
            lines.append(f"- **{CODES[f.code]}** [{p.pair[0]},{p.pair[1]}] {p.sender.host} -> "
                         f"{p.receiver.host}: {_md(f.message)}")
    if len(named) > MAX_LISTED:
        lines.append(f"- ... and {len(named) - MAX_LISTED} more named pairs: the CSV's "
                     "`findings` column")
    lines += ["" if named else "- no pair named", f"- {rates_line(doc)}"]
    for kind, path in doc.majority_path.items():
        lines.append(f"- majority path {kind}: " + (f"`{_md(path)}`" if path else
                                                     "none (no path held by more than half)"))
    lines += [f"- schedule: {doc.schedule or 'unknown'}; rules: slow = {doc.rules.slow} "
              f"(slow_fraction {doc.rules.slow_fraction:g}); expected link: "
              f"{doc.rules.expect_link or 'not given'}"
              + (f", within a host {doc.rules.expect_local_link}" if doc.rules.expect_local_link
                 else "")]
    lines += _grid(doc) if n <= MAX_GRID else _node_summary(doc)
    lines += _pair_table(doc, doc.pairs if len(doc.pairs) <= MAX_PAIR_ROWS else named)
    lines += ["", "GB/s = 1e9 bytes/s; each pair fitted as `kvbench fit` fits a group "
              f"(time_ms = setup_ms + bytes / (GB/s x 1e9) x 1000), {doc.fit_method.get('resamples')}"
              " bootstrap resamples of whole rounds.", ""]
    return "\n".join(lines)


def rates_line(doc: MatrixDocument) -> str:
    """The pairs' fitted rates in one line: how many, median, slowest and fastest."""
    rated = sorted((p.effective_gb_s, p.pair) for p in doc.pairs if p.effective_gb_s is not None)
    if not rated:
        return f"no pair of {len(doc.pairs)} has a fitted rate"
    (lo, a), (hi, b) = rated[0], rated[-1]
    mid = rated[len(rated) // 2][0]
    return (f"{len(rated)} of {len(doc.pairs)} pairs with a fitted rate: median {mid:.4g} "
            f"GB/s, slowest {lo:.4g} GB/s [{a[0]},{a[1]}], fastest {hi:.4g} GB/s [{b[0]},{b[1]}]")


def _grid(doc: MatrixDocument) -> list[str]:
    n = doc.world_size
    lines = ["", "## Effective GB/s (rows: sender, columns: receiver)", "",
             "| sender \\ receiver | " + " | ".join(_rank(doc, j) for j in range(n)) + " |",
             "|---|" + "---|" * n]
    for i in range(n):
        cells = []
        for j in range(n):
            p = doc.pair(i, j)
            cell = "—" if i == j or p is None else _num(p.effective_gb_s)
            if p is not None and p.findings:
                cell += f" **{_codes(p)}**"
            cells.append(cell)
        lines.append(f"| {_rank(doc, i)} | " + " | ".join(cells) + " |")
    return lines


def nodes_of(doc: MatrixDocument) -> tuple[list[str], list[int]]:
    """(the hosts in first-seen order, each rank's index among them)."""
    index: dict[str, int] = {}
    of_rank = [index.setdefault(h, len(index)) for h in doc.hosts]
    return list(index), of_rank


def _node_summary(doc: MatrixDocument) -> list[str]:
    """One row per node: its ranks, and the rates of the pairs it sends and receives in."""
    import numpy as np

    hosts, of_rank = nodes_of(doc)
    sent = [[] for _ in hosts]
    got = [[] for _ in hosts]
    named = [0] * len(hosts)
    for p in doc.pairs:
        a, b = of_rank[p.pair[0]], of_rank[p.pair[1]]
        if p.effective_gb_s is not None:
            sent[a].append(p.effective_gb_s)
            got[b].append(p.effective_gb_s)
        if p.findings:
            named[a] += 1
            named[b] += a != b
    ranks = [[] for _ in hosts]
    for r, k in enumerate(of_rank):
        ranks[k].append(r)

    def stats(v: list) -> str:
        return "- | -" if not v else f"{np.median(v):.4g} | {min(v):.4g}"

    lines = ["", "## Nodes (every pair: the CSV)", "",
             "| node | ranks | sends: median GB/s | slowest | receives: median GB/s | slowest "
             "| named pairs |", "|---|---|---|---|---|---|---|"]
    for k, h in enumerate(hosts):
        rs = ranks[k]
        span = f"{rs[0]}" if len(rs) == 1 else f"{rs[0]}..{rs[-1]} ({len(rs)})"
        lines.append(f"| {_md(h)} | {span} | {stats(sent[k])} | {stats(got[k])} | "
                     f"{named[k] or '-'} |")
    return lines


def _pair_table(doc: MatrixDocument, pairs: list[PairEntry]) -> list[str]:
    head = "## Pairs" if len(pairs) == len(doc.pairs) else "## Named pairs (every pair: the CSV)"
    lines = ["", head, "",
             "| pair | sender | receiver | GB/s | 95% CI | setup ms | 95% CI | samples | path "
             "| link | findings |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        samples = p.fit.n_samples if p.fit else 0
        lines.append(f"| [{p.pair[0]},{p.pair[1]}] | {_rank(doc, p.sender.rank)} | "
                     f"{_rank(doc, p.receiver.rank)} | {_num(p.effective_gb_s)} | "
                     f"{_ci(p.effective_gb_s_ci95)} | {_num(p.setup_ms)} | {_ci(p.setup_ms_ci95)} | "
                     f"{samples} | `{_md(p.path)}` | {_md(p.link)} | {_codes(p) or '-'} |")
    return lines


CSV_COLUMNS = ("sender_rank", "sender_host", "receiver_rank", "receiver_host", "same_host",
               "effective_gb_s", "effective_gb_s_ci95_lo", "effective_gb_s_ci95_hi", "setup_ms",
               "setup_ms_ci95_lo", "setup_ms_ci95_hi", "n_samples", "n_sizes", "bytes_min",
               "bytes_max", "wireup_ms", "wrong_elements", "path", "link", "findings",
               "finding_messages")


def _ends(ci) -> tuple:
    return (None, None) if not ci else (ci[0], ci[1])


def csv_table(doc: MatrixDocument) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for p in doc.pairs:
        f = p.fit
        w.writerow(["" if v is None else v for v in (
            p.sender.rank, p.sender.host, p.receiver.rank, p.receiver.host, p.same_host,
            p.effective_gb_s, *_ends(p.effective_gb_s_ci95), p.setup_ms, *_ends(p.setup_ms_ci95),
            f.n_samples if f else 0, f.n_sizes if f else 0,
            f.model_extra.get("bytes_min") if f else None,
            f.model_extra.get("bytes_max") if f else None, p.wireup_ms, p.wrong_elements,
            p.path, p.link, ";".join(x.code for x in p.findings),
            " | ".join(x.message for x in p.findings))])
    return buf.getvalue()


def heatmap_png(doc: MatrixDocument) -> bytes:
    """Effective GB/s per ordered pair, rows the sender and columns the receiver; a named
    pair framed in red (with its finding's code while cells carry text) and listed beside
    the map with its ranks and hosts. Beyond MAX_CELLS ranks on fewer nodes, a cell is a
    pair of nodes holding the slowest of its pairs, so a slow pair is never averaged away."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hosts, of_rank = nodes_of(doc)
    by_node = doc.world_size > MAX_CELLS and len(hosts) < doc.world_size
    n = len(hosts) if by_node else doc.world_size
    cell = np.asarray(of_rank) if by_node else np.arange(doc.world_size)
    src = cell[[p.pair[0] for p in doc.pairs]]
    dst = cell[[p.pair[1] for p in doc.pairs]]
    rates = np.array([np.inf if p.effective_gb_s is None else p.effective_gb_s
                      for p in doc.pairs])
    grid = np.full((n, n), np.inf)
    np.minimum.at(grid, (src, dst), rates)
    grid[~np.isfinite(grid)] = np.nan
    named = [k for k, p in enumerate(doc.pairs) if p.findings]
    size = min(4.0 + 0.9 * n, 24.0)
    fig, ax = plt.subplots(figsize=(size + (7.5 if named else 1.5), size))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="effective GB/s (1e9 B/s)" + (", slowest pair of the two "
                 "nodes" if by_node else ""), shrink=0.8)
    _ticks(ax, doc, hosts, by_node, n)
    _mark_named(ax, plt, doc, named, src, dst, grid, n, by_node)
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


def _mark_named(ax, plt, doc, named: list[int], src, dst, grid, n: int, by_node: bool) -> None:
    """Red frames on the named pairs' cells (at least ~1% of the map wide, so one cell of
    a thousand is seen), their codes in the cells while cells carry text, and a list."""
    import numpy as np

    top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
    if n <= MAX_ANNOTATED and not by_node:
        for p in doc.pairs:
            i, j = p.pair
            v = grid[i, j]
            text = ("-" if np.isnan(v) else f"{v:.3g}") + (f"\n{_codes(p)}" if p.findings else "")
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
        shown = [doc.pairs[k] for k in named[:30]]
        lines = [f"[{p.pair[0]},{p.pair[1]}] {p.sender.host} -> {p.receiver.host}: {_codes(p)}"
                 for p in shown]
        if len(named) > len(shown):
            lines.append(f"... and {len(named) - len(shown)} more (the .md, the .csv)")
        ax.text(1.25, 1.0, "named pairs (sender -> receiver)\n" + "\n".join(lines),
                transform=ax.transAxes, va="top", ha="left", fontsize=8, family="monospace",
                color="darkred")
