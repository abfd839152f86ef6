"""Transport registry. A transport is a module in this package that decorates its class
with `@register`; adding one is a new file, not an edit across the harness."""

from __future__ import annotations

import importlib
import pkgutil

from kvbench.transports.base import Transport

_REGISTRY: dict[str, type[Transport]] = {}
_loaded = False


def register(cls: type[Transport]) -> type[Transport]:
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    """Import every transport module once. Modules import their heavy packages lazily."""
    global _loaded
    if _loaded:
        return
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_") and mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")
    _loaded = True


def available() -> dict[str, type[Transport]]:
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def get(name: str) -> type[Transport]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown transport {name!r}; choose from auto, {', '.join(sorted(_REGISTRY))}") from None
