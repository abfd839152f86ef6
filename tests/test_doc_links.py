"""Every relative link in the docs resolves to a file git tracks: the README, docs/, jobs/,
the results/ READMEs and the other READMEs. Results folders get trimmed and moved; a
citation left pointing at a file that is gone (or that only exists, untracked, in one
person's checkout) fails here, not in a reader's browser. Checked: Markdown links
`[text](path)` and `[ref]: path` outside fenced code, and backticked `results/...` paths
(citations of published results; templates with `<...>`, `*`, `{` or `...` are skipped)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from tests.conftest import ROOT

LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF = re.compile(r"(?m)^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
CITED = re.compile(r"`(results/[^`\s]*)`")
FENCE = re.compile(r"(?ms)^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$")
TEMPLATE = ("<", "*", "{", "$", "...")


def tracked_files() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: which files are tracked is not known")
    return {f for f in out.split("\0") if f}


def doc_files(tracked: set[str]) -> list[str]:
    """The Markdown a reader follows: README.md, docs/*.md, jobs/README.md and every README."""
    return sorted(f for f in tracked if f.endswith(".md") and (
        f == "README.md" or (f.startswith("docs/") and f.count("/") == 1)
        or f.endswith("/README.md")))


def _resolves(target: str, tracked: set[str], dirs: set[str]) -> bool:
    return target in tracked or target.rstrip("/") in dirs


def broken_links(doc: str, text: str, tracked: set[str]) -> list[str]:
    """`doc: target` for each relative link (or cited results/ path) in text that is not a
    tracked file or a folder holding tracked files."""
    dirs = {str(p) for f in tracked for p in PurePosixPath(f).parents if str(p) != "."}
    text = FENCE.sub("", text)
    base = PurePosixPath(doc).parent
    bad = []
    for target in [m.group(1) for m in LINK.finditer(text)] + REF.findall(text):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # an anchor in the same file, or a URL (http:, mailto:, ...)
        parts: list[str] = []
        for part in (base / path).parts:  # normalise a/../b without touching the disk
            if part == "..":
                if not parts:
                    parts = ["<outside the repository>"]
                    break
                parts.pop()
            elif part != ".":
                parts.append(part)
        if not _resolves("/".join(parts), tracked, dirs):
            bad.append(f"{doc}: ({target})")
    for cited in CITED.findall(text):
        if not any(t in cited for t in TEMPLATE) and not _resolves(cited, tracked, dirs):
            bad.append(f"{doc}: `{cited}`")
    return bad


def test_every_doc_link_resolves_to_a_tracked_file():
    tracked = tracked_files()
    docs = doc_files(tracked)
    assert {"README.md", "jobs/README.md", "results/README.md"} <= set(docs)
    assert any(d.startswith("docs/") for d in docs) and any(d.startswith("results/lab/") for d in docs)
    bad = [b for d in docs for b in broken_links(d, (ROOT / d).read_text(), tracked)]
    assert not bad, "links to files that are not tracked:\n" + "\n".join(bad)


def test_the_checker_finds_what_is_planted():
    """A broken link of each kind is reported; good links, URLs, anchors, fenced code and
    templates are not."""
    tracked = {"README.md", "docs/a.md", "results/x/README.md", "results/x/run.jsonl"}
    text = "\n".join([
        "[ok](../README.md) [ok dir](../results/x/) [ok anchor](a.md#part) [url](https://e.org/x)",
        "[self](#top) [mail](mailto:a@b.c) `results/x/run.jsonl` `results/gpu-<host>/`",
        "[gone](../results/y/README.md) [untracked](b.md) [up](../../etc/passwd)",
        "`results/x/run.csv`",
        "[ref]: ../results/z.md",
        "```", "[in code](nowhere.md) `results/nowhere`", "```",
    ])
    bad = broken_links("docs/a.md", text, tracked)
    assert bad == ["docs/a.md: (../results/y/README.md)", "docs/a.md: (b.md)",
                   "docs/a.md: (../../etc/passwd)", "docs/a.md: (../results/z.md)",
                   "docs/a.md: `results/x/run.csv`"]
    assert not broken_links("docs/a.md", "[fine](../results/x/run.jsonl)", tracked)
    assert Path(ROOT / "README.md").is_file()
