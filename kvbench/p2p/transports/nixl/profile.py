"""`--nixl-engine-profile`: the engine-shaped handoff's knobs as one named, shipped file.

The engine shape (kvbench.p2p.transports.nixl.engine_shape) has a dozen knobs: how the
engine polls, how its threads wait, its UCX threads, the progress thread's delay, the gaps
between requests and decode's work inside them. A user measuring a link needs none of them,
and the lab's what-ifs each change one or two. So they live in profiles, small JSON files
shipped in profiles/ (package data), one per configuration the project runs:

    vllm-0.32     what vLLM 0.32.0's NIXL connector does (every key; the defaults of all others)
    lab           the lab's deployment: vllm-0.32 with its connector's 1 ms progress delay
    waits-yield, waits-spin, announce-nixl   the lab's what-ifs one step from the engine
    replica       decode as it runs under load: Poisson gaps, vLLM's worker waits
    descriptors   the engine's descriptor plan, busy-polled (docs/descriptors.md)

`--nixl-engine-profile SPEC`, SPEC = `NAME`, `FILE` (a path: it holds a `/` or ends in
`.json`), either followed by `:key=value,...`, or `:key=value,...` alone. Every SPEC is a
layer: its keys set over the ones before it, starting from vllm-0.32's, so the flag may be
given more than once (`--nixl-engine-profile lab --nixl-engine-profile waits-yield` is the
lab's engine with yielding waits; the lab builds its configurations so). A value that
varies per run (a gap computed from a rate, a drawn-poll file) is an override:
`--nixl-engine-profile replica:gap_ms=250,busy_ms=104.2,poll=draw:steps.json`.

Any SPEC selects the engine shape. Its values land on the option names the transport and
engine_shape read (`nixl_<key>`), each checked with the bounds the separate flags had; the
checks between keys (gap_ms with gaps=exp, ...) run with the rest of the flags
(engine_shape.usage_error). The old flags give a one-line hint naming the new spelling.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvbench.cli import OldSpelling
from kvbench.errors import UsageError, bounded_float, bounded_int
from kvbench.p2p.transports.nixl.binding import MAX_NIXL_THREADS, MAX_PROGRESS_DELAY_US
from kvbench.records.schema.read import load_json

FLAG = "--nixl-engine-profile"
BASE = "vllm-0.32"  # every profile's starting point: its file holds every key
MAX_PROFILE_BYTES = 1 << 20
MAX_LAYERS = 32


@dataclass(frozen=True)
class Key:
    """One knob: its type, and the bounds or choices its flag had."""

    kind: str  # bool, int, float, choice, text
    lo: float = 0
    hi: float = 0
    choices: tuple[str, ...] = ()
    what: str = ""


KEYS: dict[str, Key] = {
    "per_request": Key("bool", what="make_prepped_xfer + post + release per handoff; false: "
                                    "one handle made once and reposted"),
    "poll": Key("text", what="completion polling: busy, fixed:MS or draw:FILE"),
    "waits": Key("choice", choices=("sleep", "yield", "spin", "engine"),
                 what="how the engine's threads wait between looks at NIXL"),
    "spin_window_ms": Key("float", 0, 60_000, what="waits=engine: yield-spin this long after "
                                                   "the last work, then sleep (ms)"),
    "announce": Key("choice", choices=("mpi", "nixl"),
                    what="how prefill tells decode a request is ready"),
    "threads": Key("int", 0, MAX_NIXL_THREADS, what="UCX worker threads of the agent"),
    "telemetry": Key("bool", what="NIXL's per-transfer telemetry"),
    "progress_delay_us": Key("int", 0, MAX_PROGRESS_DELAY_US,
                             what="the progress thread's delay between polls (us)"),
    "gap_ms": Key("float", 0, 60_000, what="idle time before each handoff (ms)"),
    "gaps": Key("choice", choices=("fixed", "exp"), what="gaps fixed, or drawn exponentially"),
    "busy_ms": Key("float", 0, 60_000, what="decode's work after each handoff, inside the gap (ms)"),
    "gap_seed": Key("int", 0, 2**31 - 1, what="gaps=exp: the generator's seed"),
}
META = ("description",)  # keys a profile file may hold besides the knobs
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def shipped() -> dict[str, Path]:
    """name -> file of the profiles shipped in the package."""
    folder = resources.files(__package__) / "profiles"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")}


def value_of(key: str, raw) -> object:
    """A knob's value from a file's JSON value or an override's text, checked as its flag
    checked it. Raises UsageError naming the key."""
    if key not in KEYS:
        raise UsageError(f"{key!r} is not an engine-profile key; keys: {', '.join(KEYS)}")
    k, text = KEYS[key], raw if isinstance(raw, str) else json.dumps(raw)
    if k.kind == "bool":
        if isinstance(raw, bool):
            return raw
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise UsageError(f"{key} must be true or false, got {text[:40]!r}")
    if isinstance(raw, bool):  # JSON true is no number
        raise UsageError(f"{key} must be a number, got {text}")
    if k.kind == "int":
        return bounded_int(text, key, int(k.lo), int(k.hi))
    if k.kind == "float":
        return bounded_float(text, key, k.lo, k.hi)
    if not isinstance(raw, str):
        raise UsageError(f"{key} must be a string, got {text[:40]}")
    if k.kind == "choice" and raw not in k.choices:
        raise UsageError(f"{key} {raw!r}: one of {', '.join(k.choices)}")
    if not raw or len(raw) > 4096:
        raise UsageError(f"{key}: an empty or overlong value")
    return raw


def read_file(path: str) -> dict:
    """A profile file's knobs (a JSON object of keys; `description` is read and dropped). Read
    as every rank's side files are: a regular file, bounded (kvbench.records.schema.read)."""
    doc = load_json(path, MAX_PROFILE_BYTES, "profile", missing="no such profile file",
                    regular=True)
    if not isinstance(doc, dict):
        raise UsageError(f"profile {path}: a JSON object of keys, got {type(doc).__name__}")
    try:
        return {k: value_of(k, v) for k, v in doc.items() if k not in META}
    except UsageError as exc:
        raise UsageError(f"profile {path}: {exc}") from None


def _source(name: str) -> dict:
    if "/" in name or name.endswith(".json"):
        return read_file(name)
    files = shipped()
    if name not in files:
        raise UsageError(f"no engine profile {name!r}; shipped: {', '.join(sorted(files))} "
                         "(or a FILE path)")
    return read_file(str(files[name]))


def layer(spec: str) -> dict:
    """One SPEC's keys: the named profile's (if any), then its overrides."""
    name, sep, rest = str(spec).partition(":")
    out = _source(name.strip()) if name.strip() else {}
    if sep and not rest.strip():
        raise UsageError(f"{spec!r}: nothing after ':' (give key=value,...)")
    for item in rest.split(",") if rest.strip() else ():
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"{item.strip()!r}: an override is key=value")
        out[key.strip()] = value_of(key.strip(), value.strip())
    if not name.strip() and not out:
        raise UsageError("an empty profile: give NAME, FILE or :key=value")
    return out


def resolve(specs: list[str]) -> tuple[dict, set[str]]:
    """Every knob's value after the layers in order, and the keys a layer changed (the
    checks between keys look at those: vllm-0.32's own values never trip one)."""
    values, given = _source(BASE), set()
    if set(values) != set(KEYS):
        raise UsageError(f"profile {BASE}: must hold every key ({', '.join(KEYS)})")
    for spec in specs:
        for k, v in layer(spec).items():
            if values[k] != v or type(values[k]) is not type(v):
                given.add(k)
            values[k] = v
    return values, given


def spec_text(name: str = "", **overrides) -> str:
    """A SPEC from a profile name (or none: a layer of overrides alone) and key=value
    overrides, as the lab writes them: spec_text("lab", progress_delay_us=0) is
    `lab:progress_delay_us=0`. Values are checked as the parser will check them."""
    for k, v in overrides.items():
        value_of(k, str(v).lower() if isinstance(v, bool) else str(v))
    items = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in overrides.items())
    return name + (f":{items}" if items else "")


def flag(name: str = "", **overrides) -> str:
    """The command-line words `--nixl-engine-profile SPEC` (spec_text)."""
    return f"{FLAG} {spec_text(name, **overrides)}"


class ProfileAction(argparse.Action):
    """Stacks each SPEC given and spreads the result onto the transport's option names."""

    def __call__(self, parser, namespace, values, option_string=None):
        specs = [*(getattr(namespace, "nixl_engine_profile", None) or []), values]
        if len(specs) > MAX_LAYERS:
            parser.error(f"argument {FLAG}: at most {MAX_LAYERS} layers")
        try:
            knobs, given = resolve(specs)
        except UsageError as exc:
            parser.error(f"argument {FLAG}: {exc}")
        namespace.nixl_engine_profile = specs
        namespace.nixl_profile_given = sorted(given)
        namespace.nixl_shape = "engine"
        for k, v in knobs.items():
            setattr(namespace, f"nixl_{k}", v)


# What the transport reads when no profile is given (the link shape): the old flags' defaults.
LINK_DEFAULTS = dict(nixl_shape="link", nixl_engine_profile=None, nixl_profile_given=[],
                     nixl_per_request=True, nixl_poll=None, nixl_waits=None, nixl_announce=None,
                     nixl_spin_window_ms=None, nixl_threads=None, nixl_telemetry=None,
                     nixl_progress_delay_us=0, nixl_gap_ms=0.0, nixl_gaps="fixed",
                     nixl_busy_ms=0.0, nixl_gap_seed=0)

# The flags the profile replaced: flag -> (key, value when the flag takes none).
OLD_FLAGS = {
    "--nixl-per-request": ("per_request", "true"), "--no-nixl-per-request": ("per_request", "false"),
    "--nixl-poll": ("poll", None), "--nixl-waits": ("waits", None),
    "--nixl-announce": ("announce", None), "--nixl-spin-window-ms": ("spin_window_ms", None),
    "--nixl-threads": ("threads", None), "--nixl-telemetry": ("telemetry", "true"),
    "--no-nixl-telemetry": ("telemetry", "false"),
    "--nixl-progress-delay-us": ("progress_delay_us", None), "--nixl-gap-ms": ("gap_ms", None),
    "--nixl-gaps": ("gaps", None), "--nixl-busy-ms": ("busy_ms", None),
    "--nixl-gap-seed": ("gap_seed", None),
}


def hint(flag: str, value: str | None) -> str:
    """The one line an old flag gets: the new spelling of what it asked for."""
    if flag == "--nixl-shape":
        if value == "engine":
            return f"--nixl-shape engine is now {FLAG} {BASE} (docs/nixl.md)"
        return "--nixl-shape is gone: the link shape is the default; drop the flag"
    key, fixed = OLD_FLAGS[flag]
    v = fixed if fixed is not None else (value if value not in (None, "") else "VALUE")
    return f"{flag} is now part of an engine profile: {FLAG} {BASE}:{key}={v}"


def add_arguments(group) -> None:
    """The profile flag, and the old flags as hidden ones that answer with a hint."""
    names = ", ".join(sorted(shipped()))
    group.add_argument(FLAG, action=ProfileAction, metavar="NAME|FILE[:k=v,...]",
                       help="the engine-shaped handoff (vLLM's pull connector: per-layer "
                            "regions, one descriptor per block, a prepped READ per request, "
                            "completion polled per engine step, NIXL telemetry; needs --layout "
                            f"paged --granularity block): a shipped profile ({names}) or a "
                            "JSON file, then key=value overrides; given again, it stacks "
                            f"(docs/nixl.md, \"Engine profiles\"). Default: the link shape")
    group.add_argument("--nixl-shape", action=OldSpelling, hint=hint, dest="_old_nixl_shape",
                       help=argparse.SUPPRESS)
    for flag, (_key, fixed) in OLD_FLAGS.items():
        group.add_argument(flag, action=OldSpelling, hint=hint, nargs=0 if fixed else None,
                           dest=f"_old_{flag.lstrip('-').replace('-', '_')}", help=argparse.SUPPRESS)
    group.set_defaults(**LINK_DEFAULTS)
