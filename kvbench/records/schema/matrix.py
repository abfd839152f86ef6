"""A `kvbench.matrix/1` document: the link matrix of one run, fitted pair by pair, typed.

`kvbench matrix` writes it (one entry per ordered pair: who sent, who received, on which
hosts, the path the transport named, the pair's fit as `kvbench fit` writes a group, and what
the verdict found), and `kvbench plan` / `plan export` read it: `as_fit_document` reduces a
matrix to the one pair a plan uses (the slowest, or a named one) as a `kvbench.fit/2`
document with that pair's group, so the planner code reads one format only.

What would grow with the world size in every pair is kept once: a pair's fit group and spec
leave out `hosts` (the document's `hosts`, put back when a pair is read as a fit), and its
joint bootstrap draws are a row of the draws file beside the document (`draws_file`,
`draws_row`); a document whose pairs carry their draws inline is read as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from kvbench.errors import UsageError
from kvbench.records.schema.fit import (
    MAX_FIT_BYTES,
    SCHEMA_FIT,
    FitDocument,
    FitGroup,
    Interval,
    load_fit_document,
)
from kvbench.records.schema.read import MiB, load_json
from kvbench.records.schema.types import (
    AnyText,
    Count,
    Fraction,
    GBps,
    Open,
    SignedMs,
    Strict,
    Text,
    TimeMs,
    UtcStamp,
    parse,
    refuse,
    show,
)

SCHEMA_MATRIX = "kvbench.matrix/1"
MAX_MATRIX_BYTES = 256 * MiB
Rank = Annotated[int, Field(ge=0, le=2**20)]
# what the verdict can say about a pair
FINDINGS = ("slow", "path_differs", "expect_link", "wrong_data", "no_fit")
Code = Literal["slow", "path_differs", "expect_link", "wrong_data", "no_fit"]


class Endpoint(Strict):
    rank: Rank
    host: Text


class Finding(Strict):
    code: Code
    message: AnyText


class PairEntry(Strict):
    """One ordered pair: its ends, its path in the transport's words and as a kind of link,
    its fitted setup and rate with 95% intervals (copied from `fit`), and the findings."""

    # its JSON text (kvbench.matrix.stream, a line a pair) writes a non-finite number as NaN or
    # Infinity, never as a silent null: the writer sees it and refuses it with its key path
    model_config = ConfigDict(ser_json_inf_nan="constants")

    pair: Annotated[list[Rank], Field(min_length=2, max_length=2)]
    sender: Endpoint
    receiver: Endpoint
    same_host: bool
    path: AnyText  # transport_info.path of the pair's records
    link: Text  # kvbench.links.linkpath kinds, e.g. "tcp", "nvlink|pcie", "unknown"
    path_source: AnyText | None = None  # how the transport tied the path to this pair
    n_records: Count
    wrong_elements: Count | None = None  # summed over the pair's records; None: not checked
    wireup_ms: TimeMs | None = None  # the pair's first handoff (4 KiB, connection set-up)
    setup_ms: SignedMs | None = None
    setup_ms_ci95: Interval | None = None
    effective_gb_s: GBps | None = None
    effective_gb_s_ci95: Interval | None = None
    fit: FitGroup | None = None  # the pair's group as kvbench fit writes it
    not_fitted: AnyText | None = None  # why there is no fit
    findings: list[Finding] = []
    draws_row: Count | None = None  # its fit's joint draws: this row of the draws file

    @model_validator(mode="after")
    def _ends_agree(self):
        if self.pair != [self.sender.rank, self.receiver.rank]:
            raise refuse(f"pair {self.pair} does not match sender rank {self.sender.rank} and "
                         f"receiver rank {self.receiver.rank}")
        if self.pair[0] == self.pair[1]:
            raise refuse(f"pair {self.pair}: a rank does not hand off to itself")
        return self


class Rules(Strict):
    """The verdict's rules, with their settings, as applied."""

    slow: AnyText
    slow_fraction: Fraction
    path: AnyText
    expect_link: Text | None = None
    expect_local_link: Text | None = None


DRAWS_SUFFIX = ".draws.npy"
DRAW_COLUMNS = ["setup_ms", "ms_per_gb"]


class DrawsFile(Strict):
    """Where the pairs' joint bootstrap draws are: a NumPy .npy array, shape (pairs with
    draws, draws per pair, 2), beside the document (a plain file name); a pair's `draws_row`
    is its row. float64: the fit's own values at full precision (`--draws file` up to 240
    pairs). float32 (a streamed report, beyond 240 pairs: 8 KB a pair at 1000 draws, 8.4 GB
    at N = 1,024): 24 significant bits, at most 6e-8 relative error a value, still finer than
    the 6 significant digits inline draws are rounded to (as kvbench fit writes them)."""

    file: Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^/\\\x00]+$")]
    shape: Annotated[list[Count], Field(min_length=3, max_length=3)]
    columns: list[Text] = DRAW_COLUMNS
    dtype: Literal["float64", "float32"] = "float64"


PAIRS_SUFFIX = ".pairs.jsonl"
MAX_PAIR_LINE = 4 * MiB  # one pair's entry on its line (a fit of a few sizes is ~5 KB)


class PairsFile(Strict):
    """Where every pair's entry is when the matrix is big: one JSON object a line, "pair"
    first, beside the document (a plain file name); the document's `pairs` then holds the
    named pairs only, and says which fitted pair is the slowest, so `plan --pair` reads the
    one line it needs at any N (the document alone grew past its read bound near 250 ranks).
    Each line is a whole PairEntry, findings included (kvbench.matrix.stream writes every line
    checked against the model, and the named pairs' lines again once the rules have run)."""

    file: Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^/\\\x00]+$")]
    count: Count
    n_fitted: Count
    slowest_fitted: Annotated[list[Rank], Field(min_length=2, max_length=2)] | None = None


class MatrixDocument(Open):
    schema_: Literal["kvbench.matrix/1"] = Field(alias="schema")
    created: UtcStamp
    inputs: list[AnyText]
    transport: Text
    world_size: Annotated[int, Field(ge=2, le=2**20)]
    hosts: list[Text]
    schedule: Text | None = None
    rules: Rules
    majority_path: dict[str, AnyText | None] = {}  # "across hosts" / "same host" -> path
    fit_method: dict[str, Any] = {}
    pairs: list[PairEntry] = []  # every pair; with pairs_file, the named ones
    verdict: AnyText
    draws_file: DrawsFile | None = None  # the pairs' draws, beside the document
    pairs_file: PairsFile | None = None  # every pair's entry, beside the document
    _by_pair: dict = PrivateAttr(default_factory=dict)  # (sender, receiver) -> entry

    @model_validator(mode="after")
    def _pairs_fit_world(self):
        if len(self.hosts) != self.world_size:
            raise refuse(f"{len(self.hosts)} hosts for world_size {self.world_size}")
        if not self.pairs and self.pairs_file is None:
            raise refuse("no pairs: a matrix lists at least one pair (or names its pairs_file)")
        seen: dict[tuple[int, int], PairEntry] = {}
        for p in self.pairs:
            key = (p.pair[0], p.pair[1])
            if key in seen:
                raise refuse(f"pair {list(key)} is listed twice")
            seen[key] = p
            if max(key) >= self.world_size:
                raise refuse(f"pair {list(key)} names a rank outside world_size {self.world_size}")
        self._by_pair = seen
        return self

    def pair(self, src: int, dst: int) -> PairEntry | None:
        """The entry of pair (src, dst), found by index (a grid of N x N cells asks N^2 times)."""
        return self._by_pair.get((src, dst))


def is_matrix(raw: object) -> bool:
    return isinstance(raw, dict) and raw.get("schema") == SCHEMA_MATRIX


def load_matrix_document(path: str | Path, raw: object | None = None,
                         pairs: str | tuple[int, int] | None = "all") -> MatrixDocument:
    """A matrix file, bounded and typed; any problem is one line naming the key path. With a
    pairs file, `pairs` says which of its lines are read: "all", one pair (I, J), or None
    (the slowest fitted pair, which the document names): the document's `pairs` become those."""
    if raw is None:
        raw = load_json(path, MAX_MATRIX_BYTES, "matrix file", missing="no such file")
    if not is_matrix(raw):
        raise UsageError(f"{path}: expected a {SCHEMA_MATRIX} document written by kvbench matrix, "
                         f"got schema {show(raw.get('schema') if isinstance(raw, dict) else raw)}")
    if raw.get("pairs_file") is not None:
        raw = {**raw, "pairs": read_pairs(path, parse(PairsFile, raw["pairs_file"],
                                                      f"{path}: pairs_file"), pairs)}
    return parse(MatrixDocument, raw, str(path))


def read_pairs(path: str | Path, pf: PairsFile, want: str | tuple[int, int] | None) -> list:
    """The entries (raw) of the pairs file that `want` names (load_matrix_document): one pair
    is found by its line's start ('{"pair":[I,J],', as kvbench matrix writes it) and only
    that line is parsed, so a million-pair file is read once, in lines, never whole."""
    where = Path(path).parent / pf.file
    if want == "all":
        out = [_pair_line(where, k, line) for k, line in _lines(where)]
        if len(out) != pf.count:
            raise UsageError(f"{path}: its pairs file {where} holds {len(out)} pairs, the "
                             f"document says {pf.count}: not this matrix's")
        return out
    target = want if want is not None else pf.slowest_fitted
    if target is None:
        return []
    found = bisect_pair_line(where, (target[0], target[1]))
    if found is not None:
        return [_typed_line(where, "of that pair", found)]
    prefix = f'{{"pair":[{target[0]},{target[1]}],'  # (a file not in order: read in lines)
    return next(([_typed_line(where, k, line)] for k, line in _lines(where)
                 if line.startswith(prefix)), [])


def _pair_at(line: bytes) -> tuple[int, int] | None:
    """The pair a line starts with ('{"pair":[I,J],'), or None."""
    head = line[:40]
    if not head.startswith(b'{"pair":['):
        return None
    inner = head[9:].split(b"]", 1)[0].split(b",")
    try:
        return (int(inner[0]), int(inner[1])) if len(inner) == 2 else None
    except ValueError:
        return None


def bisect_pair_line(where: Path, want: tuple[int, int]) -> str | None:
    """The line of pair `want` found by bisecting the file's bytes (kvbench matrix writes the
    lines in pair order): ~40 short reads of a million-line file, not a pass over its GBs.
    None when not found so (a missing pair, or lines not in order: the caller reads in
    lines, and says which line is bad)."""
    try:
        f = open(where, "rb")
    except FileNotFoundError:
        raise UsageError(f"its pairs file {where} is missing (keep the matrix's {PAIRS_SUFFIX} "
                         "beside its .json)") from None
    except OSError as exc:
        raise UsageError(f"its pairs file {where} cannot be read: {exc}") from None
    with f:
        lo, hi = 0, f.seek(0, 2)  # lo: a line's start; hi: past the last candidate start
        while lo < hi:
            mid = (lo + hi) // 2
            if mid > lo:  # to the first line that starts at or after mid
                f.seek(mid - 1)
                f.readline()
            else:
                f.seek(mid)
            start = f.tell()
            if start >= hi:  # no line starts in [mid, hi): the answer is at lo or not here
                hi = mid
                continue
            at = _pair_at(f.readline(MAX_PAIR_LINE + 1))
            if at is None:
                return None
            if at < want:
                lo = f.tell()
            elif at > want:
                hi = start
            else:
                f.seek(start)
                line = f.readline(MAX_PAIR_LINE + 1)
                return line.decode("utf-8", "replace") if len(line) <= MAX_PAIR_LINE else None
        f.seek(lo)
        line = f.readline(MAX_PAIR_LINE + 1)
        if _pair_at(line) == want and len(line) <= MAX_PAIR_LINE:
            return line.decode("utf-8", "replace")
    return None


def _typed_line(where: Path, k: int | str, line: str) -> dict:
    """One pair's line, checked against its model alone (its line number named on a
    problem), before the document around it is checked again with it."""
    entry = _pair_line(where, k, line)
    parse(PairEntry, entry, f"{where}: line {k}")
    return entry


def _lines(where: Path):
    try:
        with open(where, encoding="utf-8") as f:
            for k, line in enumerate(iter(lambda: f.readline(MAX_PAIR_LINE + 1), ""), 1):
                if len(line) > MAX_PAIR_LINE:
                    raise UsageError(f"{where}: line {k} is over {MAX_PAIR_LINE // MiB} MiB: not "
                                     "a matrix's pairs file")
                yield k, line
    except FileNotFoundError:
        raise UsageError(f"its pairs file {where} is missing (keep the matrix's {PAIRS_SUFFIX} "
                         "beside its .json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"its pairs file {where} cannot be read: {exc}") from None


def _pair_line(where: Path, k: int | str, line: str) -> dict:
    import json

    try:
        entry = json.loads(line)
    except ValueError as exc:
        raise UsageError(f"{where}: line {k} is not JSON ({exc})") from None
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: line {k} is not a pair's entry (a JSON object)")
    return entry


# ---------------------------------------------------------------------------
# a matrix as the fit of one pair (kvbench plan, plan export)


def parse_pair_choice(text: str | None) -> tuple[int, int] | None:
    """--pair: None or 'slowest' -> None (the slowest pair); 'I,J' -> (I, J)."""
    if text is None or text.strip() == "slowest":
        return None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and len(p.strip()) < 8 for p in parts):
        raise UsageError(f"--pair expects 'slowest' or two ranks I,J (e.g. 0,3), got {text!r}")
    return int(parts[0]), int(parts[1])


def choose_pair(doc: MatrixDocument, path: str, choice: tuple[int, int] | None) -> PairEntry:
    """The named pair, or the slowest fitted pair (lowest effective GB/s: at the payloads a
    plan asks about the rate, not the setup, sets the handoff)."""
    fitted = [p for p in doc.pairs if p.fit is not None and p.effective_gb_s is not None]
    if choice is not None:
        p = doc.pair(*choice)
        if p is None:
            raise UsageError(f"{path}: no pair {list(choice)} in the matrix (ranks 0.."
                             f"{doc.world_size - 1}, i != j)")
        if p not in fitted:
            raise UsageError(f"{path}: pair {p.pair} has no fitted rate"
                             + (f" ({p.not_fitted})" if p.not_fitted else ""))
        return p
    if not fitted:
        raise UsageError(f"{path}: no pair of the matrix has a fitted rate")
    return min(fitted, key=lambda p: p.effective_gb_s)


def pair_draws(doc: MatrixDocument, path: str, row: int) -> list[list[float]]:
    """One pair's draws from the document's draws file, read by memory map (the file of a
    big matrix is never read whole); any problem is one line naming the file."""
    import numpy as np

    df = doc.draws_file
    if df is None:
        raise UsageError(f"{path}: a pair names draws_row {row} but the document has no draws_file")
    where = Path(path).parent / df.file
    try:
        arr = np.load(where, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"{path}: its draws file {where} is missing (keep the matrix's "
                         f"{DRAWS_SUFFIX} beside its .json)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: its draws file {where} cannot be read: {exc}") from None
    if arr.dtype != np.dtype(df.dtype) or list(arr.shape) != df.shape or row >= arr.shape[0]:
        raise UsageError(f"{path}: its draws file {where} holds {arr.dtype} {list(arr.shape)}, "
                         f"the document says {df.dtype} {df.shape} (row {row}): not this "
                         "matrix's")
    values = np.asarray(arr[row], dtype=np.float64)
    if not np.isfinite(values).all():
        raise UsageError(f"{path}: its draws file {where}: row {row} holds a value that is not "
                         "finite")
    return values.tolist()


def pair_label(p: PairEntry) -> str:
    return (f"pair [{p.pair[0]},{p.pair[1]}] {p.sender.host} -> {p.receiver.host} "
            f"({p.path})")


def as_fit_document(doc: MatrixDocument, path: str, choice: tuple[int, int] | None
                    ) -> tuple[dict, str]:
    """(a kvbench.fit/2 document holding the chosen pair's group, one line saying which pair
    and why). The group keeps its fields and gets the pair's ends in its label and group."""
    p = choose_pair(doc, path, choice)
    group = p.fit.model_dump(by_alias=True)
    for part in ("group", "spec"):  # a pair's fit leaves the document's hosts out
        if isinstance(group.get(part), dict) and "hosts" not in group[part]:
            group[part] = {**group[part], "hosts": list(doc.hosts)}
    if p.draws_row is not None:
        group["draws"] = {"columns": DRAW_COLUMNS, "values": pair_draws(doc, path, p.draws_row)}
    group["label"] = f"{pair_label(p)}: {group['label']}"
    group["group"] = {**group["group"], "pair": list(p.pair), "sender_host": p.sender.host,
                      "receiver_host": p.receiver.host}
    n_fitted = (doc.pairs_file.n_fitted if doc.pairs_file is not None
                else sum(1 for q in doc.pairs if q.effective_gb_s is not None))
    how = "named" if choice is not None else f"the slowest of {n_fitted} fitted pairs"
    note = (f"{pair_label(p)}, {p.effective_gb_s:.4g} GB/s: {how} in matrix {path}")
    fit = {"schema": SCHEMA_FIT, "line_rate_gb_s": None, "inputs": list(doc.inputs),
           "groups": [group], "skipped": [], "matrix": {"file": path, "pair": list(p.pair),
                                                        "chosen": how}}
    return fit, note


def load_fit_or_matrix(path: str | Path, pair: str | None = None
                       ) -> tuple[FitDocument, str | None]:
    """A fit file, or a matrix file reduced to one pair's fit (`pair`: --pair's text; None
    is the slowest); with the line saying which pair a matrix gave. Read once, bounded."""
    raw = load_json(path, max(MAX_FIT_BYTES, MAX_MATRIX_BYTES), "fit file", missing="no such file")
    if not is_matrix(raw):
        if pair is not None:
            raise UsageError(f"--pair picks a pair of a kvbench matrix file; {path} is not one "
                             f"(schema {show(raw.get('schema') if isinstance(raw, dict) else raw)})")
        return load_fit_document(path, raw), None
    choice = parse_pair_choice(pair)
    fit, note = as_fit_document(load_matrix_document(path, raw, pairs=choice), str(path),
                                choice)
    return parse(FitDocument, fit, f"{path} (the chosen pair's fit)"), note
