"""Typed, bounded values and the one-line message for a value that is not one.

Every model kvbench reads a file into is strict (no bool where a number is expected, no
"300" where 300 is), finite (no NaN or infinity) and bounded by what is physically
possible. The bounds are generous on purpose: they stop a typo or a hostile file from
turning into a 10^400-byte allocation or a loop that never ends, not a real model or run.
Validation is pydantic v2 (`pydantic-core`), chosen over hand-written isinstance checks:
one declaration per field, every error with its path.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from kvbench.errors import UsageError

# physical bounds (see docs/robustness.md)
MAX_BYTES = 2**53 - 1  # exact in a double, and ~9 PB: more than any KV payload
MAX_LAYERS = 10_000
MAX_HEADS = 65_536
MAX_WIDTH = 2**20  # hidden / intermediate / head / latent widths (largest models: ~10^5)
MAX_TOKENS = 10**9
MAX_COUNT = 10**12  # samples, requests, transfers
MAX_TIME_MS = 1e13  # ~317 years: any clock origin a record may use, epoch ms included
MAX_RATE_RPS = 1e6
MAX_GBPS = 1e6  # 1 PB/s
MIN_GBPS = 1e-6  # 1 kB/s: below it no handoff ends in a day
MAX_SECONDS = 1e7  # ~116 days
MAX_TEXT = 4096  # characters of a name, label or message

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
PositiveTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Layers = Annotated[int, Field(ge=1, le=MAX_LAYERS)]
Heads = Annotated[int, Field(ge=1, le=MAX_HEADS)]
Width = Annotated[int, Field(ge=1, le=MAX_WIDTH)]
TimeMs = Annotated[float, Field(ge=0, le=MAX_TIME_MS, allow_inf_nan=False)]
SignedMs = Annotated[float, Field(ge=-MAX_TIME_MS, le=MAX_TIME_MS, allow_inf_nan=False)]
RateRps = Annotated[float, Field(gt=0, le=MAX_RATE_RPS, allow_inf_nan=False)]
GBps = Annotated[float, Field(ge=MIN_GBPS, le=MAX_GBPS, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
def _utc_stamp(v: str) -> str:
    """A UTC time stamp, checked once per distinct text (a job's records share one stamp:
    strptime was about a fifth of a matrix record's model_validate_json in a profile)."""
    if v in _GOOD_STAMPS:
        return v
    import datetime

    try:
        t = datetime.datetime.strptime(v.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S%z")
    except ValueError:
        raise refuse(f"must be a UTC time such as 2026-12-02T17:54:43Z, got {show(v)}") from None
    if not 1970 <= t.year <= 2200:  # what a table's nanosecond timestamps hold, with room
        raise refuse(f"year {t.year} is outside 1970..2200")
    if len(_GOOD_STAMPS) >= 4096:
        _GOOD_STAMPS.clear()
    _GOOD_STAMPS.add(v)
    return v


_GOOD_STAMPS: set[str] = set()  # stamps _utc_stamp accepted


UtcStamp = Annotated[str, Field(max_length=40), AfterValidator(_utc_stamp)]
ExactInt = Annotated[int, Field(ge=-(2**53 - 1), le=2**53 - 1)]  # exact in a double and in a table's int64
Finite = Annotated[float, Field(ge=-1e300, le=1e300, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
MAX_US_PER_DESC = 1e6  # one second per descriptor: far beyond any transfer list's entry
UsPerDesc = Annotated[float, Field(ge=-MAX_US_PER_DESC, le=MAX_US_PER_DESC, allow_inf_nan=False)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT, pattern=r"\S")]
AnyText = Annotated[str, Field(max_length=MAX_TEXT * 16)]


class Strict(BaseModel):
    """Base of every input model: strict types, finite numbers, unknown keys refused."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True,
                              populate_by_name=True)


class Open(Strict):
    """An input model of another tool's file: the fields kvbench reads are checked, the rest kept."""

    model_config = ConfigDict(extra="allow")


def refuse(message: str) -> PydanticCustomError:
    """An error raised by a model's own check: printed as it is, after the file and path."""
    return PydanticCustomError("kvbench", message)


_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlevel, _show.maxlist, _show.maxdict = 60, 60, 2, 4, 4


def show(value: Any) -> str:
    """A value as the user wrote it, cut short (a 10 MB string or list is not echoed)."""
    try:
        return _show.repr(value)
    except ValueError:  # an integer too long for str()
        return "<an integer with too many digits>"


def key_path(loc: tuple) -> str:
    """('groups', 0, 'setup_ms') -> 'groups[0].setup_ms'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_EXPECTED = {
    "missing": "missing", "extra_forbidden": "unknown key", "int_type": "must be an integer",
    "float_type": "must be a number", "string_type": "must be a string",
    "bool_type": "must be true or false", "list_type": "must be a list",
    "dict_type": "must be an object", "model_type": "must be an object",
    "model_attributes_type": "must be an object", "string_pattern_mismatch": "must be a non-empty string",
    "finite_number": "must be a finite number",
}


def _expected(err: dict) -> str:
    msg = err["msg"]
    if err["type"] in _EXPECTED:
        return _EXPECTED[err["type"]]
    ctx = err.get("ctx") or {}
    if err["type"] == "too_short":
        return f"must have at least {ctx.get('min_length')} entries"
    if err["type"] == "too_long":
        return f"must have at most {ctx.get('max_length')} entries"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    msg = msg.replace("Input should be", "must be").replace("Input should have", "must have")
    for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<="),
                        ("greater than", ">"), ("less than", "<")):
        msg = msg.replace(words, sign)
    return msg


def one_line(exc: ValidationError, where: str, prefix: str = "", unknown_hint: str = "") -> str:
    """The first problem as WHERE: PATH: EXPECTED, got VALUE (+N more)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    path = key_path(err["loc"])
    if prefix:
        path = f"{prefix}.{path}" if path else prefix
    head = f"{where}: {path}: " if path else f"{where}: "
    if err["type"] == "kvbench":
        text = head + err["msg"]
    elif err["type"] == "missing":
        text = head + _expected(err)
    elif err["type"] == "extra_forbidden":
        text = head + _expected(err) + unknown_hint
    else:
        text = f"{head}{_expected(err)}, got {show(err['input'])}"
    if len(errors) > 1:
        text += f" (+{len(errors) - 1} more)"
    return text


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], data: object, where: str, prefix: str = "", unknown_hint: str = "") -> M:
    """Validate decoded data into model; any problem is one UsageError line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise UsageError(one_line(exc, where, prefix, unknown_hint)) from None


def _keys(v) -> int:
    """How many object keys a validated value holds (a model's set fields, dicts, nested)."""
    t = type(v)
    if t is dict:
        return len(v) + sum(_keys(x) for x in v.values() if type(x) in _NESTED)
    if t is list:
        return 0 if _SCALARS.issuperset(map(type, v)) else sum(_keys(x) for x in v)
    if isinstance(v, BaseModel):
        extra = v.__pydantic_extra__
        # (pydantic >= 2.11 lists an Open model's extra keys in model_fields_set too)
        n = len(v.__pydantic_fields_set__.union(extra)) if extra else len(v.__pydantic_fields_set__)
        scalars = _SCALARS
        for x in v.__dict__.values():
            if type(x) not in scalars:  # (isinstance on a pydantic model is slow: test it last)
                n += _keys(x)
        for x in extra.values() if extra else ():
            if type(x) not in scalars:
                n += _keys(x)
        return n
    return 0


_SCALARS = frozenset((float, int, str, bool, type(None)))
_NESTED = (dict, list)


def parse_line_fast(model: type[M], raw: bytes) -> M | None:
    """A JSON Lines line validated by pydantic's own (Rust) JSON parser, or None.

    None means "take the careful path" (kvbench.records.schema.read.loads, then parse): the line may
    hold something the fast parser does not refuse (see read.plain_line), a key may be given
    twice (the key count differs from the text's), or the line is invalid, in which case the
    careful path words the one-line message.
    """
    from kvbench.records.schema.read import plain_line

    if not plain_line(raw):
        return None
    try:
        m = model.model_validate_json(raw)
    except ValidationError:
        return None
    return m if _keys(m) == raw.count(b'":') else None


_ADAPTERS: dict = {}


def check_value(tp: Any, value: object, where: str) -> Any:
    """Validate one value against an annotated type (e.g. a plan's leaf): UsageError line."""
    adapter = _ADAPTERS.get(tp)
    if adapter is None:
        adapter = _ADAPTERS[tp] = TypeAdapter(tp, config=ConfigDict(strict=True))
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise UsageError(one_line(exc, where)) from None
