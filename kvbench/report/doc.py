"""A report as a list of blocks, written out as Markdown (plots as PNG files beside it) or as one
self-contained HTML file (plots embedded as base64 PNG; nothing fetched from a network)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field


@dataclass
class Image:
    name: str  # file name under plots/ (Markdown)
    alt: str
    png: bytes


@dataclass
class Doc:
    title: str
    blocks: list[tuple] = field(default_factory=list)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[str]]) -> None:
        if rows:
            self.blocks.append(("table", headers, rows))

    def image(self, img: Image) -> None:
        self.blocks.append(("img", img))

    def images(self) -> list[Image]:
        return [b[1] for b in self.blocks if b[0] == "img"]


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(doc: Doc, plots_dir: str = "plots") -> str:
    out = [f"# {doc.title}", ""]
    for b in doc.blocks:
        kind = b[0]
        if kind == "h":
            out += [f"{'#' * (b[1] + 1)} {b[2]}", ""]
        elif kind == "p":
            out += [b[1], ""]
        elif kind == "ul":
            out += [f"- {item}" for item in b[1]] + [""]
        elif kind == "table":
            headers, rows = b[1], b[2]
            out.append("| " + " | ".join(map(_md_cell, headers)) + " |")
            out.append("|" + "|".join("---" for _ in headers) + "|")
            out += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows] + [""]
        elif kind == "img":
            out += [f"![{b[1].alt}]({plots_dir}/{b[1].name})", ""]
    return "\n".join(out).rstrip() + "\n"


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:80em;padding:0 1em}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}img{max-width:100%}code{background:#f3f3f3}"""


def _inline(text: str) -> str:
    """Escaped text with `code` spans (the only Markdown the blocks use inline)."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def to_html(doc: Doc) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(doc.title)}</title><style>{_STYLE}</style></head><body>",
           f"<h1>{html.escape(doc.title)}</h1>"]
    for b in doc.blocks:
        kind = b[0]
        if kind == "h":
            out.append(f"<h{b[1] + 1}>{_inline(b[2])}</h{b[1] + 1}>")
        elif kind == "p":
            out.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in r) + "</tr>"
                           for r in b[2])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(b[1].png).decode("ascii")
            out.append(f'<p><img alt="{html.escape(b[1].alt)}" '
                       f'src="data:image/png;base64,{data}"></p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"
