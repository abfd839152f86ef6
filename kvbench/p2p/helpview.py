"""What `kvbench p2p --help` shows: the flags a user measuring a link needs, and each
transport's and pattern's own flags only once it is chosen.

Every transport and pattern adds its own flags (their `add_arguments`); listed together
they were 42 of the 74 options, NIXL's engine-shape knobs among them, which a user measuring
a link never needs and could not tell apart from what they do. The parser still holds every
flag (each works exactly as before, chosen or not: a flag given with the wrong transport is
refused by that transport's `check_arguments`, not by an unknown-flag error); only the help
leaves out the groups of transports and patterns not named on the command line, and says in
one line per transport and pattern how to see them:

    kvbench p2p --transport nixl --help
    kvbench p2p --pattern layerwise --help
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence

# "transport" / "pattern" -> the flag that chooses one
CHOOSERS = {"transport": "--transport", "pattern": "--pattern"}


def add_owned(parser: argparse.ArgumentParser, kind: str,
              classes: Mapping[str, type]) -> dict[tuple[str, str], list[argparse.Action]]:
    """Let each class add its flags; {(kind, name): the actions it added}."""
    owned = {}
    for name, cls in classes.items():
        before = len(parser._actions)
        cls.add_arguments(parser)
        owned[(kind, name)] = parser._actions[before:]
    return owned


def chosen(argv: Sequence[str], flag: str) -> set[str]:
    """The names given to `flag` on the command line (`--pattern a,b` names two), read as
    the parser will: `--flag X` or `--flag=X`, the last one winning."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return {v.strip() for v in str(value or "").split(",") if v.strip()}


def visible(actions: Iterable[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help != argparse.SUPPRESS]


def summary(owned: Mapping[tuple[str, str], list[argparse.Action]], prog: str) -> str:
    """One line per transport and pattern: how many flags of its own, and how to see them."""
    lines = []
    width = max([22] + [len(f"{kind} {name}  ") for kind, name in owned])  # store-layerwise
    for (kind, name), actions in owned.items():
        n = len(visible(actions))
        how = (f"{n} flag{'s' * (n != 1)}: {prog} {CHOOSERS[kind]} {name} --help" if n
               else "no flags of its own")
        lines.append(f"{kind + ' ' + name:<{width}}{how}")  # (not an option line: no dash)
    return "\n".join(lines)


class ChosenHelp(argparse.ArgumentParser):
    """An ArgumentParser whose help shows the owned groups of the chosen transport and
    patterns only (`owned`, from add_owned); parsing is untouched."""

    owned: dict[tuple[str, str], list[argparse.Action]]
    _argv: list[str]

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        import sys

        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        argv = getattr(self, "_argv", [])
        picked = {kind: chosen(argv, flag) for kind, flag in CHOOSERS.items()}
        hidden = [a for (kind, name), actions in getattr(self, "owned", {}).items()
                  if name not in picked[kind] for a in visible(actions)]
        saved = [(a, a.help) for a in hidden]
        for a in hidden:
            a.help = argparse.SUPPRESS
        try:
            return super().format_help()
        finally:
            for a, text in saved:
                a.help = text
