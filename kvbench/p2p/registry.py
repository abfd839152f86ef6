"""A name -> class registry filled by the modules of one package, imported on first use.

Transports and patterns both work this way: a backend is one module that decorates its
class with `@register`, so adding one never means editing the harness."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str, path: Iterable[str], also: str = ""):
        self.kind, self.package, self.path, self.also = kind, package, list(path), also
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, cls: type[T]) -> type[T]:
        self._classes[cls.name] = cls  # type: ignore[attr-defined]
        return cls

    def _load_all(self) -> None:
        """Import every module of the package once (they import heavy packages lazily)."""
        if not self._loaded:
            for mod in pkgutil.iter_modules(self.path):
                if not mod.name.startswith("_") and mod.name != "base":
                    importlib.import_module(f"{self.package}.{mod.name}")
            self._loaded = True

    def available(self) -> dict[str, type[T]]:
        self._load_all()
        return dict(sorted(self._classes.items()))

    def get(self, name: str) -> type[T]:
        self._load_all()
        try:
            return self._classes[name]
        except KeyError:
            choices = ", ".join([self.also] * bool(self.also) + sorted(self._classes))
            raise KeyError(f"unknown {self.kind} {name!r}; choose from {choices}") from None
