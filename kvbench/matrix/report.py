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
    n = doc.world_size
    lines = [f"# kvbench matrix: {doc.transport}, {n} ranks on {len(set(doc.hosts))} host(s)", "",
             f"**Verdict:** {_md(doc.verdict)}", ""]
    for kind, path in doc.majority_path.items():
        lines.append(f"- majority path {kind}: " + (f"`{_md(path)}`" if path else
                                                     "none (no path held by more than half)"))
    lines += [f"- schedule: {doc.schedule or 'unknown'}; rules: slow = {doc.rules.slow} "
              f"(slow_fraction {doc.rules.slow_fraction:g}); expected link: "
              f"{doc.rules.expect_link or 'not given'}"
              + (f", within a host {doc.rules.expect_local_link}" if doc.rules.expect_local_link
                 else ""), ""]
    for p in doc.pairs:
        for f in p.findings:
            lines.append(f"- **{CODES[f.code]}** [{p.pair[0]},{p.pair[1]}] {p.sender.host} -> "
                         f"{p.receiver.host}: {_md(f.message)}")
    lines += ["", "## Effective GB/s (rows: sender, columns: receiver)", "",
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
    lines += ["", "## Pairs", "",
              "| pair | sender | receiver | GB/s | 95% CI | setup ms | 95% CI | samples | path "
              "| link | findings |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in doc.pairs:
        samples = p.fit.n_samples if p.fit else 0
        lines.append(f"| [{p.pair[0]},{p.pair[1]}] | {_rank(doc, p.sender.rank)} | "
                     f"{_rank(doc, p.receiver.rank)} | {_num(p.effective_gb_s)} | "
                     f"{_ci(p.effective_gb_s_ci95)} | {_num(p.setup_ms)} | {_ci(p.setup_ms_ci95)} | "
                     f"{samples} | `{_md(p.path)}` | {_md(p.link)} | {_codes(p) or '-'} |")
    lines += ["", "GB/s = 1e9 bytes/s; each pair fitted as `kvbench fit` fits a group "
              f"(time_ms = setup_ms + bytes / (GB/s x 1e9) x 1000), {doc.fit_method.get('resamples')}"
              " bootstrap resamples of whole rounds.", ""]
    return "\n".join(lines)


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
    pair framed in red with its finding's code."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = doc.world_size
    grid = np.full((n, n), np.nan)
    for p in doc.pairs:
        if p.effective_gb_s is not None:
            grid[p.pair[0], p.pair[1]] = p.effective_gb_s
    size = min(4.0 + 0.9 * n, 24.0)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0)
    fig.colorbar(im, ax=ax, label="effective GB/s (1e9 B/s)", shrink=0.8)
    labels = [f"{r}\n{doc.hosts[r]}" for r in range(n)]
    ax.set_xticks(range(n), labels, fontsize=8)
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_xlabel("receiver rank (host)")
    ax.set_ylabel("sender rank (host)")
    top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
    for r in range(n if n <= MAX_ANNOTATED else 0):
        ax.text(r, r, "—", ha="center", va="center", fontsize=8, color="black")
    for p in doc.pairs:
        i, j = p.pair
        if p.findings:
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=3))
        if n <= MAX_ANNOTATED:
            v = grid[i, j]
            text = "-" if np.isnan(v) else f"{v:.3g}"
            if p.findings:
                text += "\n" + _codes(p)
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="black" if np.isnan(v) or v >= 0.5 * top else "white")
    ax.set_title(f"kvbench matrix: {doc.transport}, {n} ranks\n"
                 f"{sum(1 for p in doc.pairs if p.findings)} pair(s) named (red)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
