"""Bounded readers: a file's bytes, JSON, JSON Lines and YAML, each with a limit on every axis.

Why: Python's own parsers trust their input. `json.loads` recurses once per nesting level
(200,000 levels is a RecursionError and a page of traceback), turns a 5,000-digit integer
into a ValueError from deep inside `int()`, reads `NaN` and `Infinity` (which are not JSON)
and keeps the last of two equal keys without a word; PyYAML expands aliases (a "billion
laughs" file spins for minutes) and accepts lists as mapping keys. Every reader here checks
the limit *before or while* parsing and refuses with one line naming the file, the line and
what was wrong (a `UsageError`, exit status 2). What the values *mean* is checked afterwards
by the typed models (kvbench.records.schema.models).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import yaml

from kvbench.errors import PATH_ERRNOS, UsageError, path_error  # noqa: F401 (PATH_ERRNOS: re-exported)

MAX_DEPTH = 64  # nesting levels of any JSON or YAML document kvbench reads
MAX_INT_DIGITS = 20  # 2^64 has 20 digits; every physical quantity kvbench reads is far below
MAX_LINE_BYTES = 64 * 2**20  # one JSON Lines record (a p2p record with 10^6 samples is ~20 MB)
MiB = 2**20

_BRACKETS = str.maketrans("", "", "".join(chr(c) for c in range(128) if chr(c) not in "[]{}"))
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
# a number that may need a careful parse: many digits, or a 3-digit exponent that may overflow.
# Screened on bytes with every digit mapped to b"0" (bytes.translate is a C loop: ~1 us a line).
_DIGITS = bytes.maketrans(b"123456789E", b"000000000e")
_SUSPECTS = (b"0" * (MAX_INT_DIGITS + 1), b"e000", b"e+000", b"e-000")


class _Refused(ValueError):
    """Raised inside a parser hook; `needle` is the text to find for the line number."""

    def __init__(self, message: str, needle: str | None = None, nth: int = 0):
        super().__init__(message)
        self.needle, self.nth = needle, nth


def _line_of(text: str, needle: str | None, nth: int = 0) -> int | None:
    """1-based line of the nth occurrence of needle in text (None when not found)."""
    if not needle:
        return None
    pos = -1
    for _ in range(nth + 1):
        pos = text.find(needle, pos + 1)
        if pos < 0:
            return None
    return text.count("\n", 0, pos) + 1


def _at(where: str, line: int | None) -> str:
    return f"{where}:{line}" if line else where


# ---------------------------------------------------------------------------
# files


def path_kind(path: str | Path, doing: str = "read", follow: bool = True) -> str:
    """'missing', 'dir', 'file', 'link' (follow=False only) or 'other' for a user-named path.

    Why not Path.exists()/is_dir(): they raise on EACCES (a folder that cannot be searched)
    and ENAMETOOLONG, outside any handler; here every error but "not there" is one line.
    """
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        raise path_error(path, exc, doing) from None
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISREG(st.st_mode):
        return "file"
    return "link" if stat.S_ISLNK(st.st_mode) else "other"


def _open(p: Path, what: str, missing: str | None):
    try:
        return open(p, "rb")
    except FileNotFoundError:
        raise UsageError(f"{missing or 'no such ' + what}: {p}") from None
    except IsADirectoryError:
        raise UsageError(f"{p}: is a directory, not a {what}") from None
    except OSError as exc:
        raise path_error(p, exc) from None


def _open_regular(p: Path, what: str, missing: str | None):
    """`p` opened for reading only if it is a regular file. Opened without blocking (a FIFO's
    open() waits for a writer) and checked on the open descriptor (no window between a check
    and the open): for files every MPI rank reads on its own, where a FIFO would serve one
    reader and block the others, past any --timeout."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UsageError(f"{missing or 'no such ' + what}: {p}") from None
    except OSError as exc:
        raise path_error(p, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{p}: not a regular file (a folder, FIFO, socket or device); a {what} "
                         "must be one, read alike by every rank")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bounded(path: str | Path, limit: int, what: str = "file", missing: str | None = None,
                 *, regular: bool = False) -> bytes:
    """A file's bytes, refused when larger than limit (never reads more than limit + 1);
    `regular`: only a regular file (_open_regular)."""
    p = Path(path)
    try:
        with (_open_regular if regular else _open)(p, what, missing) as fh:
            data = fh.read(limit + 1)
    except IsADirectoryError:
        raise UsageError(f"{p}: is a directory, not a {what}") from None
    except OSError as exc:
        raise path_error(p, exc) from None
    if len(data) > limit:
        raise UsageError(f"{p}: larger than {limit // MiB} MiB; kvbench reads at most that "
                         f"for a {what}")
    return data


def read_text_bounded(path: str | Path, limit: int, what: str = "file",
                      missing: str | None = None, *, regular: bool = False) -> str:
    data = read_bounded(path, limit, what, missing, regular=regular)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"cannot read {path}: not UTF-8 text (byte {exc.start})") from None


# ---------------------------------------------------------------------------
# JSON


def check_depth(text: str, where: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than max_depth before the recursive parser sees it."""
    if text.count("[") + text.count("{") <= max_depth:
        return  # cannot be deeper than the number of openers (the common, fast case)
    depth, line = 0, None
    for ch in _STRING.sub('""', text).translate(_BRACKETS):
        if ch in "[{":
            depth += 1
            if depth > max_depth:
                line = None
                if "\n" in text.rstrip("\n"):
                    line = _line_of(text, "[" * (max_depth + 1)) or _line_of(text, "{" * (max_depth + 1))
                raise UsageError(f"{_at(where, line)}: JSON nested deeper than {max_depth} levels")
        else:
            depth -= 1


def _refuse_constant(name: str):
    raise _Refused(f"{name} is not a JSON number (kvbench reads finite numbers only)", name)


def _careful_int(s: str) -> int:
    digits = len(s.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"integer with {digits} digits (kvbench reads at most {MAX_INT_DIGITS})", s)
    return int(s)


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _Refused(f"number {s[:40]} is out of range (not a finite double)", s)
    return v


def _keep_float(s: str) -> float:
    return float(s)


def _unique_pairs(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"duplicate key {k!r}", json.dumps(k), nth=1)
            seen.add(k)
    return d


def _make_decoder(finite: bool, careful: bool) -> json.JSONDecoder:
    hooks: dict = {"object_pairs_hook": _unique_pairs}
    if finite:
        hooks["parse_constant"] = _refuse_constant
    if careful:
        hooks["parse_int"] = _careful_int
        hooks["parse_float"] = _finite_float if finite else _keep_float
    return json.JSONDecoder(**hooks)


_DECODERS = {(f, c): _make_decoder(f, c) for f in (True, False) for c in (True, False)}


def _suspect(text: str) -> bool:
    b = text.encode("utf-8", "replace").translate(_DIGITS)
    s0, s1, s2, s3 = _SUSPECTS
    return s0 in b or s1 in b or s2 in b or s3 in b


def _decoder(text: str, finite: bool) -> json.JSONDecoder:
    """The fast decoder, or the careful one (a Python hook per number) when a number may be extreme."""
    return _DECODERS[(finite, _suspect(text))]


def loads(text: str, where: str, *, finite: bool = True, max_depth: int = MAX_DEPTH):
    """Parse one JSON document within the limits; any problem is one UsageError line.

    finite=False keeps NaN/Infinity (for other tools' files, e.g. vLLM's, whose unread
    fields may hold them); the typed model then refuses them in every field kvbench reads.
    """
    return _parse(text, where, finite, max_depth, many=False)


def loads_many(text: str, where: str, *, finite: bool = True, max_depth: int = MAX_DEPTH) -> list:
    """Several JSON documents back to back (what `vllm bench serve --append-result` writes)."""
    return _parse(text, where, finite, max_depth, many=True)


def _parse(text: str, where: str, finite: bool, max_depth: int, many: bool):
    multiline = "\n" in text.rstrip("\n")  # a JSON Lines line already names its line
    check_depth(text, where, max_depth)
    dec = _decoder(text, finite)
    try:
        return _documents(dec, text) if many else dec.decode(text)
    except _Refused as exc:
        line = _line_of(text, exc.needle, exc.nth) if multiline else None
        raise UsageError(f"{_at(where, line)}: {exc}") from None
    except json.JSONDecodeError as exc:
        if text.startswith("\ufeff"):  # Windows editors add it; json refuses it as "Expecting value"
            raise UsageError(f"{where}: starts with a byte-order mark (U+FEFF): save it as UTF-8 "
                             "without one") from None
        line = exc.lineno if multiline else None
        raise UsageError(f"{_at(where, line)}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # only if max_depth was set above what the interpreter allows
        raise UsageError(f"{where}: JSON nested too deeply") from None


def _documents(dec: json.JSONDecoder, text: str) -> list:
    docs, i, n = [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return docs
        doc, i = dec.raw_decode(text, i)
        docs.append(doc)


def load_json(path: str | Path, limit: int, what: str = "JSON file", *, finite: bool = True,
              missing: str | None = None, regular: bool = False):
    """One JSON document from a file of at most limit bytes (`regular`: read_bounded's)."""
    return loads(read_text_bounded(path, limit, what, missing, regular=regular), str(path),
                 finite=finite)


def iter_lines(path: str | Path, what: str = "JSON Lines file", max_line: int = MAX_LINE_BYTES,
               missing: str | None = None) -> Iterator[tuple[str, bytes]]:
    """(FILE:LINE, raw bytes) of every non-blank line, one at a time, each at most max_line."""
    p = Path(path)
    with _open(p, what, missing) as fh:
        lineno = 0
        while True:
            try:
                raw = fh.readline(max_line + 1)
            except OSError as exc:
                raise path_error(p, exc) from None
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line:
                raise UsageError(f"{p}:{lineno}: line longer than {max_line // MiB} MiB")
            if raw.strip():
                yield f"{p}:{lineno}", raw


def decode_line(raw: bytes, where: str) -> object:
    """One JSON Lines line through the bounded JSON reader."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"cannot read {where}: not UTF-8 text (byte {exc.start})") from None
    return loads(line, where)


def iter_jsonl(path: str | Path, what: str = "JSON Lines file", max_line: int = MAX_LINE_BYTES,
               missing: str | None = None) -> Iterator[tuple[str, object]]:
    """(FILE:LINE, value) for every non-blank line, read one line at a time (memory: one line)."""
    for where, raw in iter_lines(path, what, max_line, missing):
        yield where, decode_line(raw, where)


# plain_line's screen, one C pass over the line: digits -> "0", "E" -> "e" (as _DIGITS), tab and
# carriage return -> " " (a space before a colon is one pattern), and both signs -> "e", so
# that "e000", "e+000" and "e-000" (a 3-digit exponent) are all found as "e000" by one search
_SCREEN = bytes.maketrans(b"123456789E\t\r+-", b"000000000e  ee")
_MANY_DIGITS, _EXPONENT = b"0" * (MAX_INT_DIGITS + 1), b"e000"


def plain_line(raw: bytes) -> bool:
    """True when a line can take the fast path (pydantic's own JSON parser) without losing a check.

    The fast parser keeps the last of two equal keys, reads NaN/Infinity and very long
    integers, and refuses deep nesting with its own words; a line that might hold any of
    these (or spaces before a colon, which hide keys from the key count) takes the careful
    path of `loads` instead. The screen may send a line to the careful path that did not
    need it (a word such as "node-000"), never the other way.
    """
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
        return False
    b = raw.translate(_SCREEN)
    if b"NaN" in b or b"Infinity" in b or b'" :' in b or _MANY_DIGITS in b:
        return False
    return not (_EXPONENT in b and _exponent_in_number(b))


def _exponent_in_number(b: bytes) -> bool:
    """Is some 3-digit exponent of the screened bytes (_SCREEN) part of a JSON number?

    A number follows ':', '[' or ',' (and white space); a hex id such as "91e013fad477" matches
    the byte screen but follows a quote or a letter. Scans only the screen's hits: at each
    "e000", the mantissa before its "e" or, where a sign (now "e") stands between, before that.
    """
    i = b.find(_EXPONENT)
    while i >= 0:
        if _mantissa_before(b, i - 1) or i > 0 and b[i - 1] == 101 and _mantissa_before(b, i - 2):
            return True
        i = b.find(_EXPONENT, i + 1)
    return False


def _mantissa_before(b: bytes, end: int) -> bool:
    """Do the screened bytes up to `end` end with a number's mantissa ([sign] digits and dots,
    the sign now "e") that follows ':', '[', ',' or the start, white space between?"""
    j = end
    while j >= 0 and b[j] in b"0.":  # the mantissa (digits are all b"0" here)
        j -= 1
    if j == end:
        return False
    if j >= 0 and b[j] == 101:  # a sign ("-" or "+", screened to "e")
        j -= 1
    while j >= 0 and b[j] in b" \n":
        j -= 1
    return j < 0 or b[j] in b":[,"


# ---------------------------------------------------------------------------
# YAML


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader without the features that make YAML unbounded or ambiguous.

    Refused: aliases and anchors (the "billion laughs" expansion), keys that are not
    scalars (a list or mapping as a key), nesting deeper than MAX_DEPTH, integers longer
    than MAX_INT_DIGITS digits, non-finite floats (.inf, .nan, 1e400), a key given twice.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor}: kvbench does not read YAML aliases "
                "(write the value out)", event.start_mark)
        if getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(
                None, None, f"anchor &{event.anchor}: kvbench does not read YAML anchors "
                "(write the value out)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _yaml_error(node, message: str):
    return yaml.constructor.ConstructorError(None, None, message, node.start_mark)


def _yaml_mapping(loader, node, deep=False):
    keys = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise _yaml_error(key_node, "a key must be a plain value, not a list or mapping")
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise _yaml_error(key_node, f"duplicate key {key!r}")
        keys.add(key)
    return loader.construct_mapping(node, deep)


def _yaml_int(loader, node):
    digits = sum(ch.isdigit() for ch in node.value)
    if digits > MAX_INT_DIGITS:
        raise _yaml_error(node, f"integer with {digits} digits (kvbench reads at most {MAX_INT_DIGITS})")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


def _yaml_float(loader, node):
    value = yaml.SafeLoader.construct_yaml_float(loader, node)
    if not math.isfinite(value):
        raise _yaml_error(node, f"{node.value[:40]} is not a finite number")
    return value


BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _yaml_mapping)
BoundedLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)
BoundedLoader.add_constructor("tag:yaml.org,2002:float", _yaml_float)


def yaml_loads(text: str, where: str):
    """One YAML document within the limits; any problem is one UsageError line with its line."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{_at(where, line)}: not valid YAML ({what})") from None


def load_yaml(path: str | Path, limit: int, what: str = "YAML file", missing: str | None = None):
    return yaml_loads(read_text_bounded(path, limit, what, missing), str(path))
