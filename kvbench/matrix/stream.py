"""A big matrix's report written as its pairs are fitted (issue 44: N = 1,024 is 1,047,552
ordered pairs), in memory and disk that stay small.

The pairs are fitted a chunk at a time. Each pair's entry is checked against its typed
model (records.schema.matrix.PairEntry) and written as its line of a hidden part file; its
joint draws go to the draws file as float32 rows, appended chunk by chunk; only its row of
numbers (kvbench.matrix.table.PairTable) is kept. After the last chunk the verdict's rules
run over the table; the pairs file is then the part file copied block by block with the
named pairs' lines given their findings (so every line of it is a whole entry, findings
included, as plan --pair reads it), the document (typed: the named pairs) is written, and
the heatmap, Markdown and CSV are drawn from the table. Every file appears together or
none (kvbench.records.write.write_files, with the big ones staged: never copied twice).

The draws are float32 beyond the inline limit: 24 significant bits, a relative error of at
most 6e-8 per value (about 7 significant digits), finer than the 6 digits the inline
documents round their draws to; the band plan draws from them (percentiles of setup_ms +
bytes x ms_per_gb) moves by about that much. 1000 draws are 8 KB a pair: 8.4 GB at
N = 1,024 (float64 would be 16.8 GB); --bootstrap 500 halves it.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
from pydantic_core import PydanticSerializationError

from kvbench.fit.fitting import draw_rows
from kvbench.matrix import table as tb
from kvbench.matrix.analyze import (
    MAX_NAMED_IN_VERDICT,
    Run,
    _entry,
    document_head,
    fit_pairs,
)
from kvbench.records.schema.matrix import (
    DRAW_COLUMNS,
    DRAWS_SUFFIX,
    PAIRS_SUFFIX,
    MatrixDocument,
    PairEntry,
)
from kvbench.records.schema.types import parse
from kvbench.records.write import Staged, dumps_json, write_files

CHUNK = 2048  # pairs fitted at a time: their fits and draws (~40 MB) are all that is held
BLOCK = 16 << 20  # bytes copied at a time from the part file to the pairs file
NPY_HEADER = 128  # a v1.0 .npy header of any 3-d shape is 128 bytes (magic, length, dict)


class DrawsOut:
    """The draws file, written row by row into a staged temp: a header reserved, float32
    rows appended, the header (the row count known only at the end) written last."""

    def __init__(self, where: Path):
        self.st = Staged(where)
        self.st.fh.write(b"\0" * NPY_HEADER)
        self.rows, self.n = 0, None

    def take(self, entries: list[dict]) -> None:
        """Each entry's draws out of its fit into the file (its draws_row set); a pair whose
        draw count is not the file's (the first chunk's most common) keeps them inline."""
        vals = [(e, e["fit"]["draws"]) for e in entries if e["fit"] and e["fit"].get("draws")]
        if self.n is None:
            counts = Counter(len(d["values"]) for _, d in vals if len(d["values"]))
            self.n = counts.most_common(1)[0][0] if counts else None
        rows = []
        for e, d in vals:
            if self.n and len(d["values"]) == self.n and d.get("columns") == DRAW_COLUMNS:
                e["draws_row"] = self.rows + len(rows)
                rows.append(d["values"])
                e["fit"]["draws"] = None
            elif isinstance(d["values"], np.ndarray):  # kept inline, as kvbench fit writes
                d["values"] = draw_rows(d["values"])
        if rows:
            self.st.fh.write(np.asarray(rows, dtype="<f4").tobytes(order="C"))
            self.rows += len(rows)

    def finish(self) -> dict | None:
        """The document's draws_file (None, the temp discarded, when no pair had draws)."""
        if not self.rows:
            self.st.discard()
            return None
        buf = io.BytesIO()
        shape = (self.rows, self.n, 2)
        np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False,
                                                   "shape": shape})
        head = buf.getvalue()
        if len(head) != NPY_HEADER:  # (cannot happen for a 3-d shape; refuse, never corrupt)
            raise RuntimeError(f"a .npy header of {len(head)} bytes, {NPY_HEADER} reserved")
        self.st.fh.seek(0)
        self.st.fh.write(head)
        self.st.fh.seek(0, io.SEEK_END)
        return {"file": "kvbench-matrix" + DRAWS_SUFFIX, "shape": list(shape),
                "columns": DRAW_COLUMNS, "dtype": "float32"}


def _fit_chunks(run: Run, n_boot: int, seed: int, chunk: int):
    """(pair, PairData, fit record) in the document's order, fitted `chunk` pairs at a time.
    Each chunk's groups leave `run` as they are fitted (the stream owns the run): the samples
    of the pairs already written are not held to the end."""
    order = sorted(run.pairs)
    for at in range(0, len(order), chunk):
        part = order[at:at + chunk]
        sub = replace(run, groups={p: run.groups.pop(p) for p in part if p in run.groups})
        fits = fit_pairs(sub, n_boot, seed, raw_draws=True)
        yield [(run.pairs[p], fits.get(p, {"not_fitted": "no group"})) for p in part]


def pair_line(entry: dict) -> tuple[str, PairEntry]:
    """An entry checked against its typed model, and its line as the pairs file holds it:
    the typed entry's JSON as pydantic writes it (a third of json.dumps' time on a dict of
    it; floats in their shortest round-trip form, text in UTF-8), or, where that text holds a
    non-finite number or cannot be written (a name that is not UTF-8), kvbench's own writer,
    which refuses the one and escapes the other (kvbench.records.write.dumps_json)."""
    typed = PairEntry.model_validate(entry)
    try:
        text = typed.model_dump_json(by_alias=True)
    except PydanticSerializationError:
        text = None
    if text is None or "NaN" in text or "Infinity" in text:
        text = dumps_json(typed.model_dump(by_alias=True), indent=None)
    return text + "\n", typed


def stream_pairs(run: Run, n_boot: int, seed: int, part: Staged, draws: DrawsOut,
                 chunk: int = CHUNK) -> tuple[tb.PairTable, np.ndarray]:
    """Every pair fitted, its line written to `part`, its draws to `draws`: (the table,
    each line's byte offset in `part`, one more for the end)."""
    b = tb.TableBuilder(len(run.pairs))
    lengths = np.zeros(len(run.pairs) + 1, dtype=np.int64)
    k = 0
    for got in _fit_chunks(run, n_boot, seed, chunk):
        entries = [_entry(d, fit) for d, fit in got]
        draws.take(entries)
        text = []
        for (d, _), e in zip(got, entries, strict=True):
            line, typed = pair_line(e)
            b.add(k, typed, d.kinds.most_common(1)[0][0])
            text.append(line.encode("utf-8"))
            k += 1
        lengths[k - len(text) + 1:k + 1] = [len(x) for x in text]
        part.fh.write(b"".join(text))
    return b.table(), np.cumsum(lengths)


def _named_entries(t: tb.PairTable, part: Staged, offsets: np.ndarray) -> dict[int, tuple]:
    """{row: (line, typed entry)} of the named pairs, their findings in."""
    out = {}
    for k in t.named():
        part.fh.seek(int(offsets[k]))
        raw = json.loads(part.fh.read(int(offsets[k + 1] - offsets[k])))
        out[k] = pair_line({**raw, "findings": t.findings[k]})
    part.fh.seek(0, io.SEEK_END)
    return out


def _pairs_file(where: Path, part: Staged, offsets: np.ndarray, named: dict) -> Staged:
    """The pairs file: the part file's bytes, block by block, the named lines replaced."""
    out = Staged(where)
    try:
        part.fh.flush()
        pos = 0
        for k in [*sorted(named), None]:
            end = int(offsets[-1] if k is None else offsets[k])
            part.fh.seek(pos)
            while pos < end:
                block = part.fh.read(min(BLOCK, end - pos))
                out.fh.write(block)
                pos += len(block)
            if k is not None:
                out.fh.write(named[k][0].encode("utf-8"))
                pos = int(offsets[k + 1])
    except BaseException:
        out.discard()
        raise
    return out


def write_streamed(run: Run, paths, out_dir: Path, *, expect_link: str | None = None,
                   expect_local_link: str | None = None, slow_fraction: float = 0.8,
                   n_boot: int = 1000, seed: int = 0, chunk: int = CHUNK
                   ) -> tuple[MatrixDocument, tb.PairTable, list[Path]]:
    """The report of a big run, streamed (module doc): (the typed document, which holds the
    named pairs, the table of every pair, the files written). `run`'s groups are consumed."""
    from kvbench.matrix.report import SUFFIXES
    from kvbench.records.write import fresh_stem

    Path(out_dir).mkdir(parents=True, exist_ok=True)  # (as write_files does)
    stem = fresh_stem(out_dir, "kvbench-matrix", (*SUFFIXES, DRAWS_SUFFIX, PAIRS_SUFFIX))
    name = stem.name
    staged: list[Staged] = []
    try:
        part = Staged(stem.with_name(name + PAIRS_SUFFIX + ".part"))
        staged.append(part)
        draws = DrawsOut(stem.with_name(name + DRAWS_SUFFIX))
        staged.append(draws.st)
        t, offsets = stream_pairs(run, n_boot, seed, part, draws, chunk)
        majority = tb.judge(t, slow_fraction, expect_link, expect_local_link)
        named = _named_entries(t, part, offsets)
        pairs = _pairs_file(stem.with_name(name + PAIRS_SUFFIX), part, offsets, named)
        staged.append(pairs)
        draws_file = draws.finish()
        n = run.world_size
        doc = parse(MatrixDocument, {
            **document_head(paths, run, slow_fraction, expect_link, expect_local_link, n_boot,
                            seed),
            "majority_path": majority, "pairs": [e.model_dump(by_alias=True)
                                                 for _, e in named.values()],
            "verdict": tb.verdict_line(t, run.hosts, n * (n - 1), MAX_NAMED_IN_VERDICT),
            "draws_file": draws_file and {**draws_file, "file": name + DRAWS_SUFFIX},
            "pairs_file": {"file": name + PAIRS_SUFFIX, **tb.pairs_file_fields(t)}},
            "the matrix document (kvbench matrix)")
        files = _rendered(doc, t, stem) + [(stem.with_name(name + PAIRS_SUFFIX), pairs)]
        if draws_file is not None:
            files.append((stem.with_name(name + DRAWS_SUFFIX), draws.st))
        return doc, t, write_files(files)
    finally:
        for st in staged:
            st.discard()


def _rendered(doc: MatrixDocument, t: tb.PairTable, stem: Path) -> list[tuple[Path, object]]:
    """The document (its named pairs), the heatmap, the Markdown and the CSV (streamed)."""
    from kvbench.fit.fitting import dumps
    from kvbench.fit.plots import require_matplotlib
    from kvbench.matrix import report

    require_matplotlib()
    return [(stem.with_name(stem.name + s), c) for s, c in (
        (".json", dumps(doc.model_dump(by_alias=True)) + "\n"),
        (".png", report.heatmap_png(doc, t)), (".md", report.markdown(doc, t)),
        (".csv", report.csv_lines(doc, t)))]
