"""Pattern registry: a handoff shape is a module here that decorates its class with
`@register` (sequential, layerwise, sharded, ...)."""

from __future__ import annotations

import importlib
import pkgutil

from kvbench.patterns.base import Pattern

_REGISTRY: dict[str, type[Pattern]] = {}
_loaded = False


def register(cls: type[Pattern]) -> type[Pattern]:
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    global _loaded
    if not _loaded:
        for mod in pkgutil.iter_modules(__path__):
            if not mod.name.startswith("_") and mod.name != "base":
                importlib.import_module(f"{__name__}.{mod.name}")
        _loaded = True


def available() -> dict[str, type[Pattern]]:
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def get(name: str) -> type[Pattern]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown pattern {name!r}; choose from {', '.join(sorted(_REGISTRY))}") from None
